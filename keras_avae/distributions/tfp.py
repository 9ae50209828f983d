"""TensorFlow Probability for the active Keras backend.

TFP ships one substrate per array library: `tensorflow_probability` for
TensorFlow and `tensorflow_probability.substrates.jax` for JAX (it needs the
pinned `tfp-nightly`, see pyproject.toml). It has no PyTorch substrate, so
the torch backend uses the closed forms in `keras_avae.distributions.gaussian`,
which the tests check against TFP.
"""

import functools

import keras


def has_tfp():
    """Whether TFP backs the distribution math on the current backend.

    Example:

    On TFP backends the standard normal's log-density at 0 comes from TFP;
    elsewhere from the formula it must equal, `-log(2 pi) / 2`:

    >>> import math
    >>> if has_tfp():
    ...     log_p = float(tfd().Normal(0.0, 1.0).log_prob(0.0))
    ... else:
    ...     log_p = -0.5 * math.log(2.0 * math.pi)
    >>> round(log_p, 4)
    -0.9189
    """
    return keras.backend.backend() in ("tensorflow", "jax")


@functools.cache
def tfd():
    """`tfp.distributions` for the current Keras backend.

    Raises:
        RuntimeError: on a backend without a TFP substrate (torch, numpy).

    Example:

    >>> import keras
    >>> if keras.backend.backend() in ("tensorflow", "jax"):
    ...     normal = tfd().Normal(0.0, 1.0)
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow_probability as tfp

        return tfp.distributions
    if backend == "jax":
        from tensorflow_probability.substrates import jax as tfp

        return tfp.distributions
    raise RuntimeError(
        f"TensorFlow Probability has no substrate for the {backend!r} Keras backend; "
        "keras_avae uses its closed-form keras.ops fallbacks there."
    )
