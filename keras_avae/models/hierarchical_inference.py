"""What users call on a `HierarchicalVAE`: encode, reconstruct, sample, interpolate, score.

A mixin of `HierarchicalVAE` (it uses the model's `bottom_up`, `top_down`
and data head): the inference methods in one place, apart from the
network. They check their inputs eagerly and return NumPy arrays, as
`keras.Model.predict` does.
"""

import keras
import numpy as np
from keras import ops

from keras_avae import inference_passes
from keras_avae._validation import check_bool
from keras_avae._validation import check_finite_outputs
from keras_avae._validation import check_positive_int
from keras_avae._validation import check_temperature
from keras_avae._validation import concrete_images
from keras_avae._validation import to_numpy
from keras_avae.models.batch_norm_statistics import readjusted_batch_norm


class HierarchicalInference:
    """Inference methods of `HierarchicalVAE` (see the module docstring).

    Example:

    >>> from keras_avae.models import HierarchicalVAE
    >>> issubclass(HierarchicalVAE, HierarchicalInference)
    True
    """

    @property
    def pixel_range(self):
        return (0.0, 1.0) if self.likelihood == "bernoulli" else (-1.0, 1.0)

    @property
    def pixel_levels(self):
        return 2 if self.likelihood == "bernoulli" else self.data_head.num_bins

    def _data_mean_or_sample(self, decoded, mode):
        if mode not in ("mean", "sample"):
            raise ValueError(f"`mode` must be 'mean' or 'sample'. Received: mode={mode!r}")
        params = self.data_distribution_params(decoded)
        if self.likelihood == "bernoulli":
            probs = ops.sigmoid(ops.cast(params, "float32"))
            if mode == "mean":
                return probs
            uniform = keras.random.uniform(ops.shape(probs), seed=self.seed_generator)
            return ops.cast(uniform < probs, "float32")
        values = params.mean() if mode == "mean" else params.sample(seed=self.seed_generator)
        return ops.cast(values, "float32")  # under a mixed policy too, as the docstrings say

    def encode(self, x, sample=False):
        """The posterior latents of images `x`.

        Args:
            x: images (see the call arguments). NaN or infinite values, an
                empty batch, a wrong shape or values out of range raise
                `ValueError`.
            sample: return posterior samples instead of posterior means.

        Returns:
            A list of L NumPy float32 arrays `(B, h, w, latent_channels)`,
            top layer first. The inference methods (`log_likelihood`,
            `sample`, `reconstruct`, `encode`) all return NumPy arrays, as
            `keras.Model.predict` does.
        """
        sample = bool(sample) if isinstance(sample, np.bool_) else sample
        check_bool(sample, "sample")
        x = self._check_images(x)
        latents = to_numpy(inference_passes.inference_pass(self, "encode", self._encode_pass, (1,))(x, sample))
        return check_finite_outputs(latents, "images' latents")

    def reconstruct(self, x, mode="mean"):
        """Decodes a posterior sample of each image: the mean (or a sample) of p(x|z).

        Args:
            x: images (see the call arguments), checked as in `encode`.
            mode: `"mean"` or `"sample"`, as in `sample`.

        Returns:
            NumPy float32 array with the shape of `x`.
        """
        if mode not in ("mean", "sample"):
            raise ValueError(f"`mode` must be 'mean' or 'sample'. Received: mode={mode!r}")
        x = self._check_images(x)
        images = to_numpy(inference_passes.inference_pass(self, "reconstruct", self._reconstruct_pass, (1,))(x, mode))
        return check_finite_outputs(images, "reconstructions")

    def sample(self, num_samples, temperature=1.0, mode="mean", readjust_batch_norm=False, readjust_steps=20):
        """Draws images from the prior.

        Args:
            num_samples: positive int, the number of images.
            temperature: finite positive float, the scale of the latent
                noise (1.0: the model's prior).
            mode: `"mean"` returns the mean of p(x|z) (Bernoulli
                probabilities, or the mixture mean in [-1, 1]); `"sample"`
                samples the pixels too.
            readjust_batch_norm: bool. Re-estimate the batch-norm statistics
                on `readjust_steps` passes of 100 prior samples at this
                temperature first (NVAE's `--readjust_bn`, which keeps
                low-temperature samples from degrading); the model's own
                statistics are restored afterwards (see
                `keras_avae.models.batch_norm_statistics`). The same noise
                is drawn as without it: only the statistics differ.
            readjust_steps: positive int, passes for `readjust_batch_norm`.

        Returns:
            NumPy float32 array `(num_samples, H, W, C)`.

        Raises:
            FloatingPointError: a sample holds a NaN or infinite pixel (a
                temperature far above 1 overflows the decoder).
        """
        num_samples = check_positive_int(num_samples, "num_samples")
        temperature = check_temperature(temperature)
        if mode not in ("mean", "sample"):
            raise ValueError(f"`mode` must be 'mean' or 'sample'. Received: mode={mode!r}")
        # A NumPy bool from an array of settings too, as `encode(sample=...)` takes it.
        readjust_batch_norm = bool(readjust_batch_norm) if isinstance(readjust_batch_norm, np.bool_) else readjust_batch_norm
        check_bool(readjust_batch_norm, "readjust_batch_norm")
        if readjust_batch_norm:
            readjust_steps = check_positive_int(readjust_steps, "readjust_steps")
            with readjusted_batch_norm(self, temperature, steps=readjust_steps):
                return self.sample(num_samples, temperature, mode)
        # The temperature is not static: one compiled pass serves every temperature.
        sample = inference_passes.inference_pass(self, "sample", self._sample_pass, (0, 2))
        images = to_numpy(sample(num_samples, float(temperature), mode))
        cause = (
            f"at temperature={temperature!r}, latent noise scaled that far overflows the decoder (1.0 samples the "
            "prior); a model whose weights are not finite gives them at any temperature"
        )
        return check_finite_outputs(images, "samples", cause)

    def interpolate(self, x_a, x_b, steps=8, mode="mean"):
        """Images decoded along straight lines between the posterior means of `x_a` and `x_b`.

        Every layer's latent is interpolated, `z_l(t) = (1 - t) mu_l(x_a) +
        t mu_l(x_b)` for `steps` values of t from 0 to 1, and the L latents
        are decoded together. `mu_l` is the posterior mean `encode` returns
        (for l >= 1, at one posterior sample of the layers above).

        Args:
            x_a: an image `(H, W, C)` or a batch `(B, H, W, C)`.
            x_b: the same shape as `x_a`.
            steps: int >= 2, images per line, both ends included.
            mode: `"mean"` or `"sample"`, as in `sample`.

        Returns:
            NumPy float32 array `(steps, H, W, C)` for single images, `(B,
            steps, H, W, C)` for batches.
        """
        if check_positive_int(steps, "steps") < 2:
            raise ValueError(f"`steps` must be an int >= 2. Received: steps={steps!r}")
        x_a, x_b, single = self._interpolation_ends(x_a, x_b)
        t = np.linspace(0.0, 1.0, steps, dtype=np.float32).reshape(1, steps, 1, 1, 1)
        latents = [
            ((1 - t) * a[:, None] + t * b[:, None]).reshape((-1,) + a.shape[1:])
            for a, b in zip(self.encode(x_a), self.encode(x_b))
        ]
        decode = inference_passes.inference_pass(self, "decode", self._decode_pass, (1,))
        images = to_numpy(decode(latents, mode)).reshape((len(x_a), steps) + x_a.shape[1:])
        check_finite_outputs(images, "interpolations")
        return images[0] if single else images

    def _interpolation_ends(self, x_a, x_b):
        """`interpolate`'s `x_a` and `x_b` checked, as float32 batches, and whether they are single images.

        Every message names the argument and the shape it was received
        with, not that of the batch of one a single image is checked as.
        """
        x_a, x_b = concrete_images(x_a, "x_a"), concrete_images(x_b, "x_b")
        if x_a.ndim not in (3, 4):
            h, w, c = self.image_shape
            raise ValueError(
                f"Expected `x_a` of shape ({h}, {w}, {c}), one image, or (batch, {h}, {w}, {c}). "
                f"Received: x_a.shape={x_a.shape}"
            )
        if x_a.shape != x_b.shape:
            raise ValueError(
                "`x_a` and `x_b` must have the same shape: two images (H, W, C) or two batches (B, H, W, C) of "
                f"the same size. Received: x_a.shape={x_a.shape} and x_b.shape={x_b.shape}"
            )
        single = x_a.ndim == 3
        x_a = to_numpy(self._check_images(x_a, name="x_a", single_image=single))
        x_b = to_numpy(self._check_images(x_b, name="x_b", single_image=single))
        return x_a, x_b, single

    # === The passes (compiled once per shape on JAX; see `inference_passes`) ===
    def _encode_pass(self, x, sample):
        result = self.top_down(self.bottom_up(x, training=False), training=False, return_latents=True)
        return result["latents"] if sample else result["posterior_means"]

    def _reconstruct_pass(self, x, mode):
        result = self.top_down(self.bottom_up(x, training=False), training=False)
        return self._data_mean_or_sample(result["decoded"], mode)

    def _sample_pass(self, num_samples, temperature, mode):
        result = self.top_down(batch_size=num_samples, training=False, temperature=temperature)
        return self._data_mean_or_sample(result["decoded"], mode)

    def _decode_pass(self, latents, mode):
        return self._data_mean_or_sample(self.top_down(latents=latents, training=False)["decoded"], mode)

    def _activation_floats_per_sample(self):
        """Size of what one image-sample's pass holds, for evaluation's memory budget.

        The widest full-resolution feature map plus, per stochastic layer,
        the bottom-up feature and the top-down context at the latent size
        (float32 values; the measured peak is a constant multiple of this,
        see `keras_avae.evaluation`).
        """
        h, w, c = self.image_shape
        latent = self._latent_size[0] * self._latent_size[1]
        return h * w * max(self.preprocess_filters, c) + self.num_layers * latent * (
            self._values + self._ik + self._context
        )

    def log_weights(self, x, features, num_samples):
        """Importance log-weights `log p(x|z) + log p(z) - log q(z|x)`, `(B, num_samples)`.

        `features` is `bottom_up(x)`: the deterministic pass is computed once
        per image and shared by all samples.
        """
        batch = ops.shape(x)[0]
        tiled = [ops.repeat(f, num_samples, axis=0) for f in features]
        result = self.top_down(tiled, training=False, return_log_probs=True)
        params = self.data_distribution_params(result["decoded"])
        log_px = self._log_likelihood(params, ops.repeat(x, num_samples, axis=0))
        log_w = log_px + result["log_prior"] - result["log_posterior"]
        return ops.reshape(log_w, (batch, num_samples))
