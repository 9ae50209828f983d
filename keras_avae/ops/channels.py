"""Splitting a tensor's last axis into parts, with a cheap gradient on every backend."""

import keras
import numpy as np
from keras import ops


def split_channels(x, sizes):
    """`x` cut along its last axis into consecutive parts of the given sizes.

    A slice `x[..., a:b]` differentiates, on TensorFlow, into a
    `StridedSliceGrad` that writes a zero tensor of `x`'s full size for
    every slice (and torch's slice backward does the same); a split's
    gradient is one concatenation of the parts' gradients. With a few
    slices of each wide feature map per step, this was a tenth of
    `mnist-attentive-small`'s TensorFlow training step. `keras.ops.split`
    builds the sizes as a tensor on TensorFlow and torch; the native splits
    take the Python ints, so static shapes are kept.

    Args:
        x: tensor `(..., C)`.
        sizes: list of non-negative Python ints summing to `C`.

    Returns:
        A list of `len(sizes)` tensors `(..., size)`.

    Example:

    >>> import numpy as np
    >>> a, b = split_channels(np.zeros((2, 5), "float32"), [3, 2])
    >>> tuple(a.shape), tuple(b.shape)
    ((2, 3), (2, 2))
    """
    sizes = [int(size) for size in sizes]
    if x.shape[-1] is not None and sum(sizes) != x.shape[-1]:
        raise ValueError(f"`sizes` must sum to the last axis, {x.shape[-1]}. Received: sizes={sizes}")
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.split(x, sizes, axis=-1)
    if backend == "torch":
        import torch

        return list(torch.split(ops.convert_to_tensor(x), sizes, dim=-1))
    # JAX: slices, which XLA fuses into their consumers.
    return ops.split(x, np.cumsum(sizes)[:-1].tolist(), axis=-1)
