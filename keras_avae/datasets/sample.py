"""The 100-image MNIST test sample shipped with the package (offline demo)."""

import pathlib

import numpy as np

from keras_avae.datasets.binarization import _static_binarize
from keras_avae.datasets.common import _is_int
from keras_avae.datasets.pipeline import _PAD
from keras_avae.datasets.pipeline import _seeds


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
    with np.load(pathlib.Path(__file__).parent.parent / "data" / "mnist_test_sample.npz") as sample:
        grey, labels = sample["images"][:num_images], sample["labels"][:num_images]
    if binarize:
        images = _static_binarize(grey, 255.0, _seeds(seed, 0)[2]).astype(np.float32)
    else:
        images = grey.astype(np.float32) / 255.0
    images = np.pad(images, [(0, 0), (_PAD, _PAD), (_PAD, _PAD)])[..., None]
    return (images, labels) if with_labels else images
