"""The hierarchical attentive VAE (Apostolopoulou et al., ICLR 2022)."""

import random

import keras
from keras import ops

from keras_avae.distributions.bernoulli import bernoulli_log_prob
from keras_avae.distributions.gaussian import DiagonalGaussian
from keras_avae.keras_compat import call_sublayer
from keras_avae.keras_compat import nested_layers
from keras_avae.layers.batched_weight_norm import batched_normalized_kernels
from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D
from keras_avae.models.elbo_model import ELBOModel
from keras_avae.models.hierarchical_config import CONFIG_KEYS
from keras_avae.models.hierarchical_config import validate_config
from keras_avae.models.hierarchical_inference import HierarchicalInference
from keras_avae.models.hierarchical_layers import HierarchicalLayers
from keras_avae.models.weight_layout import check_weight_layout
from keras_avae.replica_seeds import ReplicaSeedGenerator


@keras.saving.register_keras_serializable(package="keras_avae")
class HierarchicalVAE(HierarchicalLayers, HierarchicalInference, ELBOModel):
    """Deep attentive VAE: bidirectional inference over L stochastic layers.

    "Deep Attentive Variational Inference" (Apostolopoulou, Char, Rosenfeld,
    Dubrawski; ICLR 2022), built on NVAE (Vahdat & Kautz, 2020). A
    deterministic bottom-up pass maps the image to features `e[L], ..., e[0]`
    (all at the latent size). The top-down pass starts from a learned
    constant and, at each layer, builds a prior `p(z_l | z_<l)` and a
    posterior `q(z_l | x, z_<l)` (a residual correction of the prior, as in
    NVAE), samples `z_l` from the posterior and passes it down. Three
    switches reproduce the paper's ablation (Table 5):

    - `generative_attention`: each layer's prior context also attends, per
      pixel, over the contexts of all earlier layers (eq. 7-9).
    - `inference_attention`: each layer's posterior attends over its own and
      all deeper bottom-up features (eq. 10-11).
    - `nonlocal_blocks`: spatial non-local blocks in the named parts of the
      network (Sec. 2.6), exact softmax or FAVOR+ (`nonlocal_attention`).

    With all three off the model is the NVAE-style baseline. Every attention
    branch enters through a zero-initialised scalar gate, so at initialisation
    the attentive model computes the same function as its baseline part.

    Channel bookkeeping follows the reference implementation (so parameter
    counts match the paper): posterior keys are the last
    `inference_attention_dim` channels of every bottom-up feature; the
    decoder output of a layer splits into `[context, key, query]`; the
    inference query is the first channels of the context. Differences from
    the reference, all deliberate: each context is normalised once, when it is
    made (eq. 5 applied once, not re-normalised by every later layer), one L2
    factor applies to every weight (the reference's `'l2'` strings silently
    used 0.01), the discretized logistic pmf sums to 1
    (`reference_edge_bug=False`), and attention logit scales are trained.

    Args:
        image_shape: `(H, W, C)` of the (padded) images; H and W divisible by
            `2 ** num_scales`.
        num_layers: L, the number of stochastic layers.
        latent_channels: channels of each latent `z_l`.
        num_scales: down-sampling stages before the hierarchy (each halves H
            and W, doubles channels).
        preprocess_filters: stem width.
        decoder_filters: decoder width before down-sampling (the top-down
            width is `decoder_filters * 2 ** num_scales`).
        preprocess_cells: `"same"` residual cells before each down-sampling.
        postprocess_cells: `"same"` residual cells after each up-sampling.
        cells_per_layer: residual cells in every encoder and decoder cell.
        generative_attention: bool, depth-wise attention in the prior.
        inference_attention: bool, depth-wise attention in the posterior.
        generative_attention_dim: query/key channels of the prior attention.
        inference_attention_dim: query/key channels of the posterior
            attention; divisible by `2 ** num_scales`.
        generative_attention_layer_norm: bool, eq. 5-6 normalisation there.
        inference_attention_layer_norm: bool, eq. 5-6 normalisation there.
        nonlocal_blocks: parts holding non-local blocks, a subset of
            `("preprocess", "encoder", "decoder", "merge", "postprocess")`.
        nonlocal_key_dim: key channels of the non-local blocks.
        nonlocal_attention: `"softmax"` or `"performer"` (FAVOR+).
        nonlocal_num_random_features: FAVOR+ random features.
        likelihood: `"logistic_mixture"` (images in [-1, 1]) or
            `"bernoulli"` (binary images in {0, 1}).
        num_mixtures: mixture components of the logistic mixture.
        reference_edge_bug: reproduce the reference's DLM upper-edge bug.
        crop: pixels on each side excluded from the likelihood (2 for 28x28
            images padded to 32x32).
        prior_log_scale_bounds: `(low, high)` for the prior's log sigma.
        posterior_log_scale_bounds: `(low, high)` for the posterior's.
        log_scale_noise: std of Gaussian noise added to the raw log sigmas
            during training (CIFAR-10: 0.001); 0 disables.
        l2: L2 factor on every weight (the paper's recipe: 1.5e-4); 0 disables.
        bn_momentum: batch-norm momentum. Defaults to `0.9`.
        bn_epsilon: batch-norm epsilon. Defaults to `1e-5`.
        synchronized_batch_norm: synchronise batch-norm statistics across
            replicas (TensorFlow `tf.distribute`).
        seed: int or `None`, seeds latent sampling (and, when
            `nonlocal_feature_seed` is `None`, the random features).
        nonlocal_feature_seed: int or `None`, seeds the FAVOR+ random
            features of the performer non-local blocks. The features are part
            of the function the weights were trained with, so this is resolved
            to a concrete int at construction (`seed`, or a random int when
            both are `None`) and kept in `get_config()`: a saved or reloaded
            model computes with the features it was trained with, whatever
            sampling `seed` it is given. Every performer block of the model
            draws from this one seed, so blocks of the same `key_dim` share
            one feature matrix (the shipped entries were trained so).
        **kwargs: `keras.Model` arguments (`name`, `dtype`).

    Call arguments:
        inputs: images `(B, H, W, C)`: in [-1, 1] on the 256-level grid for
            `"logistic_mixture"`, in {0, 1} for `"bernoulli"`.
        training: bool.

    Returns:
        A dict of per-example float32 tensors: `"nll"` (B,) the negative
        log-likelihood of the image given the sampled latents, `"kl"` (B,) the
        total KL, `"kl_per_layer"` (B, L). `compute_loss` turns them into the
        negative ELBO `mean(nll) + kl_weight * mean(kl)`.

    Example:

    >>> import numpy as np
    >>> model = HierarchicalVAE(image_shape=(8, 8, 1), num_layers=2,
    ...     latent_channels=2, preprocess_filters=4, decoder_filters=4,
    ...     generative_attention_dim=2, inference_attention_dim=2,
    ...     nonlocal_blocks=("merge",), nonlocal_key_dim=2,
    ...     likelihood="bernoulli", seed=1)
    >>> x = (np.random.rand(4, 8, 8, 1) > 0.5).astype("float32")
    >>> out = model(x)
    >>> sorted(out), tuple(out["kl_per_layer"].shape)
    (['kl', 'kl_per_layer', 'nll'], (4, 2))
    """

    def __init__(
        self,
        image_shape=(32, 32, 3),
        num_layers=16,
        latent_channels=20,
        num_scales=1,
        preprocess_filters=128,
        decoder_filters=128,
        preprocess_cells=1,
        postprocess_cells=1,
        cells_per_layer=2,
        generative_attention=True,
        inference_attention=True,
        generative_attention_dim=20,
        inference_attention_dim=20,
        generative_attention_layer_norm=True,
        inference_attention_layer_norm=True,
        nonlocal_blocks=("preprocess", "encoder", "decoder"),
        nonlocal_key_dim=32,
        nonlocal_attention="softmax",
        nonlocal_num_random_features=256,
        likelihood="logistic_mixture",
        num_mixtures=5,
        reference_edge_bug=False,
        crop=0,
        prior_log_scale_bounds=(-5.0, 5.0),
        posterior_log_scale_bounds=(-5.0, 5.0),
        log_scale_noise=0.0,
        l2=1.5e-4,
        bn_momentum=0.9,
        bn_epsilon=1e-5,
        synchronized_batch_norm=False,
        seed=None,
        nonlocal_feature_seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        nonlocal_blocks = tuple(nonlocal_blocks or ())
        validate_config(locals())
        image_shape = tuple(int(s) for s in image_shape)  # JSON lists and NumPy ints alike
        # NumPy ints (a sweep over `np.arange`) as Python ints: the config is JSON, and the layers take ints.
        num_layers, latent_channels, num_scales, preprocess_filters, decoder_filters = map(
            int, (num_layers, latent_channels, num_scales, preprocess_filters, decoder_filters)
        )
        preprocess_cells, postprocess_cells, cells_per_layer, num_mixtures, crop = map(
            int, (preprocess_cells, postprocess_cells, cells_per_layer, num_mixtures, crop)
        )
        generative_attention_dim, inference_attention_dim, nonlocal_key_dim, nonlocal_num_random_features = map(
            int, (generative_attention_dim, inference_attention_dim, nonlocal_key_dim, nonlocal_num_random_features)
        )
        # === Config ===
        self.image_shape = image_shape
        self.num_layers = num_layers
        self.latent_channels = latent_channels
        self.num_scales = num_scales
        self.preprocess_filters = preprocess_filters
        self.decoder_filters = decoder_filters
        self.preprocess_cells = preprocess_cells
        self.postprocess_cells = postprocess_cells
        self.cells_per_layer = cells_per_layer
        self.generative_attention = generative_attention
        self.inference_attention = inference_attention
        self.generative_attention_dim = generative_attention_dim
        self.inference_attention_dim = inference_attention_dim
        self.generative_attention_layer_norm = generative_attention_layer_norm
        self.inference_attention_layer_norm = inference_attention_layer_norm
        self.nonlocal_blocks = nonlocal_blocks
        self.nonlocal_key_dim = nonlocal_key_dim
        self.nonlocal_attention = nonlocal_attention
        self.nonlocal_num_random_features = nonlocal_num_random_features
        self.likelihood = likelihood
        self.num_mixtures = num_mixtures
        self.reference_edge_bug = reference_edge_bug
        self.crop = crop
        self.prior_log_scale_bounds = tuple(float(b) for b in prior_log_scale_bounds)
        self.posterior_log_scale_bounds = tuple(float(b) for b in posterior_log_scale_bounds)
        self.log_scale_noise = log_scale_noise
        self.l2 = l2
        self.bn_momentum = bn_momentum
        self.bn_epsilon = bn_epsilon
        self.synchronized_batch_norm = synchronized_batch_norm
        seed = None if seed is None else int(seed)  # NumPy's too (checked above): a JSON config
        self.seed = seed
        if nonlocal_feature_seed is None:
            nonlocal_feature_seed = seed if seed is not None else random.randint(1, int(1e9))  # the layers' own range
        self.nonlocal_feature_seed = int(nonlocal_feature_seed)

        # === Channel bookkeeping (reference widths, see the class docstring) ===
        scale = 2**num_scales
        self._ik = inference_attention_dim if inference_attention else 0
        self._gk = generative_attention_dim if (generative_attention and num_layers > 1) else 0
        self._values = preprocess_filters * scale  # E: value channels of h_l
        self._context = decoder_filters * scale + self._ik  # P: prior context
        self._latent_size = (image_shape[0] // scale, image_shape[1] // scale)
        self._regularizer = keras.regularizers.L2(l2) if l2 else None
        self.seed_generator = ReplicaSeedGenerator(seed)

        # === Layers ===
        self._build_layers()
        self._build_elbo_state(num_layers)

    # ------------------------------------------------------------------ #
    # Forward passes
    # ------------------------------------------------------------------ #
    def _encoder_input(self, x):
        x = ops.cast(x, self.compute_dtype)
        return 2.0 * x - 1.0 if self.likelihood == "bernoulli" else x

    def bottom_up(self, x, training=None):
        """Deterministic features `[e_0, ..., e_L]` (e_L: the pre-processed image)."""
        e = call_sublayer(self.stem, self._encoder_input(x))
        for cell in self.preprocess:
            e = call_sublayer(cell, e, training=training)
        features = [e]
        for j in reversed(range(self.num_layers)):
            for cell in self._cells_of(self.encoder_cells, j):
                e = call_sublayer(cell, e, training=training)
            features.append(e)
        return features[::-1]

    def top_down(
        self,
        features=None,
        batch_size=None,
        training=None,
        temperature=1.0,
        return_log_probs=False,
        return_latents=False,
        latents=None,
        return_attention=False,
    ):
        """The top-down pass.

        With `features` (from `bottom_up`) it samples every `z_l` from the
        posterior and returns the KLs; without, it samples from the prior (at
        `temperature`) for `batch_size` images, or, with `latents` (a list of
        L tensors, as `encode` returns), decodes those latents.

        Returns:
            A dict: `"decoded"` (the features fed to the data head),
            `"kl_per_layer"` (B, L) when `features` is given, with
            `return_log_probs` `"log_prior"`/`"log_posterior"` (B,) of the
            sampled latents, with `return_latents` `"latents"` (the L
            samples) and `"posterior_means"` (with `features`), and with
            `return_attention` `"generative_attention"` and
            `"inference_attention"`: per layer, the depth-wise attention
            weights `(B, h, w, N)` over its N contexts, or `None` where the
            layer does not attend.
        """
        L, P, ik = self.num_layers, self._context, self._ik
        posterior = features is not None
        if posterior and latents is not None:
            raise ValueError("Pass `features` (posterior sampling) or `latents` (decoding), not both.")
        if latents is not None:
            if len(latents) != L:
                raise ValueError(f"`latents` must hold one tensor per layer ({L}). Received: {len(latents)} tensors")
            batch_size = ops.shape(latents[0])[0]
        if posterior:
            batch_size = ops.shape(features[0])[0]
        generative_scores, inference_scores = [None] * L, [None] * L
        kls, log_p, log_q = [], 0.0, 0.0
        dtype = self.compute_dtype

        # Cut before tiling: the slices' gradients stay the constant's size.
        top = ops.cast(self.top_constant, dtype)
        tile = lambda part: ops.tile(part, (batch_size, 1, 1, 1))  # noqa: E731
        top_values, top_keys, top_query = tile(top[..., :P]), tile(top[..., P:]), tile(top[..., :ik])
        context_values, context_keys = [top_values], [top_keys]
        if posterior:
            # Each feature split once into (value, key) for every layer's posterior.
            features = self.posterior_cells[0].split_features(features)
        latent_shape = (batch_size, *self._latent_size, self.latent_channels)
        prior = DiagonalGaussian.standard(latent_shape)

        z = None
        given, latents, means = latents, [], []
        for i in range(L):
            if i == 0:
                condition, query, prior_raw = top_values, top_query, None
            else:
                cell = self.prior_cells[i - 1]
                step = call_sublayer(
                    cell, context_values, context_keys, z, training=training, seed_generator=self.seed_generator
                )
                condition, query, prior_raw, prior = step["condition"], step["query"], step["raw"], step["prior"]
                generative_scores[i] = step["scores"]
                # Earlier contexts are read only by the generative attention.
                context_values = context_values + [step["context"]] if cell.attend is not None else [step["context"]]
                if step["key"] is not None:
                    context_keys = context_keys + [step["key"]]
            if given is not None:
                z = ops.convert_to_tensor(given[i], "float32")
            elif posterior:
                q, inference_scores[i] = call_sublayer(
                    self.posterior_cells[i],
                    condition,
                    query,
                    prior_raw,
                    features,
                    training=training,
                    seed_generator=self.seed_generator,
                )
                z = q.sample(seed=self.seed_generator)
                kls.append(q.kl_divergence(prior))
                means.append(q.loc)
                if return_log_probs:
                    log_q = log_q + q.log_prob(z)
                    log_p = log_p + prior.log_prob(z)
            else:
                z = prior.sample(seed=self.seed_generator, temperature=temperature)
            latents.append(z)
            z = ops.cast(z, dtype)

        decoded = call_sublayer(self.merge_output, ops.concatenate([context_values[-1], z], axis=-1))
        if self.merge_output_nonlocal is not None:
            decoded = call_sublayer(self.merge_output_nonlocal, decoded, training=training)
        for cell in self.postprocess:
            decoded = call_sublayer(cell, decoded, training=training)
        result = {"decoded": decoded}
        if return_latents:
            result["latents"] = latents
            if posterior:
                result["posterior_means"] = means
        if return_attention:
            result["generative_attention"] = generative_scores
            result["inference_attention"] = inference_scores
        if posterior:
            result["kl_per_layer"] = ops.stack(kls, axis=-1)
            if return_log_probs:
                result["log_prior"], result["log_posterior"] = log_p, log_q
        return result

    def _cells_of(self, cells, index):
        n = self.cells_per_layer
        return cells[index * n : (index + 1) * n]

    def data_distribution_params(self, decoded):
        """Bernoulli logits, or the `DiscretizedLogisticMixtureDistribution`."""
        return self.data_head(ops.elu(decoded))

    def _log_likelihood(self, data_params, x):
        if self.likelihood == "bernoulli":
            return bernoulli_log_prob(data_params, x, crop=self.crop)
        if not self.crop:
            return data_params.log_prob(x)
        # Per pixel, then the border dropped: `crop` pixels are not data here
        # either (`num_data_dims` leaves them out of bits/dim).
        c = self.crop
        return ops.sum(data_params.log_prob(x, reduce=False)[:, c:-c, c:-c], axis=(1, 2))

    def call(self, inputs, training=None):
        with batched_normalized_kernels(self._weight_norm_layers()):
            features = self.bottom_up(inputs, training=training)
            result = self.top_down(features, training=training)
            params = self.data_distribution_params(result["decoded"])
        nll = -self._log_likelihood(params, inputs)
        kl_per_layer = result["kl_per_layer"]
        return {"nll": nll, "kl": ops.sum(kl_per_layer, axis=-1), "kl_per_layer": kl_per_layer}

    def _weight_norm_layers(self):
        """The built `WeightNormConv2D` layers (0.1 ms to find: not worth a cache Keras would walk when saving)."""
        return [layer for layer in nested_layers(self) if isinstance(layer, WeightNormConv2D) and layer.built]

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`, refusing files of the layout before `PriorCell`s (see `weight_layout`)."""
        check_weight_layout(filepath)
        return super().load_weights(filepath, *args, **kwargs)

    # === Config ===
    def get_config(self):
        config = super().get_config()
        config.update({key: getattr(self, key) for key in CONFIG_KEYS})
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)
