"""MNIST, OMNIGLOT and CIFAR-10: original-format readers and `tf.data` pipelines.

Two layers:

1. **Readers** (NumPy only). They read the standard files from a local
   directory and return `(images, labels)` with images laid out
   `(N, H, W, C)`:

   - `"mnist"`: `train-images-idx3-ubyte.gz`, `train-labels-idx1-ubyte.gz`,
     `t10k-images-idx3-ubyte.gz`, `t10k-labels-idx1-ubyte.gz` (or the same
     names without `.gz`) -> uint8 `(N, 28, 28, 1)`, 0-255.
   - `"omniglot"`: `chardata.mat` (the 28x28 IWAE split); else
     `omniglot_105.npz` (105x105 background/evaluation sets, area-averaged
     to 28x28) -> float32 `(N, 28, 28, 1)`, grey levels in [0, 1],
     1 = stroke.
   - `"cifar10"`: `cifar-10-batches-py/` (or its files in the directory
     itself); else `cifar-10-python.tar.gz`; else `cifar10_partial.npz`
     -> uint8 `(N, 32, 32, 3)`, RGB 0-255.

   The first file present wins, in the order listed.

   Labels are int64 `(N,)`: the digit, the CIFAR-10 class, or for OMNIGLOT the
   alphabet (see `read_omniglot_chardata` and `read_omniglot_105`).
   Every reader validates what it reads (magic numbers, dimensions, byte
   counts, keys, value ranges) and raises a `ValueError` naming the file and
   the problem; a missing directory or file raises `FileNotFoundError` listing
   the file names it looked for.

2. **Pipelines**: `make_dataset` turns a split into a `tf.data.Dataset` of
   batches in the models' input range. Binary sets (MNIST, OMNIGLOT) are
   padded by 2 pixels to 32x32 and Bernoulli-binarised (dynamic: a fresh draw
   for every batch; static: one seeded draw, for test sets); CIFAR-10 is
   scaled to [-1, 1] as `k / 127.5 - 1`, with optional horizontal flips.
   Under a `tf.distribute` strategy the globally batched pipeline goes
   through `strategy.experimental_distribute_dataset`, which shards it
   across workers and splits every batch across the replicas; for custom
   loops, `input_context` shards and batches per replica instead.

With `data_dir=None` the data come from `tensorflow_datasets`
(`tfds.load("mnist" | "omniglot" | "cifar10")`), which downloads them: that
path is for machines with a network.

The pipelines are plain `tf.data`, which Keras 3 `fit` accepts on every
backend. On the JAX and PyTorch backends TensorFlow is only the input
pipeline, so `make_dataset` hides the GPUs from TensorFlow (when TensorFlow
has not yet initialised its devices) to keep it from reserving their memory.

Example:

>>> from keras_avae import datasets
>>> train = datasets.make_dataset("mnist", "train", data_dir="data/mnist",
...     batch_size=32, seed=0)                                  # doctest: +SKIP
>>> next(iter(train)).shape                                     # doctest: +SKIP
TensorShape([32, 32, 32, 1])
"""

import gzip
import io
import logging
import os
import pathlib
import pickle
import tarfile
import zlib

import numpy as np

logger = logging.getLogger(__name__)

#: The dataset names `load` and `make_dataset` accept.
NAMES = ("mnist", "omniglot", "cifar10")

#: The splits `load` and `make_dataset` accept.
SPLITS = ("train", "test")

_IMAGE_SHAPES = {"mnist": (32, 32, 1), "omniglot": (32, 32, 1), "cifar10": (32, 32, 3)}
_BINARY = ("mnist", "omniglot")
_PAD = 2

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_CHARDATA = "chardata.mat"
_OMNIGLOT_105 = "omniglot_105.npz"
_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_TAR = "cifar-10-python.tar.gz"
_CIFAR_PARTIAL = "cifar10_partial.npz"
_CIFAR_BATCHES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}

# IDX element types: code -> big-endian NumPy dtype.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------


def _check_name(name):
    if name not in NAMES:
        raise ValueError(f"`name` must be one of {NAMES}. Received: name={name!r}")


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}. Received: split={split!r}")


def _is_int(value, minimum):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum


def image_shape(name):
    """The `(H, W, C)` of the images `make_dataset(name, ...)` yields.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.

    Returns:
        A tuple: `(32, 32, 1)` for the binary sets (28x28 padded by 2 pixels),
        `(32, 32, 3)` for CIFAR-10.

    Example:

    >>> image_shape("mnist")
    (32, 32, 1)
    """
    _check_name(name)
    return _IMAGE_SHAPES[name]


# ---------------------------------------------------------------------------
# MNIST: IDX files
# ---------------------------------------------------------------------------


def _read_maybe_gzip(path):
    """Bytes of `path`, decompressed when it is gzip (detected by content)."""
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        raise ValueError(f"{path}: the gzip stream is truncated or corrupt ({e}).") from e


