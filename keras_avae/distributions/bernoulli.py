"""Bernoulli likelihood of binary images (MNIST, OMNIGLOT)."""

from keras import ops

from keras_avae._validation import check_crop
from keras_avae.distributions.tfp import has_tfp
from keras_avae.distributions.tfp import tfd


def bernoulli_log_prob(logits, x, crop=0):
    """log p(x | logits) summed over pixels: shape `(B,)`, float32.

    Args:
        logits: `(B, H, W, C)` Bernoulli logits.
        x: `(B, H, W, C)` images in [0, 1]: binary (0 or 1), or grey levels,
            whose log-probability is then minus the cross-entropy
            `x log sigmoid(l) + (1 - x) log sigmoid(-l)` (as TFP computes it).
        crop: pixels dropped on every side before summing (the 2-pixel pad
            that brings 28x28 images to 32x32 is not data).

    Uses TFP's `Bernoulli` on TensorFlow/JAX and the same stable formula,
    `-binary_crossentropy(x, logits, from_logits=True)`, on torch.

    Example:

    >>> import numpy as np
    >>> lp = bernoulli_log_prob(np.zeros((1, 4, 4, 1)), np.ones((1, 4, 4, 1)))
    >>> round(float(lp[0]), 4)  # 16 * log(1/2)
    -11.0904
    """
    # An out-of-range crop sliced away every pixel: a log-probability of 0.
    spatial = tuple(logits.shape[1:3])
    check_crop(crop, spatial if None not in spatial else (float("inf"),) * 2)
    logits = ops.cast(logits, "float32")
    x = ops.cast(x, "float32")
    if crop:
        logits = logits[:, crop:-crop, crop:-crop, :]
        x = x[:, crop:-crop, crop:-crop, :]
    if has_tfp():
        per_pixel = tfd().Bernoulli(logits=logits, dtype="float32").log_prob(x)
    else:
        per_pixel = -ops.binary_crossentropy(x, logits, from_logits=True)
    return ops.sum(ops.reshape(per_pixel, (ops.shape(x)[0], -1)), axis=-1)
