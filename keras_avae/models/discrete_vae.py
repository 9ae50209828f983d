"""A VAE with categorical latents, relaxed by the Gumbel-softmax."""

import math

import keras
from keras import ops

from keras_avae import inference_passes
from keras_avae._validation import check_bool
from keras_avae._validation import check_crop
from keras_avae._validation import check_finite_number
from keras_avae._validation import check_finite_outputs
from keras_avae._validation import check_image_shape
from keras_avae._validation import check_layer_seed
from keras_avae._validation import check_positive_int
from keras_avae._validation import check_temperature
from keras_avae._validation import to_numpy
from keras_avae.distributions.bernoulli import bernoulli_log_prob
from keras_avae.distributions.tfp import has_tfp
from keras_avae.distributions.tfp import tfd
from keras_avae.layers.gumbel_softmax_sampler import GumbelSoftmaxSampler
from keras_avae.models.elbo_model import ELBOModel
from keras_avae.replica_seeds import ReplicaSeedGenerator


@keras.saving.register_keras_serializable(package="keras_avae")
class DiscreteVAE(ELBOModel):
    """Categorical-latent VAE for binary images (Jang et al.; Maddison et al., 2017).

    A convolutional encoder gives the logits of `num_latents` independent
    categorical variables with `num_categories` classes each. Training uses
    relaxed one-hot samples from `GumbelSoftmaxSampler` at the current
    `temperature` (a non-trainable variable, annealed by
    `GumbelTemperatureSchedule`), or straight-through hard samples with
    `straight_through=True`. Called without `training=True` (evaluation,
    validation) the model draws exact one-hot samples, so `nll + kl` is the
    discrete model's negative ELBO. The prior is uniform; the KL term is the exact
    categorical `KL(q(z|x) || Uniform)` (TFP on TensorFlow/JAX). The
    likelihood is Bernoulli. For `log_likelihood` the importance samples are
    exact (hard) categorical draws, so the estimate bounds the discrete
    model's `log p(x)`.

    Args:
        image_shape: `(H, W, C)` with H and W divisible by 4.
        num_latents: number of categorical variables.
        num_categories: classes per variable.
        filters: channels of the first conv (doubled by the second).
        hidden_units: width of the dense layers.
        temperature: initial relaxation temperature.
        straight_through: use hard one-hot samples with soft gradients.
        crop: pixels on each side left out of the likelihood.
        l2: L2 factor on every weight; 0 disables.
        seed: int or `None`.
        **kwargs: `keras.Model` arguments.

    Call arguments:
        inputs: binary images `(B, H, W, C)` in {0, 1}.
        training: bool.

    Returns:
        Dict of per-example float32 tensors `"nll"`, `"kl"` and
        `"kl_per_layer"` (B, num_latents), as `HierarchicalVAE`.

    Example:

    >>> import numpy as np
    >>> model = DiscreteVAE(image_shape=(8, 8, 1), num_latents=4,
    ...     num_categories=3, filters=4, hidden_units=16, seed=0)
    >>> x = (np.random.rand(2, 8, 8, 1) > 0.5).astype("float32")
    >>> tuple(model(x)["kl_per_layer"].shape)
    (2, 4)
    """

    def __init__(
        self,
        image_shape=(32, 32, 1),
        num_latents=30,
        num_categories=10,
        filters=32,
        hidden_units=512,
        temperature=1.0,
        straight_through=False,
        crop=0,
        l2=0.0,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_image_shape(image_shape)
        image_shape = tuple(int(s) for s in image_shape)
        # NumPy ints as Python ints: the config is JSON.
        num_latents = check_positive_int(num_latents, "num_latents")
        num_categories = check_positive_int(num_categories, "num_categories")
        filters = check_positive_int(filters, "filters")
        hidden_units = check_positive_int(hidden_units, "hidden_units")
        if num_categories < 2:
            raise ValueError(f"`num_categories` must be at least 2. Received: num_categories={num_categories}")
        if image_shape[0] % 4 or image_shape[1] % 4:
            raise ValueError(f"`image_shape` must be (H, W, C) with H, W divisible by 4. Received: image_shape={image_shape}")
        check_temperature(temperature)
        check_bool(straight_through, "straight_through")
        check_crop(crop, image_shape)  # half the image or more left no pixel to score (the likelihood was 0)
        crop = int(crop)
        check_finite_number(l2, "l2", lambda v: v >= 0, ">= 0")
        seed = check_layer_seed(seed)
        # === Config ===
        self.image_shape = image_shape
        self.num_latents = num_latents
        self.num_categories = num_categories
        self.filters = filters
        self.hidden_units = hidden_units
        self.initial_temperature = float(temperature)
        self.straight_through = straight_through
        self.crop = crop
        self.l2 = l2
        self.seed = seed

        # === Layers ===
        reg = keras.regularizers.L2(l2) if l2 else None
        weights = dict(kernel_regularizer=reg, bias_regularizer=reg, dtype=self.dtype_policy)
        conv = dict(padding="same", activation="elu", **weights)
        dense = weights
        h, w, c = image_shape
        self.encoder_layers = [
            keras.layers.Conv2D(filters, 3, strides=2, name="encoder_conv_0", **conv),
            keras.layers.Conv2D(2 * filters, 3, strides=2, name="encoder_conv_1", **conv),
            keras.layers.Flatten(dtype=self.dtype_policy),
            keras.layers.Dense(hidden_units, activation="elu", name="encoder_dense", **dense),
            keras.layers.Dense(num_latents * num_categories, name="encoder_logits", **dense),
        ]
        self.decoder_layers = [
            keras.layers.Dense(hidden_units, activation="elu", name="decoder_dense_0", **dense),
            keras.layers.Dense((h // 4) * (w // 4) * 2 * filters, activation="elu", name="decoder_dense_1", **dense),
            keras.layers.Reshape((h // 4, w // 4, 2 * filters), dtype=self.dtype_policy),
            keras.layers.Conv2DTranspose(filters, 3, strides=2, name="decoder_deconv_0", **conv),
            keras.layers.Conv2DTranspose(filters, 3, strides=2, name="decoder_deconv_1", **conv),
            keras.layers.Conv2D(c, 3, padding="same", name="decoder_logits", **weights),
        ]
        self.sampler = GumbelSoftmaxSampler(
            temperature=self.initial_temperature, hard=straight_through, seed=seed, dtype=self.dtype_policy
        )
        self.seed_generator = ReplicaSeedGenerator(seed)
        self.temperature = self.add_weight(
            name="temperature",
            shape=(),
            initializer=keras.initializers.Constant(self.initial_temperature),
            trainable=False,
            dtype="float32",
        )
        self._build_elbo_state(num_latents)

    def bottom_up(self, x, training=None):
        """Encoder logits `(B, num_latents, num_categories)` (float32)."""
        h = 2.0 * ops.cast(x, self.compute_dtype) - 1.0
        for layer in self.encoder_layers:
            h = layer(h, training=training)
        logits = ops.reshape(ops.cast(h, "float32"), (-1, self.num_latents, self.num_categories))
        # Normalised log-probabilities, so KL and log q need no extra softmax.
        return ops.log_softmax(logits, axis=-1)

    def decode(self, z, training=None):
        """Bernoulli logits of p(x|z) for one-hot (or relaxed) latents `z`."""
        h = ops.reshape(ops.cast(z, self.compute_dtype), (-1, self.num_latents * self.num_categories))
        for layer in self.decoder_layers:
            h = layer(h, training=training)
        return h

    def _kl_to_uniform(self, log_q):
        """KL(Categorical(q) || Uniform) per latent: `(B, num_latents)`."""
        if has_tfp():
            d = tfd()
            uniform = d.Categorical(logits=ops.zeros_like(log_q))
            return d.kl_divergence(d.Categorical(logits=log_q), uniform)
        return ops.sum(ops.exp(log_q) * log_q, axis=-1) + math.log(self.num_categories)

    def call(self, inputs, training=None):
        log_q = self.bottom_up(inputs, training=training)
        if training:
            z = self.sampler(log_q, temperature=self.temperature, training=training)
        else:
            # The discrete model's ELBO: the relaxed one at a temperature is
            # another model's objective, not a bound on this one's log p(x)
            # (measured on mnist-gumbel-small: -ELBO 95.5 relaxed, 111.5 with
            # exact draws, against an importance-sampled NLL of 93.1).
            z = self._hard_sample(log_q)
        logits = self.decode(z, training=training)
        nll = -bernoulli_log_prob(logits, inputs, crop=self.crop)
        kl_per_latent = self._kl_to_uniform(log_q)
        return {"nll": nll, "kl": ops.sum(kl_per_latent, axis=-1), "kl_per_layer": kl_per_latent}

    def _hard_sample(self, log_q):
        index = keras.random.categorical(
            ops.reshape(log_q, (-1, self.num_categories)), 1, seed=self.seed_generator
        )
        one_hot = ops.one_hot(ops.reshape(index, (-1,)), self.num_categories)
        return ops.reshape(one_hot, ops.shape(log_q))

    def log_weights(self, x, features, num_samples):
        """`log p(x|z) + log p(z) - log q(z|x)` for exact categorical draws, `(B, K)`."""
        batch = ops.shape(x)[0]
        log_q = ops.repeat(features, num_samples, axis=0)
        z = self._hard_sample(log_q)
        log_px = bernoulli_log_prob(self.decode(z), ops.repeat(x, num_samples, axis=0), crop=self.crop)
        log_qz = ops.sum(z * log_q, axis=(1, 2))
        log_pz = -self.num_latents * math.log(self.num_categories)
        return ops.reshape(log_px + log_pz - log_qz, (batch, num_samples))

    def _activation_floats_per_sample(self):
        """Size of what one image-sample's pass holds, for evaluation's memory budget."""
        h, w, c = self.image_shape
        return h * w * max(self.filters, c) + 2 * self.hidden_units + self.num_latents * self.num_categories

    def encode(self, x):
        """Posterior class probabilities of images `x`.

        Args:
            x: binary images `(B, H, W, C)`; NaN or infinite values, an empty
                batch, a wrong shape or values outside [0, 1] raise
                `ValueError`.

        Returns:
            NumPy float32 array `(B, num_latents, num_categories)`. The
            inference methods (`log_likelihood`, `sample`, `reconstruct`,
            `encode`) all return NumPy arrays, as `keras.Model.predict` does.
        """
        x = self._check_images(x)
        probabilities = to_numpy(inference_passes.inference_pass(self, "encode", self._encode_pass)(x))
        return check_finite_outputs(probabilities, "images' posteriors")

    def reconstruct(self, x):
        """Bernoulli means of p(x|z) at a posterior draw of z.

        Args:
            x: binary images, checked as in `encode`.

        Returns:
            NumPy float32 array with the shape of `x`.
        """
        x = self._check_images(x)
        images = to_numpy(inference_passes.inference_pass(self, "reconstruct", self._reconstruct_pass)(x))
        return check_finite_outputs(images, "reconstructions")

    def sample(self, num_samples):
        """Bernoulli means of p(x|z) for z drawn from the uniform prior.

        Args:
            num_samples: positive int, the number of images.

        Returns:
            NumPy float32 array `(num_samples, H, W, C)`.
        """
        num_samples = check_positive_int(num_samples, "num_samples")
        images = to_numpy(inference_passes.inference_pass(self, "sample", self._sample_pass, (0,))(num_samples))
        return check_finite_outputs(images, "samples")

    # === The passes (compiled once per shape on JAX; see `inference_passes`) ===
    def _encode_pass(self, x):
        return ops.exp(self.bottom_up(x, training=False))

    def _reconstruct_pass(self, x):
        return self._bernoulli_means(self._hard_sample(self.bottom_up(x, training=False)))

    def _sample_pass(self, num_samples):
        uniform = ops.zeros((num_samples, self.num_latents, self.num_categories), "float32")
        return self._bernoulli_means(self._hard_sample(uniform))

    def _bernoulli_means(self, z):
        return ops.sigmoid(ops.cast(self.decode(z, training=False), "float32"))

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "image_shape": self.image_shape,
                "num_latents": self.num_latents,
                "num_categories": self.num_categories,
                "filters": self.filters,
                "hidden_units": self.hidden_units,
                "temperature": self.initial_temperature,
                "straight_through": self.straight_through,
                "crop": self.crop,
                "l2": self.l2,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class GumbelTemperatureSchedule(keras.callbacks.Callback):
    """Anneals `model.temperature` as `max(minimum, initial * exp(-rate * step))`.

    The schedule of Jang et al. (2017), updated every `update_every` steps.

    Args:
        initial: starting temperature. Defaults to `1.0`.
        minimum: floor. Defaults to `0.5`.
        rate: decay per step. Defaults to `1e-4`.
        update_every: steps between updates. Defaults to `1000`.

    Example:

    >>> schedule = GumbelTemperatureSchedule(initial=1.0, minimum=0.5, rate=1e-3)
    >>> round(schedule.temperature_at(1000), 4)
    0.5
    """

    def __init__(self, initial=1.0, minimum=0.5, rate=1e-4, update_every=1000):
        super().__init__()
        if not 0 < minimum <= initial:
            raise ValueError(f"Need 0 < minimum <= initial. Received: minimum={minimum}, initial={initial}")
        self.initial = initial
        self.minimum = minimum
        self.rate = rate
        self.update_every = update_every
        self._step = 0

    def temperature_at(self, step):
        step = (step // self.update_every) * self.update_every
        return max(self.minimum, self.initial * math.exp(-self.rate * step))

    def on_train_batch_begin(self, batch, logs=None):
        if self._step % self.update_every == 0:
            self.model.temperature.assign(self.temperature_at(self._step))
        self._step += 1