def read_idx(path, expected_magic=None):
    """Reads one IDX file (the MNIST format), gzip-compressed or not.

    The header is two zero bytes, a type code (0x08 = unsigned byte), the
    number of dimensions and one big-endian uint32 per dimension; the data
    follow in C order. The file must hold exactly the declared number of
    bytes.

    Args:
        path: the file; compressed files are recognised by their content.
        expected_magic: optional int the 4-byte magic number must equal
            (2051 for MNIST image files, 2049 for label files).

    Returns:
        A NumPy array with the declared shape, in native byte order.

    Raises:
        ValueError: naming the file, for a corrupt gzip stream, a bad magic
            number, or a data size that does not match the header.

    Example:

    >>> images = read_idx("train-images-idx3-ubyte.gz", 2051)  # doctest: +SKIP
    >>> images.shape                                            # doctest: +SKIP
    (60000, 28, 28)
    """
    path = pathlib.Path(path)
    raw = _read_maybe_gzip(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes is too short for an IDX header.")
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(
            f"{path}: bad IDX magic number {magic} (0x{magic:08x}); expected "
            f"{expected_magic} (0x{expected_magic:08x}). Is this the right file?"
        )
    if raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic number 0x{magic:08x}).")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, {header} needed for {ndim} dimensions).")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise ValueError(
            f"{path}: the header declares shape {shape} ({expected} data bytes) but the file "
            f"holds {actual} data bytes: the file {what}."
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def read_mnist(directory, split="train"):
    """Reads an MNIST split from the four original IDX files.

    Looks for `train-images-idx3-ubyte.gz` and `train-labels-idx1-ubyte.gz`
    (`t10k-...` for the test split), or the same names without `.gz`.

    Args:
        directory: folder holding the files.
        split: `"train"` (60,000 images) or `"test"` (10,000).

    Returns:
        `(images, labels)`: uint8 `(N, 28, 28, 1)` with values 0-255 (255 =
        ink) and int64 `(N,)` digits 0-9.

    Example:

    >>> images, labels = read_mnist("data/mnist", "test")  # doctest: +SKIP
    >>> images.shape, images.dtype                         # doctest: +SKIP
    ((10000, 28, 28, 1), dtype('uint8'))
    """
    _check_split(split)
    paths = [_find_one(directory, base) for base in _MNIST_FILES[split]]
    missing = [f"{base}[.gz]" for base, p in zip(_MNIST_FILES[split], paths) if p is None]
    if missing:
        raise FileNotFoundError(f"MNIST {split} split: {', '.join(missing)} not found in {directory}.")
    images = read_idx(paths[0], expected_magic=2051)
    labels = read_idx(paths[1], expected_magic=2049)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"{paths[0]}: expected images of shape (N, 28, 28). Received: shape={images.shape}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"{paths[1]}: expected {images.shape[0]} labels (one per image in {paths[0].name}). "
            f"Received: shape={labels.shape}"
        )
    if labels.size and labels.max() > 9:
        raise ValueError(f"{paths[1]}: labels must be digits 0-9. Received: a label {int(labels.max())}")
    return images[..., None], labels.astype(np.int64)


def _find_one(directory, base):
    for candidate in (base + ".gz", base):
        path = pathlib.Path(directory) / candidate
        if path.is_file():
            return path
    return None


# ---------------------------------------------------------------------------
# OMNIGLOT: chardata.mat and omniglot_105.npz
# ---------------------------------------------------------------------------


def read_omniglot_chardata(path, split="train"):
    """Reads the 28x28 OMNIGLOT split of Burda et al. (IWAE) from `chardata.mat`.

    `data` (train, 784 x 24,345) and `testdata` (test, 784 x 8,070) hold one
    image per column in MATLAB's column-major order, so each column is
    reshaped with `order="F"` (as IWAE's own loader does); the images come
    out upright.

    Args:
        path: the `.mat` file.
        split: `"train"` (`data`) or `"test"` (`testdata`).

    Returns:
        `(images, labels)`: float32 `(N, 28, 28, 1)` with values in [0, 1]
        (1 = stroke) and int64 `(N,)` alphabet indices 0-49, the argmax of the
        one-hot `target` / `testtarget` (-1 when the file has no labels).

    Example:

    >>> images, labels = read_omniglot_chardata("chardata.mat")  # doctest: +SKIP
    >>> images.shape                                              # doctest: +SKIP
    (24345, 28, 28, 1)
    """
    _check_split(split)
    import scipy.io

    path = pathlib.Path(path)
    try:
        mat = scipy.io.loadmat(path)
    except FileNotFoundError:
        raise
    except Exception as e:  # scipy raises several types for bad files.
        raise ValueError(f"{path}: not a readable MATLAB file ({type(e).__name__}: {e}).") from e
    key, target_key = ("data", "target") if split == "train" else ("testdata", "testtarget")
    if key not in mat:
        found = sorted(k for k in mat if not k.startswith("__"))
        raise ValueError(f"{path}: no variable {key!r} for the {split} split. Found: {found}")
    data = np.asarray(mat[key])
    if data.ndim != 2 or data.shape[0] != 784:
        raise ValueError(
            f"{path}: {key!r} must have shape (784, N), one 28x28 image per column. Received: shape={data.shape}"
        )
    data = data.astype(np.float32)
    if data.size and (data.min() < 0 or data.max() > 1):
        raise ValueError(
            f"{path}: {key!r} must hold values in [0, 1]. Received: values in [{data.min()}, {data.max()}]"
        )
    num = data.shape[1]
    # Column n is image(:) of a 28x28 MATLAB array: Fortran order.
    images = np.ascontiguousarray(data.T.reshape(num, 28, 28).transpose(0, 2, 1))[..., None]
    labels = np.full((num,), -1, np.int64)
    if target_key in mat:
        target = np.asarray(mat[target_key])
        if target.ndim != 2 or target.shape[1] != num:
            raise ValueError(
                f"{path}: {target_key!r} must have shape (classes, {num}). Received: shape={target.shape}"
            )
        labels = np.argmax(target, axis=0).astype(np.int64)
    return images, labels


