"""MNIST, OMNIGLOT, CIFAR-10 and your own images: readers and `tf.data` pipelines.

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

   **Your own images**: a folder with none of these files but with
   `.png`/`.jpg`/`.jpeg` images (flat, in class subfolders, or in `train/`
   and `test/` subfolders) is read by `read_image_folder` in the format of
   the data set it stands in for: float32 `(N, 28, 28, 1)` grey levels in
   [0, 1] for `"mnist"` and `"omniglot"`, uint8 `(N, 32, 32, 3)` RGB for
   `"cifar10"`. Images of another size raise a `ValueError` naming the file,
   unless `resize_images=True` (`load`, `make_dataset`) resizes them.

   Labels are int64 `(N,)`: the digit, the CIFAR-10 class, or for OMNIGLOT the
   alphabet (see `read_omniglot_chardata` and `read_omniglot_105`), or for
   your own images the class subfolder (see `read_image_folder`).
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

Modules:

- `mnist`, `omniglot`, `cifar10`: one reader module per data set.
- `image_folder`: `read_image_folder`, a folder of your own PNG/JPEG images.
- `discovery`: which file of a data set is present (`locate`), `load`, tfds.
- `binarization`: static and dynamic Bernoulli binarisation.
- `pipeline`: `make_dataset`, the `tf.data` pipeline; `image_shape`.
- `sample`: `shipped_sample`, the 100-image test samples shipped with the
  package (MNIST, OMNIGLOT, CIFAR-10), and `mnist_test_sample`.
- `common`: argument checks and helpers the others share.

Every public name is importable from `keras_avae.datasets` itself.

Example:

>>> from keras_avae import datasets
>>> train = datasets.make_dataset("mnist", "train", data_dir="data/mnist",
...     batch_size=32, seed=0)                                  # doctest: +SKIP
>>> next(iter(train)).shape                                     # doctest: +SKIP
TensorShape([32, 32, 32, 1])
"""

from keras_avae.datasets.cifar10 import read_cifar10
from keras_avae.datasets.cifar10 import read_cifar10_partial
from keras_avae.datasets.common import NAMES
from keras_avae.datasets.common import SPLITS
from keras_avae.datasets.discovery import load
from keras_avae.datasets.discovery import locate
from keras_avae.datasets.discovery import logger
from keras_avae.datasets.image_folder import read_image_folder
from keras_avae.datasets.mnist import read_idx
from keras_avae.datasets.mnist import read_mnist
from keras_avae.datasets.omniglot import area_downsample
from keras_avae.datasets.omniglot import read_omniglot_105
from keras_avae.datasets.omniglot import read_omniglot_chardata
from keras_avae.datasets.pipeline import image_shape
from keras_avae.datasets.pipeline import make_dataset
from keras_avae.datasets.sample import SAMPLE_SOURCES
from keras_avae.datasets.sample import mnist_test_sample
from keras_avae.datasets.sample import shipped_sample
