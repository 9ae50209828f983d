"""CIFAR-10: the original pickled batches (folder or tar.gz) and `cifar10_partial.npz`.

`read_cifar10` reads `data_batch_1` ... `data_batch_5` / `test_batch` from
the extracted `cifar-10-batches-py/` folder or from `cifar-10-python.tar.gz`
(unpickling only what a batch holds); `read_cifar10_partial` reads the
genuine subset of the data README. Both return uint8 `(N, 32, 32, 3)` RGB,
0-255, and int64 classes 0-9.
"""

import io
import pathlib
import pickle
import tarfile
import zlib

import numpy as np

from keras_avae.datasets.common import _check_split
from keras_avae.datasets.common import _npz_get
from keras_avae.datasets.common import _open_npz

_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_TAR = "cifar-10-python.tar.gz"
_CIFAR_PARTIAL = "cifar10_partial.npz"
_CIFAR_BATCHES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}


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
