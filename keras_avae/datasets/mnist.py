"""MNIST: the four original IDX files (LeCun et al., 1998).

`read_idx` reads one IDX file, gzip-compressed or not, and `read_mnist` a
split: `train-images-idx3-ubyte.gz`, `train-labels-idx1-ubyte.gz`,
`t10k-images-idx3-ubyte.gz`, `t10k-labels-idx1-ubyte.gz` (or the same names
without `.gz`) -> uint8 `(N, 28, 28, 1)`, 0-255, and int64 digits.
"""

import gzip
import pathlib
import zlib

import numpy as np

from keras_avae.datasets.common import _check_split

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
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
