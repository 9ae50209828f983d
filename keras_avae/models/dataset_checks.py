"""The image checks of `fit`, `evaluate` and `predict` for `tf.data` datasets.

Arrays are checked whole before a step runs (`check_images`). A dataset
cannot be read ahead, so its element spec is checked at once (image shape
and dtype) and every batch in its own pipeline (pixel range): a dataset of
0-255 pixels used to give a finite, meaningless NELBO (15 million nats for
the tiny test model) without a word. The batch check is a min/max reduction in
the `tf.data` pipeline, beside the training step, on any backend (Keras
reads `tf.data` datasets on all of them). Non-finite pixels pass, as they
do for arrays. Generators, `PyDataset`s and distributed datasets are not
checked.
"""

import contextlib
import re
import sys

import numpy as np

# The batch check's assertion data: the message, then the batch's min and max.
_ASSERTION = re.compile(r"assertion failed: \[(Expected pixel values of .*?)\] \[([^\]]*)\] \[([^\]]*)\]")


def is_tf_dataset(value):
    """Whether `value` is a `tf.data.Dataset` (without importing TensorFlow when no dataset can exist).

    >>> import tensorflow as tf
    >>> is_tf_dataset(tf.data.Dataset.range(3)), is_tf_dataset(np.zeros(3))
    (True, False)
    """
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.data.Dataset)


def checked_image_dataset(dataset, image_shape, pixel_range, name="x"):
    """`dataset` with its images checked: the spec now, each batch's pixel range when it is read.

    The images are an element's first component (`x`, `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`). Raises `ValueError` naming `name` for a
    non-numeric dtype or an image shape other than `image_shape`; a batch
    with finite pixels outside `pixel_range` stops the pipeline with a
    `tf.errors.InvalidArgumentError` whose message names `name`, the range
    and the values received (`readable_pixel_errors` makes it a `ValueError`).

    Example:

    >>> import tensorflow as tf
    >>> batches = tf.data.Dataset.from_tensor_slices(np.ones((4, 8, 8, 1), "float32")).batch(2)
    >>> [batch.shape for batch in checked_image_dataset(batches, (8, 8, 1), (0.0, 1.0)).as_numpy_iterator()]
    [(2, 8, 8, 1), (2, 8, 8, 1)]
    >>> checked_image_dataset(batches, (28, 28, 1), (0.0, 1.0))
    Traceback (most recent call last):
    ...
    ValueError: Expected `x` to hold batches of shape (batch, 28, 28, 1). Received: x with images of shape (None, 8, 8, 1)
    """
    import tensorflow as tf

    spec = dataset.element_spec
    image_spec = spec[0] if isinstance(spec, tuple) else spec
    if not isinstance(image_spec, tf.TensorSpec):
        raise ValueError(
            f"`{name}` must be a dataset of image batches (or of tuples whose first item is one). "
            f"Received: {name} with element_spec {spec}"
        )
    dtype = image_spec.dtype
    if not (dtype.is_floating or dtype.is_integer or dtype == tf.bool) or dtype.is_complex:
        raise ValueError(
            f"`{name}` must be a dataset of numeric images. Received: {name} with images of dtype {dtype.name}"
        )
    shape = image_spec.shape
    expected = (None, *image_shape)
    if shape.rank is not None and (
        shape.rank != len(expected)
        or any(size is not None and want is not None and size != want for size, want in zip(shape, expected))
    ):
        wanted = ", ".join(map(str, image_shape))
        raise ValueError(
            f"Expected `{name}` to hold batches of shape (batch, {wanted}). Received: {name} with images of "
            f"shape {tuple(shape.as_list())}"
        )
    low, high = (float(bound) for bound in pixel_range)
    message = f"Expected pixel values of `{name}` in [{low}, {high}]. Received: a batch of {name} with values in"

    def check_batch(*element):
        images = tf.cast(element[0], tf.float32)
        finite = tf.math.is_finite(images)
        # Non-finite pixels pass, as for arrays: an all-NaN batch reduces to (inf, -inf).
        x_min = tf.reduce_min(tf.where(finite, images, np.inf))
        x_max = tf.reduce_max(tf.where(finite, images, -np.inf))
        in_range = tf.logical_and(x_min >= low, x_max <= high)
        check = tf.debugging.Assert(in_range, [message, x_min, x_max])
        with tf.control_dependencies([check]):
            element = tf.nest.map_structure(tf.identity, element)
        return element if isinstance(spec, tuple) else element[0]

    return dataset.map(check_batch)


@contextlib.contextmanager
def readable_pixel_errors():
    """Turns a failed batch check (deep in `tf.data`'s error text) into a one-line `ValueError`.

    Any other error passes unchanged.

    Example:

    >>> import tensorflow as tf
    >>> batches = tf.data.Dataset.from_tensor_slices(np.full((4, 8, 8, 1), 255.0, "float32")).batch(2)
    >>> with readable_pixel_errors():
    ...     next(iter(checked_image_dataset(batches, (8, 8, 1), (0.0, 1.0))))
    Traceback (most recent call last):
    ...
    ValueError: Expected pixel values of `x` in [0.0, 1.0]. Received: a batch of x with values in [255, 255]
    """
    try:
        yield
    except Exception as error:
        found = _ASSERTION.search(str(error)) if type(error).__name__ == "InvalidArgumentError" else None
        if found is None:
            raise
        message, x_min, x_max = found.groups()
        raise ValueError(f"{message} [{x_min}, {x_max}]") from None
