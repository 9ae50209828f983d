"""Batch-norm statistics re-estimated on prior samples (NVAE's `--readjust_bn`).

A hierarchical VAE's batch-norm layers keep moving averages of the
activations seen in training, where every latent was drawn from the
posterior. Sampling from the prior at a temperature below 1 feeds the
decoder activations of another scale, and the samples degrade. NVAE (Vahdat
& Kautz, 2020) re-estimates the statistics first: it runs the sampler in
training mode many times at the chosen temperature, then samples in
inference mode. `readjusted_batch_norm` does the same for the layers the
sampler runs, with a plain average over the passes (each pass weighs the
same, whatever the layer's momentum), and puts every statistic back on
exit, so the model that scores images is unchanged. The passes draw their
latents from the model's seed generator and then put its state back, so
sampling after the re-adjustment uses the same noise as sampling without:
the two differ by the statistics alone.
"""

import contextlib

import keras
from keras import ops

from keras_avae._validation import check_positive_int
from keras_avae._validation import check_temperature
from keras_avae.keras_compat import nested_layers


def batch_norm_layers(model):
    """The `BatchNormalization` layers inside `model`, at any depth.

    Example:

    >>> from keras_avae import zoo
    >>> len(batch_norm_layers(zoo.load("mnist-baseline-small")))  # doctest: +SKIP
    42
    """
    return [layer for layer in nested_layers(model) if isinstance(layer, keras.layers.BatchNormalization)]


@contextlib.contextmanager
def readjusted_batch_norm(model, temperature=1.0, steps=20, batch_size=100):
    """Inside the block, `model`'s batch-norm statistics are those of its own prior samples.

    Runs `model.top_down(batch_size=batch_size, temperature=temperature,
    training=True)` `steps` times with each batch-norm layer's moving mean
    and variance set to the average of the per-pass batch statistics
    (momentum `k / (k + 1)` at pass `k`). The log-scale noise of training is
    off during these passes: only the batch-norm layers run as in training
    (made trainable for the passes, since Keras uses batch statistics only
    in trainable batch-norm layers). The seed generator's state is put back
    after the passes. On exit the original statistics, momenta and
    `trainable` flags are restored, even after an error. Trainable weights
    are never touched.

    Args:
        model: a `HierarchicalVAE` (anything with `top_down(batch_size=...,
            temperature=..., training=...)`, `log_scale_noise` and the
            `prior_cells` and `posterior_cells` holding their own copies).
        temperature: finite positive float, the sampling temperature.
        steps: positive int, sampling passes to average over.
        batch_size: positive int, images per pass.

    Yields:
        `model`.

    Example:

    >>> from keras_avae import zoo
    >>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> with readjusted_batch_norm(model, temperature=0.7):  # doctest: +SKIP
    ...     images = model.sample(16, temperature=0.7)
    """
    temperature = check_temperature(temperature)
    steps = check_positive_int(steps, "steps")
    batch_size = check_positive_int(batch_size, "batch_size")
    norms = batch_norm_layers(model)
    saved = [
        (norm.momentum, norm.trainable, ops.convert_to_numpy(norm.moving_mean), ops.convert_to_numpy(norm.moving_variance))
        for norm in norms
    ]
    seed_state = ops.convert_to_numpy(model.seed_generator.state.value)
    # The cells read their own copy of the model's log-scale noise.
    noisy = [model] + list(model.prior_cells) + list(model.posterior_cells)
    noise = [holder.log_scale_noise for holder in noisy]

    def restore_settings():
        for holder, value in zip(noisy, noise):
            holder.log_scale_noise = value
        for norm, (momentum, trainable, _, _) in zip(norms, saved):
            norm.momentum, norm.trainable = momentum, trainable

    try:
        for holder in noisy:
            holder.log_scale_noise = 0.0
        for norm in norms:
            norm.trainable = True
        try:
            for k in range(steps):
                for norm in norms:
                    norm.momentum = k / (k + 1)
                model.top_down(batch_size=batch_size, training=True, temperature=temperature)
        finally:
            # The body draws what it would have drawn without the passes.
            model.seed_generator.state.assign(seed_state)
        restore_settings()
        yield model
    finally:
        restore_settings()
        for norm, (_, _, mean, variance) in zip(norms, saved):
            norm.moving_mean.assign(mean)
            norm.moving_variance.assign(variance)