def area_downsample(images, size):
    """Shrinks square images by exact area averaging.

    Output pixel `i` averages the input over `[i * s, (i + 1) * s)` with
    `s = H / size`, weighting partly covered input pixels by the covered
    fraction (what `tf.image.resize(..., method="area")`, OpenCV's
    `INTER_AREA` and PIL's `BOX` compute). Binary inputs become grey levels in
    [0, 1]; the image mean is preserved exactly.

    Args:
        images: array `(N, H, H)`, any real dtype.
        size: the output side, at most `H`.

    Returns:
        float32 array `(N, size, size)`.

    Example:

    >>> x = np.zeros((1, 4, 4)); x[0, :2, :2] = 1
    >>> area_downsample(x, 2)[0].tolist()
    [[1.0, 0.0], [0.0, 0.0]]
    """
    images = np.asarray(images)
    if images.ndim != 3 or images.shape[1] != images.shape[2]:
        raise ValueError(f"`images` must have shape (N, H, H). Received: images.shape={images.shape}")
    side = images.shape[1]
    if not isinstance(size, int) or not 1 <= size <= side:
        raise ValueError(f"`size` must be an int in [1, {side}]. Received: size={size!r}")
    scale = side / size
    lo = np.arange(size)[:, None] * scale
    hi = lo + scale
    pixels = np.arange(side)[None, :]
    weights = (np.clip(np.minimum(hi, pixels + 1) - np.maximum(lo, pixels), 0, None) / scale).astype(np.float32)
    out = np.empty((images.shape[0], size, size), np.float32)
    for start in range(0, images.shape[0], 2048):
        chunk = images[start : start + 2048].astype(np.float32)
        n = chunk.shape[0]
        rows = (chunk.reshape(n * side, side) @ weights.T).reshape(n, side, size)  # (n, H, size)
        cols = rows.transpose(0, 2, 1).reshape(n * size, side) @ weights.T  # (n * size, size): (w, h)
        out[start : start + n] = cols.reshape(n, size, size).transpose(0, 2, 1)
    if images.dtype == bool or (images.size and images.min() >= 0 and images.max() <= 1):
        np.clip(out, 0.0, 1.0, out=out)  # Rounding must not leave [0, 1].
    return out


