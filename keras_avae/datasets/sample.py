"""The 100-image test samples shipped with the package (offline demo, cards).

One sample per data set, in `keras_avae/data/` (sources and licences in its
README): the first 100 images of the test split that `make_dataset` reads
from the original files, stored before binarisation or scaling, so that
`shipped_sample` can prepare them exactly as the test pipeline does.
"""

import pathlib

import numpy as np

from keras_avae.datasets.binarization import _check_binarize
from keras_avae.datasets.binarization import _grey_scale
from keras_avae.datasets.binarization import _resolve_binarize
from keras_avae.datasets.binarization import _static_binarize
from keras_avae.datasets.common import _check_name
from keras_avae.datasets.common import _is_int
from keras_avae.datasets.pipeline import _PAD
from keras_avae.datasets.pipeline import _seeds

_DATA = pathlib.Path(__file__).parent.parent / "data"
# Where each sample's images come from, as the demo prints it.
SAMPLE_SOURCES = {
    "mnist": "MNIST test images (LeCun et al., 1998)",
    "omniglot": "OMNIGLOT evaluation-set images (Lake et al., 2015), 105x105 area-averaged to 28x28",
    "cifar10": "CIFAR-10 test images (Krizhevsky, 2009)",
}


def shipped_sample(name, num_images=100, binarize="auto", seed=0, with_labels=False):
    """The first test images of a data set, shipped with the package.

    The images are prepared as `make_dataset(name, "test", seed=seed)`
    prepares them from the original files (MNIST's IDX files, OMNIGLOT's
    `omniglot_105.npz`, CIFAR-10's `cifar10_partial.npz`), so scoring them
    gives the numbers of `keras-avae evaluate --limit num_images --seed seed`.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        num_images: how many, 1 to 100.
        binarize: `"auto"` or `"static"` (binary sets: one Bernoulli draw
            with `seed`, as the test pipeline does) or `None` (grey levels in
            [0, 1]). CIFAR-10 takes `"auto"` or `None` and is never binarised.
        seed: the static binarisation seed.
        with_labels: also return the labels (digit, alphabet or class).

    Returns:
        float32 `(num_images, 32, 32, C)` images in the models' input range
        ({0, 1} binary or [0, 1] grey, padded to 32x32; [-1, 1] for
        CIFAR-10), and with `with_labels` the labels as in `load`.

    Example:

    >>> x = shipped_sample("omniglot", 8)
    >>> x.shape, sorted(set(x.ravel().tolist()))
    ((8, 32, 32, 1), [0.0, 1.0])
    """
    _check_name(name)
    _check_binarize(name, binarize)
    if not _is_int(num_images, 1) or num_images > 100:
        raise ValueError(f"`num_images` must be an int from 1 to 100. Received: num_images={num_images!r}")
    if not _is_int(seed, 0):
        raise ValueError(f"`seed` must be a non-negative int. Received: seed={seed!r}")
    if binarize == "dynamic":
        raise ValueError(f"A test sample is binarised once, statically. Received: binarize={binarize!r}")
    with np.load(_DATA / f"{name}_test_sample.npz") as sample:
        stored, labels = sample["images"][:num_images], sample["labels"][:num_images].astype(np.int64)
    if name == "cifar10":
        images = stored.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
        return (images, labels) if with_labels else images
    grey_scale = _grey_scale(name, stored)
    if _resolve_binarize(name, "test", binarize) == "static":
        images = _static_binarize(stored, grey_scale, _seeds(seed, 0)[2]).astype(np.float32)
    else:
        images = stored.astype(np.float32) / np.float32(grey_scale)
    images = np.pad(images, [(0, 0), (_PAD, _PAD), (_PAD, _PAD)])[..., None]
    return (images, labels) if with_labels else images


def mnist_test_sample(num_images=100, binarize=True, seed=0, with_labels=False):
    """The first MNIST test images, shipped with the package (no download).

    `shipped_sample("mnist", ...)` with a bool `binarize`: `True` for one
    static binary draw with `seed`, `False` for grey levels in [0, 1]; both
    padded to 32x32.

    Args:
        num_images: how many, 1 to 100.
        binarize: bool.
        seed: the static binarisation seed.
        with_labels: also return the digit labels.

    Returns:
        float32 `(num_images, 32, 32, 1)` images (and int64 labels).

    Example:

    >>> x = mnist_test_sample(8)
    >>> x.shape, sorted(set(x.ravel().tolist()))
    ((8, 32, 32, 1), [0.0, 1.0])
    """
    if not isinstance(binarize, (bool, np.bool_)):
        raise ValueError(f"`binarize` must be a bool. Received: binarize={binarize!r}")
    return shipped_sample(
        "mnist", num_images, binarize="static" if binarize else None, seed=seed, with_labels=with_labels
    )
