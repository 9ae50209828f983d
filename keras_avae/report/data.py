"""The images a report scores and draws: the first N of a data set's split, or of every k-th image."""

import numpy as np

from keras_avae._validation import check_positive_int
from keras_avae.datasets.binarization import _fixed_binarize


def load_images(
    dataset, data_dir, split="test", num_images=500, seed=0, resize_images=False, batch_size=500, every=None
):
    """The first `num_images` images of a split, as the models see them, with a description.

    The images go through `datasets.make_dataset` without shuffling: MNIST
    and OMNIGLOT statically binarised with `seed` (the same binary images
    as `keras-avae evaluate --seed` scores) and padded to 32x32, CIFAR-10 in
    [-1, 1].

    Args:
        dataset: `"mnist"`, `"omniglot"` or `"cifar10"`.
        data_dir: the folder with the data files (or a folder of images).
        split: `"test"` or `"train"`.
        num_images: positive int; fewer when the split is smaller.
        seed: the binarisation seed.
        resize_images: bool, as in `datasets.load`.
        batch_size: images per batch read.
        every: positive int or `None`: the first `num_images` of every
            `every`-th image (the 0th, `every`-th, ...), a subset spread over
            the split, as `keras-avae evaluate --every` scores. The OMNIGLOT
            test split is ordered by alphabet: its first 500 images are
            characters of 2 of its 20 alphabets.

    Returns:
        `(images, description)`: float32 `(N, H, W, C)` and one line saying
        which images they are (for the page's header).

    Example:

    >>> images, text = load_images("mnist", "data/mnist", num_images=100)  # doctest: +SKIP
    >>> images.shape, text  # doctest: +SKIP
    ((100, 32, 32, 1), 'the first 100 images of the mnist test split in data/mnist, ...')
    """
    from keras_avae import datasets

    num_images = check_positive_int(num_images, "num_images")
    batches = datasets.make_dataset(
        dataset,
        split,
        data_dir,
        min(batch_size, num_images),
        shuffle=False,
        drop_remainder=False,  # every image, for the train split too
        seed=seed,
        limit=num_images,
        every=every,
        resize_images=resize_images,
        # One fixed binary draw whatever the split ("auto" is dynamic for train).
        binarize=_fixed_binarize(dataset),
    )
    images = np.concatenate([np.asarray(batch, "float32") for batch in batches])
    binary = " statically binarised with seed " + str(seed) if dataset in ("mnist", "omniglot") else ""
    which = f"of images 0, {every}, {2 * every}, ... " if every is not None and every > 1 else "images "
    description = f"the first {len(images)} {which}of the {dataset} {split} split in {data_dir}{binary}"
    return images, description
