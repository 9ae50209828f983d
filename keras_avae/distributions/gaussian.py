"""Diagonal Gaussian latents: the bounded parameterisation, sampling, KL.

One place for the latent-variable equations of the paper: the soft bounds
on the mean and log-scale, `sigma = exp(log_sigma) + 0.01`, reparameterised
sampling, the log-density and the analytic KL, each summed over H, W, C.
On TensorFlow and JAX the density and KL come from TFP's `Normal`; on torch
(no TFP substrate) from the same closed forms written with `keras.ops`.
Everything runs in float32, whatever the layer's compute dtype.
"""

import math

import keras
from keras import ops

from keras_avae.distributions.tfp import has_tfp
from keras_avae.distributions.tfp import tfd

MEAN_BOUND = 5.0
SIGMA_FLOOR = 0.01


def soft_bound(x, low, high):
    """Maps `x` smoothly into `[low, high]`.

    A symmetric range `[-b, b]` uses `b * tanh(x / (2b))` (slope 1/2 at 0, as
    the reference); an asymmetric one (CIFAR-10's prior log-scale in
    `[-1, 5]`) uses the reference's smoothstep clamp
    `low + (high - low) * S(t)`, `t = (x - low) / (high - low)`,
    `S(t) = 3t^2 - 2t^3` on [0, 1].

    Example:

    >>> float(soft_bound(0.0, -5.0, 5.0))
    0.0
    """
    x = ops.cast(x, "float32")
    if low == -high:
        return high * ops.tanh(x / (2.0 * high))
    t = ops.clip((x - low) / (high - low), 0.0, 1.0)
    return low + (high - low) * t * t * (3.0 - 2.0 * t)


class DiagonalGaussian:
    """A factorised Gaussian over a `(B, H, W, C)` latent, in float32.

    Args:
        loc: mean, `(B, H, W, C)`.
        scale: standard deviation, same shape, positive.

    Example:

    >>> import numpy as np
    >>> q = DiagonalGaussian(np.zeros((2, 4, 4, 3)), np.ones((2, 4, 4, 3)))
    >>> tuple(q.kl_divergence(q).shape)
    (2,)
    """

    def __init__(self, loc, scale):
        self.loc = ops.cast(loc, "float32")
        self.scale = ops.cast(scale, "float32")

    @classmethod
    def from_raw(cls, raw_loc, raw_log_scale, log_scale_bounds=(-5.0, 5.0)):
        """The bounded parameterisation of the latent Gaussians.

        `loc = 5 tanh(raw_loc / 10)`, `scale = exp(bound(raw_log_scale)) + 0.01`.
        """
        loc = soft_bound(raw_loc, -MEAN_BOUND, MEAN_BOUND)
        log_scale = soft_bound(raw_log_scale, *log_scale_bounds)
        return cls(loc, ops.exp(log_scale) + SIGMA_FLOOR)

    @classmethod
    def standard(cls, shape):
        """N(0, I) of the given shape (the top layer's prior)."""
        return cls(ops.zeros(shape, "float32"), ops.ones(shape, "float32"))

    def sample(self, seed=None, temperature=1.0):
        """Reparameterised sample `loc + temperature * scale * eps`."""
        eps = keras.random.normal(ops.shape(self.loc), dtype="float32", seed=seed)
        return self.loc + temperature * self.scale * eps

    def _tfp(self):
        return tfd().Normal(self.loc, self.scale)

    def log_prob(self, z):
        """log-density of `z`, summed over H, W, C: shape `(B,)`."""
        z = ops.cast(z, "float32")
        if has_tfp():
            per_element = self._tfp().log_prob(z)
        else:
            standardized = (z - self.loc) / self.scale
            per_element = -0.5 * ops.square(standardized) - ops.log(self.scale) - 0.5 * math.log(2.0 * math.pi)
        return _sum_per_example(per_element)

    def kl_divergence(self, other):
        """Analytic KL(self || other), summed over H, W, C: shape `(B,)`."""
        if has_tfp():
            per_element = tfd().kl_divergence(self._tfp(), other._tfp())
        else:
            ratio = ops.square(self.scale / other.scale)
            diff = ops.square((self.loc - other.loc) / other.scale)
            per_element = 0.5 * (ratio + diff - 1.0 - ops.log(ratio))
        return _sum_per_example(per_element)


def _sum_per_example(x):
    return ops.sum(ops.reshape(x, (ops.shape(x)[0], -1)), axis=-1)
