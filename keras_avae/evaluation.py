"""Importance-sampled marginal log-likelihood and bits per dimension.

`log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K`
(Burda et al., 2016) with `z_k ~ q(z|x)`. Unlike the reference, the
deterministic bottom-up pass runs once per image; the K samples are drawn in
chunks so memory stays bounded whatever K is.
"""

import math

import keras
import numpy as np
from keras import ops


def importance_sampled_log_likelihood(model, x, num_samples=100, chunk_size=None):
    """Estimates `log p(x)` in nats for each image of `x`.

    Args:
        model: a keras-avae VAE (it provides `bottom_up` and `log_weights`).
        x: a batch of images in the model's input range.
        num_samples: K, the number of importance samples per image.
        chunk_size: samples drawn per top-down pass (default: all K at once
            for small batches, otherwise bounded so a pass holds at most 1024
            image copies).

    Returns:
        NumPy float64 array `(B,)`: the estimate for each image (nats).

    Example:

    >>> import numpy as np, keras_avae
    >>> model = keras_avae.zoo.load("mnist-attentive", num_layers=2,
    ...     preprocess_filters=4, decoder_filters=4)
    >>> x = (np.random.rand(2, 32, 32, 1) > 0.5).astype("float32")
    >>> importance_sampled_log_likelihood(model, x, num_samples=4).shape
    (2,)
    """
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"`num_samples` must be a positive int. Received: num_samples={num_samples!r}")
    batch = int(x.shape[0])
    if chunk_size is None:
        chunk_size = max(1, min(num_samples, 1024 // max(batch, 1)))
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive int. Received: chunk_size={chunk_size!r}")
    log_weights = _compiled_log_weights(model)
    x = ops.convert_to_tensor(x)
    chunks, done = [], 0
    while done < num_samples:
        k = min(chunk_size, num_samples - done)
        chunks.append(np.asarray(ops.convert_to_numpy(log_weights(x, k)), np.float64))
        done += k
    log_w = np.concatenate(chunks, axis=1)
    peak = log_w.max(axis=1, keepdims=True)
    return (peak[:, 0] + np.log(np.exp(log_w - peak).sum(axis=1))) - math.log(num_samples)


def _compiled_log_weights(model):
    """`(x, k) -> log_weights(x, bottom_up(x), k)`, XLA-compiled on TensorFlow.

    Evaluation draws millions of samples; eager TensorFlow runs the top-down
    pass about 3x slower than the compiled graph (measured on 2 CPU cores,
    `benchmarks/evaluation_speed.py`). Other backends run it eagerly.
    The bottom-up pass is recomputed per chunk inside the graph: it is cheap
    next to `k` top-down passes and keeps one compiled function per shape.
    """

    def log_weights(x, k):
        return model.log_weights(x, model.bottom_up(x, training=False), k)

    if keras.backend.backend() != "tensorflow":
        return log_weights
    compiled = getattr(model, "_keras_avae_compiled_log_weights", None)
    if compiled is None:
        import tensorflow as tf

        compiled = tf.function(log_weights, jit_compile=True, reduce_retracing=True)
        # Cached on the model so repeated calls reuse the traced graphs;
        # `object.__setattr__` keeps it out of Keras' attribute tracking.
        object.__setattr__(model, "_keras_avae_compiled_log_weights", compiled)
    return compiled


def bits_per_dim(nats, num_dims):
    """Converts a negative log-likelihood in nats to bits per dimension.

    Example:

    >>> round(bits_per_dim(3072 * math.log(2.0), 3072), 6)
    1.0
    """
    return nats / (num_dims * math.log(2.0))
