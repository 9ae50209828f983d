"""Gumbel-softmax (Concrete) relaxation of categorical sampling."""

import keras
import numpy as np
from keras import ops

from keras_avae._validation import check_bool
from keras_avae._validation import check_concrete_temperature
from keras_avae._validation import check_layer_seed
from keras_avae._validation import is_finite_real
from keras_avae._validation import is_integer
from keras_avae.replica_seeds import ReplicaSeedGenerator

_INFERENCE_MODES = ("sample", "mode")


@keras.saving.register_keras_serializable(package="keras_avae")
class GumbelSoftmaxSampler(keras.layers.Layer):
    """Draws relaxed one-hot samples from categorical logits.

    Computes `y = softmax((logits + g) / temperature)` with independent
    `g ~ Gumbel(0, 1)`, i.e. a sample of the Concrete (relaxed one-hot
    categorical) distribution. By the Gumbel-max property,
    `argmax(logits + g)` is distributed as `Categorical(softmax(logits))`, so
    the relaxed samples approach one-hot categorical samples as the
    temperature goes to 0 while staying differentiable in the logits.

    With `hard=True` the forward value is the exact one-hot of the argmax and
    the gradient is the soft sample's (the straight-through estimator).

    At inference (`training=False` or unset) the layer still samples by
    default (`inference_mode="sample"`), because a VAE's evaluation (ELBO,
    importance-sampled likelihood, generation) needs samples.
    `inference_mode="mode"` instead returns the deterministic one-hot of
    `argmax(logits)` (the categorical mode), e.g. for reconstructions.

    To anneal the temperature during training, pass a `keras.Variable` as the
    call-time `temperature` and `assign` to it from a callback: a Python float
    is baked into compiled functions, a variable is read at every step. Do
    this in a subclassed model that owns the variable (as `DiscreteVAE`
    does): a functional model records call arguments in its config, so
    saving one that was called with a variable fails on JAX and PyTorch and
    freezes the variable's value into a constant on TensorFlow.

    References:
        - [Jang et al., 2017](https://arxiv.org/abs/1611.01144), Categorical
          Reparameterization with Gumbel-Softmax.
        - [Maddison et al., 2017](https://arxiv.org/abs/1611.00712), The
          Concrete Distribution.

    Args:
        temperature: finite positive float, the default relaxation
            temperature `tau`.
            Defaults to `1.0`.
        hard: bool. If `True`, return straight-through one-hot samples.
            Defaults to `False`.
        axis: int, the categories axis of `logits`. Defaults to `-1`.
        inference_mode: `"sample"` (default) to sample at inference as in
            training, or `"mode"` to return `one_hot(argmax(logits))` when
            `training` is `False` or unset.
        seed: int in `[0, 2**31 - 2]` or `None`, seed of the layer's
            `SeedGenerator`.
        **kwargs: base layer keyword arguments (`name`, `dtype`, ...).

    Call arguments:
        logits: float tensor of unnormalised log-probabilities; any rank, the
            categories along `axis`.
        temperature: optional finite positive number or float tensor (a
            scalar, or broadcastable to `logits`) that overrides the
            constructor's `temperature` for this call. Values in host memory
            are checked (a `ValueError`); a tensor traced under `jit` or on
            an accelerator is not.
        training: bool or `None`; only used by `inference_mode="mode"`.

    Returns:
        A tensor of `logits`' shape in the layer's compute dtype whose values
        along `axis` are non-negative and sum to 1 (exactly one-hot when
        `hard=True` or in `"mode"` inference).

    Example:

    >>> sampler = GumbelSoftmaxSampler(temperature=0.5, hard=True, seed=0)
    >>> y = sampler(keras.ops.zeros((2, 4)))
    >>> tuple(y.shape)
    (2, 4)
    >>> [float(v) for v in keras.ops.sum(y, axis=-1)]
    [1.0, 1.0]
    """

    def __init__(
        self,
        temperature=1.0,
        hard=False,
        axis=-1,
        inference_mode="sample",
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not (is_finite_real(temperature) and temperature > 0):
            raise ValueError(
                "`temperature` must be a finite positive number (pass tensors or "
                f"variables at call time). Received: temperature={temperature!r}"
            )
        check_bool(hard, "hard")
        if not is_integer(axis):
            raise ValueError(f"`axis` must be an int. Received: axis={axis!r}")
        if inference_mode not in _INFERENCE_MODES:
            raise ValueError(
                f"`inference_mode` must be one of {_INFERENCE_MODES}. "
                f"Received: inference_mode={inference_mode!r}"
            )
        seed = check_layer_seed(seed)
        # Python numbers (NumPy's converted), so that the config is JSON.
        self.temperature = float(temperature)
        self.hard = hard
        self.axis = int(axis)
        self.inference_mode = inference_mode
        self.seed = seed
        self.seed_generator = ReplicaSeedGenerator(seed)

    def build(self, logits_shape):
        rank = len(logits_shape)
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"`axis` is out of range for logits of rank {rank}. Received: axis={self.axis}"
            )
        if logits_shape[self.axis] is None:
            raise ValueError(
                "The categories axis of `logits` must have a known size. "
                f"Received: logits_shape={logits_shape}, axis={self.axis}"
            )
        self.built = True

    def call(self, logits, temperature=None, training=None):
        # Non-negative: `one_hot` rejects negative axes other than -1 on some
        # backends.
        axis = self.axis % len(logits.shape)
        num_categories = logits.shape[axis]
        logits = ops.cast(logits, "float32")
        if self.inference_mode == "mode" and not training:
            mode = ops.one_hot(ops.argmax(logits, axis=axis), num_categories, axis=axis, dtype="float32")
            return ops.cast(mode, self.compute_dtype)

        if temperature is None:
            temperature = self.temperature
        else:
            # Concrete values only: a tensor traced under jit cannot be inspected.
            check_concrete_temperature(temperature)
        # At least float32's smallest normal number: a temperature that
        # rounds to 0 would give 0 / 0 below.
        temperature = ops.maximum(ops.cast(temperature, "float32"), np.finfo(np.float32).tiny)

        # u is kept away from 0 and 1 so that g = -log(-log u) stays finite.
        tiny = 1e-7
        u = keras.random.uniform(
            ops.shape(logits), minval=tiny, maxval=1.0 - tiny, dtype="float32", seed=self.seed_generator
        )
        perturbed = logits - ops.log(-ops.log(u))
        # Shifted by the (constant) maximum so that a tiny temperature cannot
        # overflow the logits to inf (softmax(inf) is NaN); same value and gradient.
        shifted = perturbed - ops.stop_gradient(ops.max(perturbed, axis=axis, keepdims=True))
        soft = ops.softmax(shifted / temperature, axis=axis)
        if not self.hard:
            return ops.cast(soft, self.compute_dtype)

        # Gumbel-max: the argmax of the perturbed logits is the categorical
        # sample (taken before the softmax, which may saturate into ties).
        one_hot = ops.one_hot(ops.argmax(perturbed, axis=axis), num_categories, axis=axis, dtype="float32")
        # Straight-through: `soft - stop_gradient(soft)` is exactly 0 in the
        # forward pass, so the value is exactly one-hot and the gradient is
        # the soft sample's.
        hard = one_hot + (soft - ops.stop_gradient(soft))
        return ops.cast(hard, self.compute_dtype)

    def compute_output_shape(self, logits_shape):
        return tuple(logits_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "temperature": self.temperature,
                "hard": self.hard,
                "axis": self.axis,
                "inference_mode": self.inference_mode,
                "seed": self.seed,
            }
        )
        return config
