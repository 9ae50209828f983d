"""The layers of a `HierarchicalVAE`, made in its constructor.

A mixin of `HierarchicalVAE`: `_build_layers` creates every sub-layer and
weight from the model's config and channel bookkeeping (`_values`,
`_context`, `_ik`, `_gk`). The attribute names and the order of creation
are those the shipped weight files were saved with: renaming or reordering
them changes the files' variable paths.
"""

import keras

from keras_avae.layers.depthwise_attend import DepthwiseAttend
from keras_avae.layers.discretized_logistic_mixture import DiscretizedLogisticMixture
from keras_avae.layers.layer_norm_gelu import LayerNormGelu
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.layers.residual_cell import ResidualCell
from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D


class HierarchicalLayers:
    """Layer construction of `HierarchicalVAE` (see the module docstring).

    Example:

    >>> from keras_avae.models import HierarchicalVAE
    >>> issubclass(HierarchicalVAE, HierarchicalLayers)
    True
    """

    def _nl_key(self, place):
        return self.nonlocal_key_dim if place in self.nonlocal_blocks else None

    def _cell(self, scale, place, name):
        return ResidualCell(
            scale,
            nonlocal_key_dim=self._nl_key(place),
            nonlocal_attention=self.nonlocal_attention,
            nonlocal_num_random_features=self.nonlocal_num_random_features,
            bn_momentum=self.bn_momentum,
            bn_epsilon=self.bn_epsilon,
            synchronized_batch_norm=self.synchronized_batch_norm,
            kernel_regularizer=self._regularizer,
            seed=self.nonlocal_feature_seed,
            dtype=self.dtype_policy,
            name=name,
        )

    def _conv(self, filters, kernel_size, name, use_bias=True):
        return WeightNormConv2D(
            filters,
            kernel_size,
            use_bias=use_bias,
            kernel_regularizer=self._regularizer,
            bias_regularizer=self._regularizer,
            dtype=self.dtype_policy,
            name=name,
        )

    def _merge_nonlocal(self, name):
        if "merge" not in self.nonlocal_blocks:
            return None
        return NonLocalBlock(
            key_dim=self.nonlocal_key_dim,
            attention=self.nonlocal_attention,
            num_random_features=self.nonlocal_num_random_features,
            kernel_regularizer=self._regularizer,
            seed=self.nonlocal_feature_seed,
            dtype=self.dtype_policy,
            name=name,
        )

    def _gate(self, name):
        return self.add_weight(name=name, shape=(), initializer="zeros", regularizer=self._regularizer)

    def _attend(self, layer_norm, name, learnable_scale=True):
        # Contexts are normalised once when they are made, so the attend
        # layer only normalises its output (eq. 6).
        return DepthwiseAttend(
            learnable_scale=learnable_scale,
            normalize_values=False,
            normalize_output=layer_norm,
            dtype=self.dtype_policy,
            name=name,
        )

    def _build_layers(self):
        L, z = self.num_layers, self.latent_channels
        E, P, ik, gk = self._values, self._context, self._ik, self._gk
        gq = self.generative_attention_dim if (self.generative_attention and L > 1) else 0

        # Pre-processing: stem, then per scale `preprocess_cells` cells and a
        # down-sampling cell. The stem carries ik / 2**num_scales extra
        # channels that become the posterior keys.
        self.stem = self._conv(self.preprocess_filters + ik // 2**self.num_scales, 3, "stem")
        self.preprocess = []
        for s in range(self.num_scales):
            for c in range(self.preprocess_cells):
                self.preprocess.append(self._cell("same", "preprocess", f"preprocess_{s}_{c}"))
            self.preprocess.append(self._cell("down", "preprocess", f"preprocess_{s}_down"))

        # Bottom-up: one encoder cell per stochastic layer.
        # (Flat lists: `.keras` saving walks one level of containers.)
        self.encoder_cells = [
            self._cell("same", "encoder", f"encoder_{j}_{c}") for j in range(L) for c in range(self.cells_per_layer)
        ]

        # Top-down layer 0: a learned constant and a 2-conv posterior head.
        top_channels = P + gk
        self.top_constant = self.add_weight(
            name="top_constant",
            shape=(1, *self._latent_size, top_channels),
            initializer=keras.initializers.VarianceScaling(0.33, "fan_in", "uniform"),
            regularizer=self._regularizer,
        )
        self.top_posterior = [self._conv(E + ik, 1, "top_posterior_0"), self._conv(2 * z, 3, "top_posterior_1")]

        # Layers 1..L-1.
        self.merge_decoder, self.merge_decoder_nonlocal, self.decoder_cells = [None], [None], []
        self.prior_heads, self.merge_encoder_h, self.merge_encoder_p = [None], [None], [None]
        self.merge_encoder_nonlocal, self.posterior_heads = [None], [None]
        self.context_norms, self.generative_attends, self.generative_gates = [None], [None], [None]
        for i in range(1, L):
            last = i == L - 1
            width = P + gq + (0 if last else gk)
            self.merge_decoder.append(self._conv(width, 1, f"merge_decoder_{i}"))
            self.merge_decoder_nonlocal.append(self._merge_nonlocal(f"merge_decoder_nonlocal_{i}"))
            self.decoder_cells.extend(
                self._cell("same", "decoder", f"decoder_{i}_{c}") for c in range(self.cells_per_layer)
            )
            self.prior_heads.append(self._conv(2 * z, 1, f"prior_{i}"))
            merged = E + ik
            self.merge_encoder_h.append(self._conv(merged, 1, f"merge_encoder_h_{i}") if ik else None)
            self.merge_encoder_p.append(self._conv(merged, 1, f"merge_encoder_p_{i}"))
            self.merge_encoder_nonlocal.append(self._merge_nonlocal(f"merge_encoder_nonlocal_{i}"))
            self.posterior_heads.append(self._conv(2 * z, 3, f"posterior_{i}"))
            if gk or gq:
                norm = self.generative_attention_layer_norm
                self.context_norms.append(
                    LayerNormGelu(regularizer=self._regularizer, dtype=self.dtype_policy, name=f"context_norm_{i}")
                    if norm
                    else None
                )
                # Layer 1 attends over the top constant alone: its logit
                # scale cannot matter, so it is not a weight.
                self.generative_attends.append(self._attend(norm, f"generative_attend_{i}", learnable_scale=i > 1))
                self.generative_gates.append(self._gate(f"generative_gate_{i}"))
            else:
                self.context_norms.append(None)
                self.generative_attends.append(None)
                self.generative_gates.append(None)

        # Inference attention, every layer including the top one.
        self.inference_attends, self.inference_norms, self.inference_gates = [], [], []
        if ik:
            for i in range(L):
                norm = self.inference_attention_layer_norm
                self.inference_attends.append(self._attend(norm, f"inference_attend_{i}"))
                self.inference_norms.append(
                    LayerNormGelu(regularizer=self._regularizer, dtype=self.dtype_policy, name=f"inference_norm_{i}")
                    if norm
                    else None
                )
                self.inference_gates.append(self._gate(f"inference_gate_{i}"))

        # Output: merge the last context with z, post-process, data head.
        self.merge_output = self._conv(P, 1, "merge_output")
        self.merge_output_nonlocal = self._merge_nonlocal("merge_output_nonlocal")
        self.postprocess = []
        for s in range(self.num_scales):
            self.postprocess.append(self._cell("up", "postprocess", f"postprocess_{s}_up"))
            for c in range(self.postprocess_cells):
                self.postprocess.append(self._cell("same", "postprocess", f"postprocess_{s}_{c}"))
        channels = self.image_shape[-1]
        if self.likelihood == "bernoulli":
            self.data_head = self._conv(channels, 3, "data_head")
        else:
            self.data_head = DiscretizedLogisticMixture(
                num_mixtures=self.num_mixtures,
                num_channels=channels,
                kernel_size=3,
                reference_edge_bug=self.reference_edge_bug,
                kernel_regularizer=self._regularizer,
                bias_regularizer=self._regularizer,
                dtype=self.dtype_policy,
                name="data_head",
            )