def read_omniglot_105(path, split="train", size=28):
    """Reads OMNIGLOT from `omniglot_105.npz` and area-averages it to `size`.

    The file (see the data README) holds the original 105x105 binary images,
    1 = stroke: `background` (19,280 images, 30 alphabets) and `evaluation`
    (13,180 images, 20 alphabets). Without `chardata.mat` the library uses
    **background as the train split and evaluation as the test split** (the
    original Lake et al. split, disjoint in alphabets; the IWAE 28x28 split
    mixes alphabets and has 24,345 / 8,070 images, so numbers on the two
    splits are not comparable). Downsampling averages the area of each output
    pixel (`area_downsample`), which gives grey levels in [0, 1] that dynamic
    binarisation then samples.

    Args:
        path: the `.npz` file.
        split: `"train"` (background) or `"test"` (evaluation).
        size: output side (28 to match the 28x28 literature).

    Returns:
        `(images, labels)`: float32 `(N, size, size, 1)` in [0, 1] and int64
        `(N,)` alphabet indices: the position of the alphabet's name among the
        50 names of both sets sorted (-1 when the file has no names).

    Example:

    >>> images, labels = read_omniglot_105("omniglot_105.npz")  # doctest: +SKIP
    >>> images.shape                                             # doctest: +SKIP
    (19280, 28, 28, 1)
    """
    _check_split(split)
    path = pathlib.Path(path)
    key = "background" if split == "train" else "evaluation"
    with _open_npz(path) as npz:
        if key not in npz.files:
            raise ValueError(f"{path}: no array {key!r} for the {split} split. Found: {sorted(npz.files)}")
        raw = _npz_get(npz, key, path)
        if raw.ndim != 3 or raw.shape[1:] != (105, 105):
            raise ValueError(f"{path}: {key!r} must have shape (N, 105, 105). Received: shape={raw.shape}")
        if raw.size and raw.max() > 1:
            raise ValueError(f"{path}: {key!r} must hold 0/1 values (1 = stroke). Received: a value {raw.max()}")
        labels = np.full((raw.shape[0],), -1, np.int64)
        names = [f"{s}_alphabet" for s in ("background", "evaluation")]
        if all(n in npz.files for n in names):
            alphabets = {n: _npz_get(npz, n, path) for n in names}
            vocabulary = np.unique(np.concatenate(list(alphabets.values())))
            labels = np.searchsorted(vocabulary, alphabets[f"{key}_alphabet"]).astype(np.int64)
            if labels.shape[0] != raw.shape[0]:
                raise ValueError(
                    f"{path}: {key + '_alphabet'!r} has {labels.shape[0]} entries for {raw.shape[0]} images."
                )
    return area_downsample(raw, size)[..., None], labels


def _open_npz(path):
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"{path}: not a readable .npz file ({type(e).__name__}: {e}).") from e


def _npz_get(npz, key, path):
    try:
        return npz[key]
    except Exception as e:
        raise ValueError(f"{path}: array {key!r} is truncated or corrupt ({type(e).__name__}: {e}).") from e


