"""The layers of a `HierarchicalVAE`, made in its constructor.

A mixin of `HierarchicalVAE`: `_build_layers` creates every sub-layer and
weight from the model's config and channel bookkeeping (`_values`,
`_context`, `_ik`, `_gk`); each stochastic layer's prior and posterior are
one `PriorCell` and one `PosteriorCell` (`stochastic_cells.py`). Renaming
an attribute or reordering the construction changes the weight files'
paths: files written before the cells existed are refused by
`keras_avae.models.weight_layout` and converted by
`tools/convert_weights_layout.py`.
"""

import keras

from keras_avae.layers.depthwise_attend import DepthwiseAttend
from keras_avae.layers.discretized_logistic_mixture import DiscretizedLogisticMixture
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.layers.residual_cell import ResidualCell
from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D
from keras_avae.models.stochastic_cells import PosteriorCell
from keras_avae.models.stochastic_cells import PriorCell


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
            bias_regularizer=self._regularizer,
            gamma_regularizer=self._regularizer,
            seed=self.nonlocal_feature_seed,
            dtype=self.dtype_policy,
            name=name,
        )

    def _attend(self, layer_norm, name, learnable_scale=True):
        # Contexts are normalised once when they are made, so the attend
        # layer only normalises its output (eq. 6).
        return DepthwiseAttend(
            learnable_scale=learnable_scale,
            normalize_values=False,
            normalize_output=layer_norm,
            regularizer=self._regularizer,
            dtype=self.dtype_policy,
            name=name,
        )

    def _build_layers(self):
        L = self.num_layers
        P, ik, gk = self._context, self._ik, self._gk

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

        # One prior cell per layer 1..L-1 (eq. 7-9), one posterior cell per
        # layer 0..L-1 (eq. 10-11).
        self.prior_cells = [PriorCell(i, self) for i in range(1, L)]
        self.posterior_cells = [PosteriorCell(i, self) for i in range(L)]

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
