"""Finding a data set's files (`locate`) and loading a split (`load`), or tfds.

`data_dir` is searched first, then its subfolder named after the data set;
the first file present wins, in each data set's order of preference. A
folder with none of the original files but with PNG/JPEG images is read by
`read_image_folder` instead. With `data_dir=None` the split comes from
`tensorflow_datasets` (downloads).
"""

import logging
import pathlib

import numpy as np

from keras_avae.datasets.cifar10 import _CIFAR_BATCHES
from keras_avae.datasets.cifar10 import _CIFAR_FOLDER
from keras_avae.datasets.cifar10 import _CIFAR_PARTIAL
from keras_avae.datasets.cifar10 import _CIFAR_TAR
from keras_avae.datasets.cifar10 import read_cifar10
from keras_avae.datasets.cifar10 import read_cifar10_partial
from keras_avae.datasets.common import _check_name
from keras_avae.datasets.common import _check_split
from keras_avae.datasets.common import _tf
from keras_avae.datasets.image_folder import _SUFFIXES
from keras_avae.datasets.image_folder import _has_images
from keras_avae.datasets.image_folder import read_image_folder
from keras_avae.datasets.mnist import _MNIST_FILES
from keras_avae.datasets.mnist import _find_one
from keras_avae.datasets.mnist import read_mnist
from keras_avae.datasets.omniglot import _CHARDATA
from keras_avae.datasets.omniglot import _OMNIGLOT_105
from keras_avae.datasets.omniglot import area_downsample
from keras_avae.datasets.omniglot import read_omniglot_105
from keras_avae.datasets.omniglot import read_omniglot_chardata

# The package's logger, as before the split into modules.
logger = logging.getLogger("keras_avae.datasets")

# The `kind` of `read_image_folder` that stands in for each data set.
_IMAGE_KINDS = {"mnist": "grey", "omniglot": "grey", "cifar10": "rgb"}
_IMAGES_HINT = f"or, for your own data, image files ({', '.join(_SUFFIXES)}; see `read_image_folder`)"


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

    When neither folder holds any of these files, a folder of your own
    PNG/JPEG images is used (see `read_image_folder`): the subfolder named
    `name` if it holds image files, else `data_dir` if it holds image files
    directly or in subfolders.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        data_dir: the local directory.
        split: `"train"` or `"test"`.

    Returns:
        `(reader, path)`: the reader function (`read_mnist`, ...,
        `read_image_folder`) and the file or folder to pass to it.

    Raises:
        FileNotFoundError: `data_dir` is missing or holds none of the files
            nor image files; the message lists the file names looked for.

    Example:

    >>> reader, path = locate("mnist", "data")  # doctest: +SKIP
    """
    _check_name(name)
    _check_split(split)
    root = pathlib.Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"`data_dir` is not a directory. Received: data_dir={str(data_dir)!r}. "
            f"Expected a folder holding the {name} files: {', '.join(_expected_files(name))}; {_IMAGES_HINT}."
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
    for folder in candidates[::-1]:
        if _has_images(folder):
            return read_image_folder, folder
    searched = " and ".join(str(f) for f in candidates)
    raise FileNotFoundError(
        f"No {name} files found in {searched}. Expected one of: {', '.join(_expected_files(name))}; "
        f"{_IMAGES_HINT}. Received: data_dir={str(data_dir)!r}"
    )


def load(name, data_dir=None, split="train", *, resize_images=False):
    """Loads a split as NumPy arrays from local files, or from tfds.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        data_dir: local folder with the original files or with your own
            PNG/JPEG images (see `locate`), or `None` to use
            `tensorflow_datasets`, which downloads (networked machines only;
            OMNIGLOT then uses tfds' train = background and test =
            evaluation split, downsampled like `omniglot_105.npz`).
        split: `"train"` or `"test"`.
        resize_images: bool; for a folder of images, resize those whose size
            differs from the data set's (28x28 grey, 32x32 RGB) instead of
            raising (`read_image_folder`'s `resize`). The original files
            ignore it.

    Returns:
        `(images, labels)` as documented in the module docstring: MNIST uint8
        `(N, 28, 28, 1)`, OMNIGLOT float32 `(N, 28, 28, 1)` in [0, 1], CIFAR-10
        uint8 `(N, 32, 32, 3)`; labels int64 `(N,)`. A folder of images gives
        what `read_image_folder` returns: float32 `(N, 28, 28, 1)` in [0, 1]
        for MNIST and OMNIGLOT, uint8 `(N, 32, 32, 3)` for CIFAR-10.

    Example:

    >>> images, labels = load("cifar10", "data/cifar10", "test")  # doctest: +SKIP
    """
    _check_name(name)
    _check_split(split)
    if data_dir is None:
        return _load_tfds(name, split)
    reader, path = locate(name, data_dir, split)
    if reader is read_image_folder:
        kind = _IMAGE_KINDS[name]
        logger.info("Reading %s %s split from the image folder %s (%s images)", name, split, path, kind)
        return read_image_folder(path, split, kind, resize=resize_images)
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
