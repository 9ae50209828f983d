"""OMNIGLOT: the 28x28 `chardata.mat` (IWAE) and the 105x105 `omniglot_105.npz`.

`read_omniglot_chardata` reads the 28x28 split of Burda et al.;
`read_omniglot_105` reads the original background/evaluation sets and
area-averages them to 28x28 (`area_downsample`). Both return float32
`(N, 28, 28, 1)` grey levels in [0, 1], 1 = stroke, and int64 alphabet
indices.
"""

import pathlib

import numpy as np

from keras_avae.datasets.common import _check_split
from keras_avae.datasets.common import _npz_get
from keras_avae.datasets.common import _open_npz

_CHARDATA = "chardata.mat"
_OMNIGLOT_105 = "omniglot_105.npz"


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
    if not np.isfinite(data).all():
        raise ValueError(f"{path}: {key!r} holds {np.count_nonzero(~np.isfinite(data))} NaN or infinite values.")
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
    [0, 1], multiples of `1 / H^2`.

    The sums are exact for integer-valued inputs (integer overlap weights
    summed in float64), each output rounded once to float32: the same values
    on every CPU, whatever its BLAS summation order (a float32 product gave
    one grey level, 6 / 225, as two values 1 ulp apart, so that a statically
    binarised pixel could depend on the machine).

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
    # In units of 1 / size, output pixel i covers [i * H, (i + 1) * H) and
    # input pixel p covers [p * size, (p + 1) * size): integer overlaps, and
    # the weight of p in i is overlap / H.
    out_edges = np.arange(size, dtype=np.int64)[:, None] * side
    in_edges = np.arange(side, dtype=np.int64)[None, :] * size
    overlap = np.minimum(out_edges + side, in_edges + size) - np.maximum(out_edges, in_edges)
    weights = np.clip(overlap, 0, None).astype(np.float64)  # (size, H)
    out = np.empty((images.shape[0], size, size), np.float32)
    for start in range(0, images.shape[0], 2048):
        chunk = images[start : start + 2048].astype(np.float64)
        n = chunk.shape[0]
        rows = (chunk.reshape(n * side, side) @ weights.T).reshape(n, side, size)  # (n, H, size)
        cols = rows.transpose(0, 2, 1).reshape(n * size, side) @ weights.T  # (n * size, size): (w, h)
        out[start : start + n] = (cols / float(side * side)).reshape(n, size, size).transpose(0, 2, 1)
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
        if np.issubdtype(raw.dtype, np.floating) and not np.isfinite(raw).all():
            raise ValueError(f"{path}: {key!r} holds {np.count_nonzero(~np.isfinite(raw))} NaN or infinite values.")
        if raw.size and (raw.min() < 0 or raw.max() > 1):
            raise ValueError(
                f"{path}: {key!r} must hold 0/1 values (1 = stroke). Received: values in [{raw.min()}, {raw.max()}]"
            )
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