# ---------------------------------------------------------------------------
# CIFAR-10: pickled batches (folder or tar.gz) and cifar10_partial.npz
# ---------------------------------------------------------------------------


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10 batches without running arbitrary code.

    A batch is a dict of str/bytes, ints and one NumPy array, so only the
    globals NumPy needs to rebuild an array are allowed.
    """

    _RECONSTRUCT = np.ndarray.__reduce__(np.zeros(1))[0]
    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
        ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): __import__("codecs").encode,
    }

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR-10 batch never does")
        return self._ALLOWED[(module, name)]


def _parse_cifar_batch(raw, source):
    """`(images, labels)` from the bytes of one pickled batch."""
    try:
        batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:
        raise ValueError(
            f"{source}: not a readable CIFAR-10 batch pickle, truncated or corrupt ({type(e).__name__}: {e})."
        ) from e
    if not isinstance(batch, dict):
        raise ValueError(f"{source}: expected a pickled dict. Received: {type(batch).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise ValueError(f"{source}: expected the keys 'data' and 'labels'. Found: {sorted(map(str, batch))}")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise ValueError(f"{source}: 'data' must be a uint8 array (N, 3072). Received: shape={shape}, dtype={dtype}")
    labels = np.asarray(batch["labels"], dtype=np.int64)
    if labels.shape != (data.shape[0],):
        raise ValueError(f"{source}: expected {data.shape[0]} labels. Received: shape={labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{source}: labels must be classes 0-9. Received: values in [{labels.min()}, {labels.max()}]")
    # Each row: 1024 red, 1024 green, 1024 blue values, 32x32 row-major planes.
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, labels


def read_cifar10(path, split="train"):
    """Reads CIFAR-10 from the original python batches.

    Args:
        path: `cifar-10-python.tar.gz`, or the extracted folder holding
            `data_batch_1` ... `data_batch_5` and `test_batch`.
        split: `"train"` (the five data batches, 50,000 images, in order) or
            `"test"` (`test_batch`, 10,000).

    Returns:
        `(images, labels)`: uint8 `(N, 32, 32, 3)` RGB, values 0-255, and
        int64 `(N,)` classes 0-9.

    Example:

    >>> images, labels = read_cifar10("cifar-10-python.tar.gz", "test")  # doctest: +SKIP
    >>> images.shape                                                     # doctest: +SKIP
    (10000, 32, 32, 3)
    """
    _check_split(split)
    path = pathlib.Path(path)
    wanted = _CIFAR_BATCHES[split]
    raws = {}
    if path.is_dir():
        for name in wanted:
            file = path / name
            if not file.is_file():
                raise FileNotFoundError(f"CIFAR-10 {split} split: {name} not found in {path}.")
            raws[name] = (file.read_bytes(), file)
    else:
        try:
            with tarfile.open(path, "r:gz") as tar:
                for member in tar:
                    base = member.name.rsplit("/", 1)[-1]
                    if member.isfile() and base in wanted and base not in raws:
                        raws[base] = (tar.extractfile(member).read(), f"{path}:{member.name}")
        except FileNotFoundError:
            raise
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise ValueError(f"{path}: the tar.gz archive is truncated or corrupt ({type(e).__name__}: {e}).") from e
        missing = [name for name in wanted if name not in raws]
        if missing:
            raise ValueError(f"{path}: the archive lacks {', '.join(missing)} (expected under {_CIFAR_FOLDER}/).")
    parts = [_parse_cifar_batch(*raws[name]) for name in wanted]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def read_cifar10_partial(path, split="train"):
    """Reads `cifar10_partial.npz`, the genuine CIFAR-10 subset of the data README.

    It holds the first 932 images of each training batch (4,660) and the
    first 846 of `test_batch`, unchanged. It is for small real-data runs: its
    numbers are not comparable with the full benchmark.

    Args:
        path: the `.npz` file.
        split: `"train"` or `"test"`.

    Returns:
        `(images, labels)`: uint8 `(N, 32, 32, 3)` and int64 `(N,)`.

    Example:

    >>> images, labels = read_cifar10_partial("cifar10_partial.npz", "test")  # doctest: +SKIP
    >>> images.shape                                                          # doctest: +SKIP
    (846, 32, 32, 3)
    """
    _check_split(split)
    path = pathlib.Path(path)
    keys = (f"{split}_images", f"{split}_labels")
    with _open_npz(path) as npz:
        for key in keys:
            if key not in npz.files:
                raise ValueError(f"{path}: no array {key!r}. Found: {sorted(npz.files)}")
        images, labels = (_npz_get(npz, key, path) for key in keys)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise ValueError(
            f"{path}: {keys[0]!r} must be uint8 (N, 32, 32, 3). Received: shape={images.shape}, dtype={images.dtype}"
        )
    if labels.shape != (images.shape[0],):
        raise ValueError(f"{path}: {keys[1]!r} must have shape ({images.shape[0]},). Received: shape={labels.shape}")
    return images, labels.astype(np.int64)


# ---------------------------------------------------------------------------
# Finding the files
# ---------------------------------------------------------------------------


def _expected_files(name):
    if name == "mnist":
        return [f + ".gz" for pair in _MNIST_FILES.values() for f in pair] + ["(or the same names without .gz)"]
    if name == "omniglot":
        return [_CHARDATA, _OMNIGLOT_105]
    return [_CIFAR_FOLDER + "/", _CIFAR_TAR, _CIFAR_PARTIAL]


def locate(name, data_dir, split="train"):
    """Finds which original file of `name` is present in `data_dir`.

    `data_dir` is searched first, then its subfolder named `name` (so a folder
    holding `mnist/`, `omniglot/` and `cifar10/` serves all three). Order of
    preference: OMNIGLOT `chardata.mat` before `omniglot_105.npz`; CIFAR-10
    the extracted batches, then the tar.gz, then `cifar10_partial.npz`.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        data_dir: the local directory.
        split: `"train"` or `"test"`.

    Returns:
        `(reader, path)`: the reader function (`read_mnist`, ...) and the
        file or folder to pass to it.

    Raises:
        FileNotFoundError: `data_dir` is missing or holds none of the files;
            the message lists the file names looked for.

    Example:

    >>> reader, path = locate("mnist", "data")  # doctest: +SKIP
    """
    _check_name(name)
    _check_split(split)
    root = pathlib.Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"`data_dir` is not a directory. Received: data_dir={str(data_dir)!r}. "
            f"Expected a folder holding the {name} files: {', '.join(_expected_files(name))}."
        )
    candidates = [root] + ([root / name] if (root / name).is_dir() else [])
    for folder in candidates:
        if name == "mnist":
            if any(_find_one(folder, base) for base in _MNIST_FILES[split]):
                return read_mnist, folder
        elif name == "omniglot":
            for file, reader in ((_CHARDATA, read_omniglot_chardata), (_OMNIGLOT_105, read_omniglot_105)):
                if (folder / file).is_file():
                    return reader, folder / file
        else:
            if (folder / _CIFAR_FOLDER).is_dir():
                return read_cifar10, folder / _CIFAR_FOLDER
            if any((folder / b).is_file() for b in _CIFAR_BATCHES[split]):
                return read_cifar10, folder
            if (folder / _CIFAR_TAR).is_file():
                return read_cifar10, folder / _CIFAR_TAR
            if (folder / _CIFAR_PARTIAL).is_file():
                return read_cifar10_partial, folder / _CIFAR_PARTIAL
    searched = " and ".join(str(f) for f in candidates)
    raise FileNotFoundError(
        f"No {name} files found in {searched}. Expected one of: {', '.join(_expected_files(name))}. "
        f"Received: data_dir={str(data_dir)!r}"
    )


def load(name, data_dir=None, split="train"):
    """Loads a split as NumPy arrays from local files, or from tfds.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        data_dir: local folder with the original files (see `locate`), or
            `None` to use `tensorflow_datasets`, which downloads (networked
            machines only; OMNIGLOT then uses tfds' train = background and
            test = evaluation split, downsampled like `omniglot_105.npz`).
        split: `"train"` or `"test"`.

    Returns:
        `(images, labels)` as documented in the module docstring: MNIST uint8
        `(N, 28, 28, 1)`, OMNIGLOT float32 `(N, 28, 28, 1)` in [0, 1], CIFAR-10
        uint8 `(N, 32, 32, 3)`; labels int64 `(N,)`.

    Example:

    >>> images, labels = load("cifar10", "data/cifar10", "test")  # doctest: +SKIP
    """
    _check_name(name)
    _check_split(split)
    if data_dir is None:
        return _load_tfds(name, split)
    reader, path = locate(name, data_dir, split)
    logger.info("Reading %s %s split from %s", name, split, path)
    if reader is read_cifar10_partial:
        logger.warning(
            "%s is a 4,660 / 846-image CIFAR-10 subset for smoke runs; its numbers are not comparable with "
            "the full benchmark (50,000 / 10,000 images).",
            path,
        )
    return reader(path, split)


def _load_tfds(name, split):
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            "`data_dir=None` reads the data through tensorflow_datasets, which is not installed: "
            "`pip install keras-avae[datasets]`, or pass `data_dir=` a folder with the original files."
        ) from e
    _tf()
    label_key = "alphabet" if name == "omniglot" else "label"
    ds = tfds.load(name, split=split)
    ds = ds.map(lambda ex: (ex["image"], ex[label_key])).batch(4096)
    images, labels = [], []
    for x, y in ds.as_numpy_iterator():
        images.append(x)
        labels.append(y)
    if not images:
        raise ValueError(f"tfds returned no examples for name={name!r}, split={split!r}.")
    images, labels = np.concatenate(images), np.concatenate(labels).astype(np.int64)
    if name == "omniglot":
        # tfds keeps the original RGB PNGs: black strokes on white paper.
        images = area_downsample((images[..., 0] < 128).astype(np.uint8), 28)[..., None]
    return images, labels


# ---------------------------------------------------------------------------
# tf.data pipelines
# ---------------------------------------------------------------------------

_TF_CONFIGURED = False


def _tf():
    """Imports TensorFlow; on the JAX/PyTorch backends hides the GPUs from it."""
    global _TF_CONFIGURED
    import tensorflow as tf

    if not _TF_CONFIGURED:
        _TF_CONFIGURED = True
        import keras

        if keras.backend.backend() != "tensorflow":
            try:
                tf.config.set_visible_devices([], "GPU")
            except RuntimeError:  # Devices already initialised: leave them.
                pass
    return tf


def _seeds(seed, pipeline_id):
    """Independent (shuffle, random, static) seeds derived from one user seed."""
    if seed is None:
        return None, None, 0
    state = np.random.SeedSequence([seed, pipeline_id]).generate_state(2)
    static = int(np.random.SeedSequence([seed]).generate_state(1)[0])
    return int(state[0]), int(state[1]), static


def _static_binarize(grey, scale, seed):
    """One seeded Bernoulli draw of `grey / scale`, as uint8 {0, 1}."""
    rng = np.random.default_rng(seed)
    out = np.empty(grey.shape, np.uint8)
    for start in range(0, grey.shape[0], 4096):
        p = grey[start : start + 4096].astype(np.float32) / np.float32(scale)
        out[start : start + 4096] = rng.random(p.shape, dtype=np.float32) < p
    return out


def mnist_test_sample(num_images=100, binarize=True, seed=0, with_labels=False):
    """The first MNIST test images, shipped with the package (no download).

    `keras_avae/data/mnist_test_sample.npz` holds the first 100 images of
    the MNIST test set (LeCun et al., 1998; see `keras_avae/data/README.md`).
    With `binarize=True` they are binarised and padded exactly as
    `make_dataset("mnist", "test", seed=seed)` does, so scoring them gives the
    same numbers as `keras-avae evaluate --limit num_images --seed seed`.

    Args:
        num_images: how many, 1 to 100.
        binarize: `True`: static binary draw with `seed`, padded to 32x32;
            `False`: grey levels in [0, 1], padded to 32x32.
        seed: the static binarisation seed.
        with_labels: also return the digit labels.

    Returns:
        float32 `(num_images, 32, 32, 1)` images (and uint8 labels).

    Example:

    >>> x = mnist_test_sample(8)
    >>> x.shape, sorted(set(x.ravel().tolist()))
    ((8, 32, 32, 1), [0.0, 1.0])
    """
    if not _is_int(num_images, 1) or num_images > 100:
        raise ValueError(f"`num_images` must be an int from 1 to 100. Received: num_images={num_images!r}")
    if not _is_int(seed, 0):
        raise ValueError(f"`seed` must be a non-negative int. Received: seed={seed!r}")
    with np.load(pathlib.Path(__file__).parent / "data" / "mnist_test_sample.npz") as sample:
        grey, labels = sample["images"][:num_images], sample["labels"][:num_images]
    if binarize:
        images = _static_binarize(grey, 255.0, _seeds(seed, 0)[2]).astype(np.float32)
    else:
        images = grey.astype(np.float32) / 255.0
    images = np.pad(images, [(0, 0), (_PAD, _PAD), (_PAD, _PAD)])[..., None]
    return (images, labels) if with_labels else images


def make_dataset(
    name,
    split="train",
    data_dir=None,
    batch_size=32,
    *,
    shuffle=None,
    seed=None,
    repeat=False,
    drop_remainder=None,
    binarize="auto",
    random_flip=False,
    limit=None,
    with_labels=False,
    shuffle_buffer_size=None,
    strategy=None,
    input_context=None,
):
    """A `tf.data.Dataset` of image batches in the models' input range.

    Pipeline: read the split (`load`), optionally keep the first `limit`
    examples, shard across input pipelines (multi-worker), shuffle with a
    seed (reshuffled every epoch), batch, transform each batch, prefetch.
    Transforms:

    - MNIST / OMNIGLOT: the 28x28 grey levels `p` in [0, 1] are binarised,
      `x = 1[u < p]` with `u ~ U[0, 1)`, and zero-padded by 2 pixels to 32x32.
      `"dynamic"` draws `u` afresh for every batch produced (two epochs see
      different samples; with a `seed` the sequence is reproducible);
      `"static"` draws once, with `seed` (0 when `seed` is None), so the same
      split is the same binary set in every run and epoch; `None` keeps the
      grey levels. `"auto"` is dynamic for train, static for test.
    - CIFAR-10: `k / 127.5 - 1` in [-1, 1]; with `random_flip`, each image is
      mirrored left-right with probability 1/2, redrawn every batch.

    Distribution: with `strategy` (a `tf.distribute.Strategy`) the dataset
    is batched with the global `batch_size` and returned as
    `strategy.experimental_distribute_dataset(dataset)`: every global batch
    is split across the replicas (`batch_size / num_replicas_in_sync` each)
    and, with several workers, the batches are sharded across workers
    (`AutoShardPolicy.DATA`: each worker keeps its own part of every global
    batch, so all workers must shuffle alike; under a strategy `seed=None`
    therefore means `seed=0`). Keras `fit` on the TensorFlow backend takes
    the result directly and runs one step per global batch. (Not
    `distribute_datasets_from_function`: Keras 3.15 reads the step count of
    such a dataset from the per-replica batches, twice the real count on 2
    replicas, and runs an extra step every epoch.) For custom loops built on
    `strategy.distribute_datasets_from_function(fn)`, call `make_dataset`
    inside `fn` with `input_context=context`: the dataset is then sharded
    with `dataset.shard(num_input_pipelines, input_pipeline_id)`, batched
    with `input_context.get_per_replica_batch_size(batch_size)`, and its
    random seeds are derived from `(seed, input_pipeline_id)`.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        split: `"train"` or `"test"`.
        data_dir: folder with the original files (see `locate`), or `None`
            for `tensorflow_datasets` (downloads).
        batch_size: the **global** batch size: per-replica batch size x
            `strategy.num_replicas_in_sync` under a strategy.
        shuffle: bool; defaults to `True` for train, `False` for test.
        seed: int or `None`; seeds shuffling, dynamic binarisation, flips and
            static binarisation (`None` means 0 under a `strategy`).
        repeat: bool, repeat indefinitely (then pass `steps_per_epoch`).
        drop_remainder: bool; defaults to `True` for train, `False` for test.
        binarize: `"auto"`, `"dynamic"`, `"static"` or `None` (binary sets
            only; must be `"auto"` or `None` for CIFAR-10).
        random_flip: bool, random horizontal flips (CIFAR-10 only).
        limit: int or `None`, keep only the first `limit` examples.
        with_labels: bool, yield `(images, labels)` instead of images.
        shuffle_buffer_size: defaults to the whole split.
        strategy: a `tf.distribute.Strategy`, or `None`.
        input_context: a `tf.distribute.InputContext`, or `None`.

    Returns:
        A `tf.data.Dataset` (a distributed dataset under `strategy`) of
        float32 batches `(B, 32, 32, C)`: {0, 1} (grey levels in [0, 1] with
        `binarize=None`) for MNIST and OMNIGLOT, [-1, 1] for CIFAR-10; with
        `with_labels`, `(images, int64 labels)`.

    Example:

    >>> train = make_dataset("mnist", "train", "data/mnist", batch_size=64,
    ...     seed=1)                                              # doctest: +SKIP
    >>> model.fit(train, epochs=10)                              # doctest: +SKIP
    """
    _check_name(name)
    _check_split(split)
    if not _is_int(batch_size, 1):
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    if binarize not in ("auto", "dynamic", "static", None):
        raise ValueError(f"`binarize` must be 'auto', 'dynamic', 'static' or None. Received: binarize={binarize!r}")
    if name == "cifar10" and binarize not in ("auto", None):
        raise ValueError(f"CIFAR-10 is not binarised; pass binarize=None or 'auto'. Received: binarize={binarize!r}")
    if random_flip and name != "cifar10":
        raise ValueError(
            f"`random_flip` applies to CIFAR-10 only (mirrored digits and characters are other symbols). "
            f"Received: random_flip={random_flip!r} with name={name!r}"
        )
    if limit is not None and not _is_int(limit, 1):
        raise ValueError(f"`limit` must be a positive int or None. Received: limit={limit!r}")
    if seed is not None and not _is_int(seed, 0):
        raise ValueError(f"`seed` must be a non-negative int or None. Received: seed={seed!r}")
    if shuffle_buffer_size is not None and not _is_int(shuffle_buffer_size, 1):
        raise ValueError(
            "`shuffle_buffer_size` must be a positive int or None. "
            f"Received: shuffle_buffer_size={shuffle_buffer_size!r}"
        )
    if strategy is not None and input_context is not None:
        raise ValueError("Pass `strategy` or `input_context`, not both. Received: both")
    for replicas in (getattr(context, "num_replicas_in_sync", None) for context in (strategy, input_context)):
        if replicas and batch_size % replicas:
            raise ValueError(
                f"`batch_size` is the global batch size and must be divisible by the {replicas} replicas. "
                f"Received: batch_size={batch_size}"
            )
    if strategy is not None and seed is None:
        seed = 0  # Every worker must shuffle, binarise and flip alike.
    shuffle = split == "train" if shuffle is None else bool(shuffle)
    drop_remainder = split == "train" if drop_remainder is None else bool(drop_remainder)
    if binarize == "auto":
        binarize = None if name == "cifar10" else ("dynamic" if split == "train" else "static")

    images, labels = load(name, data_dir, split)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    # Grey levels as stored: uint8 0-255 (MNIST) or float32 in [0, 1] (OMNIGLOT).
    grey_scale = 255.0 if images.dtype == np.uint8 and name != "cifar10" else 1.0
    if binarize == "static":
        images = _static_binarize(images, grey_scale, _seeds(seed, 0)[2])
        grey_scale = 1.0
    options = dict(
        name=name,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        repeat=bool(repeat),
        drop_remainder=drop_remainder,
        dynamic=binarize == "dynamic",
        grey_scale=grey_scale,
        random_flip=bool(random_flip),
        with_labels=bool(with_labels),
        shuffle_buffer_size=shuffle_buffer_size or max(1, images.shape[0]),
    )
    tf = _tf()
    if strategy is not None:
        dataset = _pipeline(tf, images, labels, input_context=None, **options)
        dataset_options = tf.data.Options()
        dataset_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return strategy.experimental_distribute_dataset(dataset.with_options(dataset_options))
    return _pipeline(tf, images, labels, input_context=input_context, **options)


def _pipeline(
    tf,
    images,
    labels,
    *,
    name,
    batch_size,
    shuffle,
    seed,
    repeat,
    drop_remainder,
    dynamic,
    grey_scale,
    random_flip,
    with_labels,
    shuffle_buffer_size,
    input_context,
):
    pipeline_id = 0
    ds = tf.data.Dataset.from_tensor_slices((images, labels))
    if input_context is not None:
        if input_context.num_input_pipelines > 1:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        pipeline_id = input_context.input_pipeline_id
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    shuffle_seed, random_seed, _ = _seeds(seed, pipeline_id)
    if shuffle:
        ds = ds.shuffle(shuffle_buffer_size, seed=shuffle_seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    paddings = [[0, 0], [_PAD, _PAD], [_PAD, _PAD], [0, 0]]

    def transform(pair, pair_seed=None):
        x, y = pair
        x = tf.cast(x, tf.float32)
        if name == "cifar10":
            x = x / 127.5 - 1.0
            if random_flip:
                flip = tf.random.stateless_uniform(tf.shape(x)[:1], seed=pair_seed) < 0.5
                x = tf.where(flip[:, None, None, None], tf.reverse(x, axis=[2]), x)
        else:
            x = x / grey_scale
            if dynamic:
                u = tf.random.stateless_uniform(tf.shape(x), seed=pair_seed)
                x = tf.cast(u < x, tf.float32)
            x = tf.pad(x, paddings)
        return (x, y) if with_labels else x

    if dynamic or random_flip:
        # One stateless seed pair per batch, from a stream that is redrawn on
        # every iteration (epoch) yet reproducible from `seed`.
        stream = tf.data.Dataset.random(seed=random_seed, rerandomize_each_iteration=True).batch(2)
        ds = tf.data.Dataset.zip(ds, stream).map(transform, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        ds = ds.map(lambda x, y: transform((x, y)), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)
