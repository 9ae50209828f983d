"""One layer per stochastic layer of `HierarchicalVAE`: its prior and its posterior.

`PriorCell` holds eq. 7-9 of the paper (the prior of top-down layer
i >= 1), `PosteriorCell` eq. 10-11 (the posterior of layer i >= 0). Each
returns what it computed; the model keeps the list of contexts the
generative attention reads. Both are parts of a `HierarchicalVAE`, built
from its config: save and load the model, not a cell on its own.
"""

import keras
from keras import ops

from keras_avae.distributions.gaussian import DiagonalGaussian
from keras_avae.keras_compat import call_sublayer
from keras_avae.layers.layer_norm_gelu import LayerNormGelu
from keras_avae.ops.channels import split_channels


class _StochasticCell(keras.layers.Layer):
    """What both cells share: raw Gaussian parameters, log-scale noise, no standalone config."""

    def __init__(self, builder, name, **kwargs):
        # `autocast=False`: the float32 prior parameters a posterior cell
        # receives must stay float32 under mixed precision.
        super().__init__(dtype=builder.dtype_policy, name=name, autocast=False, **kwargs)
        self.latent_channels = builder.latent_channels
        self.log_scale_noise = builder.log_scale_noise

    def build(self, *args, **kwargs):
        # The sub-layers build themselves on their first call.
        self.built = True

    def _split(self, params):
        return split_channels(ops.cast(params, "float32"), [self.latent_channels] * 2)

    def _noisy(self, raw_log_scale, training, seed_generator):
        if training and self.log_scale_noise > 0:
            raw_log_scale = raw_log_scale + self.log_scale_noise * keras.random.normal(
                ops.shape(raw_log_scale), dtype=raw_log_scale.dtype, seed=seed_generator
            )
        return raw_log_scale

    def get_config(self):
        raise NotImplementedError(
            f"{self.__class__.__name__} is built by HierarchicalVAE from the model's config; "
            "serialise the model instead."
        )


class PriorCell(_StochasticCell):
    """The prior `p(z_i | z_<i)` of top-down layer i >= 1 (paper eq. 7-9).

    The previous context and `z_{i-1}` are merged (a 1x1 convolution, a
    non-local block where `"merge"` is configured, `cells_per_layer`
    residual cells). The result splits into this layer's context (`P`
    channels), its key for the layers below and its query. With generative
    attention the query attends depth-wise over every earlier context
    (eq. 7-8) and a zero-initialised gate adds the result (eq. 9); a 1x1 head
    maps the condition to the prior's parameters.

    Args:
        index: the layer, 1 to `num_layers - 1`.
        builder: the `HierarchicalVAE` under construction; its config and
            layer factories make the sub-layers. Not kept.

    Call arguments:
        context_values: the contexts of the layers above, top first.
        context_keys: their keys.
        z: the sample of the layer above, in the compute dtype.
        training: bool.
        seed_generator: the model's, for log-scale noise in training.

    Returns:
        A dict: `"context"` (this layer's context, appended by the caller
        for the layers below), `"key"` (its attention key, or `None`),
        `"condition"` (eq. 9), `"query"` (the inference attention's query),
        `"raw"` (the prior's raw `(loc, log_scale)`, float32), `"prior"` (the
        `DiagonalGaussian`) and `"scores"` (the attention weights, or `None`).

    Example:

    >>> from keras_avae import zoo
    >>> model = zoo.load("mnist-attentive-small", weights=None)
    >>> cell = model.prior_cells[0]
    >>> cell.index, cell.attend is not None
    (1, True)
    """

    def __init__(self, index, builder, **kwargs):
        super().__init__(builder, name=f"prior_cell_{index}", **kwargs)
        L, z = builder.num_layers, builder.latent_channels
        gk = builder._gk
        gq = builder.generative_attention_dim if (builder.generative_attention and L > 1) else 0
        self.index = index
        self.context_channels = builder._context
        self.query_channels = builder._ik
        self.key_channels = 0 if index == L - 1 else gk
        self.log_scale_bounds = builder.prior_log_scale_bounds
        width = self.context_channels + gq + self.key_channels
        self.merge = builder._conv(width, 1, f"merge_decoder_{index}")
        self.merge_nonlocal = builder._merge_nonlocal(f"merge_decoder_nonlocal_{index}")
        self.cells = [
            builder._cell("same", "decoder", f"decoder_{index}_{c}") for c in range(builder.cells_per_layer)
        ]
        self.head = builder._conv(2 * z, 1, f"prior_{index}")
        self.context_norm = self.attend = self.gate = None
        if gk or gq:
            norm = builder.generative_attention_layer_norm
            if norm:
                self.context_norm = LayerNormGelu(
                    regularizer=builder._regularizer, dtype=builder.dtype_policy, name=f"context_norm_{index}"
                )
            # Layer 1 attends over the top constant alone: its logit scale
            # cannot matter, so it is not a weight.
            self.attend = builder._attend(norm, f"generative_attend_{index}", learnable_scale=index > 1)
            self.gate = self.add_weight(
                name=f"generative_gate_{index}", shape=(), initializer="zeros", regularizer=builder._regularizer
            )

    def call(self, context_values, context_keys, z, training=None, seed_generator=None):
        P, key_channels = self.context_channels, self.key_channels
        x = call_sublayer(self.merge, ops.concatenate([context_values[-1], z], axis=-1))
        if self.merge_nonlocal is not None:
            x = call_sublayer(self.merge_nonlocal, x, training=training)
        for cell in self.cells:
            x = call_sublayer(cell, x, training=training)
        # Splits, not slices: see `split_channels`.
        context, key, attention_query = split_channels(x, [P, key_channels, x.shape[-1] - P - key_channels])
        query, _ = split_channels(context, [self.query_channels, P - self.query_channels])
        key = key if key_channels else None
        scores = None
        if self.attend is not None:
            if self.context_norm is not None:
                context = call_sublayer(self.context_norm, context)
            attended, scores = call_sublayer(
                self.attend, attention_query, list(context_keys), list(context_values), return_attention_scores=True
            )
            condition = context + ops.cast(self.gate, self.compute_dtype) * attended
        else:
            condition = context
        raw_loc, raw_log_scale = self._split(call_sublayer(self.head, ops.elu(condition)))
        raw_log_scale = self._noisy(raw_log_scale, training, seed_generator)
        return {
            "context": context,
            "key": key,
            "condition": condition,
            "query": query,
            "raw": (raw_loc, raw_log_scale),
            "prior": DiagonalGaussian.from_raw(raw_loc, raw_log_scale, self.log_scale_bounds),
            "scores": scores,
        }


class PosteriorCell(_StochasticCell):
    """The posterior `q(z_i | x, z_<i)` of layer i >= 0 (paper eq. 10-11).

    Layer 0 maps the bottom-up feature `h_0` (after inference attention)
    through two convolutions to the Gaussian's parameters. A layer i >= 1
    merges the prior condition with `h_i`, attends over `h_i, ..., h_L` with
    the prior's query (eq. 10-11, through a zero-initialised gate) and
    predicts a residual correction of the prior's raw parameters, as NVAE
    does.

    Args:
        index: the layer, 0 to `num_layers - 1`.
        builder: the `HierarchicalVAE` under construction. Not kept.

    Call arguments:
        condition: the prior condition (layer 0: the top constant's context).
        query: the inference attention's query.
        prior_raw: the prior's raw `(loc, log_scale)` (layer 0: `None`).
        features: the bottom-up features `[h_0, ..., h_L]` as
            `split_features` returns them: `(value, key)` pairs.
        training: bool.
        seed_generator: the model's, for log-scale noise in training.

    Returns:
        `(posterior, scores)`: a `DiagonalGaussian` and the attention weights
        (`None` without inference attention).

    Example:

    >>> from keras_avae import zoo
    >>> model = zoo.load("mnist-attentive-small", weights=None)
    >>> [cell.index for cell in model.posterior_cells]
    [0, 1, 2, 3]
    """

    def __init__(self, index, builder, **kwargs):
        super().__init__(builder, name=f"posterior_cell_{index}", **kwargs)
        z, E, ik = builder.latent_channels, builder._values, builder._ik
        self.index = index
        self.value_channels = E
        self.key_channels = ik
        self.log_scale_bounds = builder.posterior_log_scale_bounds
        if index == 0:
            self.top = [builder._conv(E + ik, 1, "top_posterior_0"), builder._conv(2 * z, 3, "top_posterior_1")]
        else:
            self.merge_h = builder._conv(E + ik, 1, f"merge_encoder_h_{index}") if ik else None
            self.merge_condition = builder._conv(E + ik, 1, f"merge_encoder_p_{index}")
            self.merge_nonlocal = builder._merge_nonlocal(f"merge_encoder_nonlocal_{index}")
            self.head = builder._conv(2 * z, 3, f"posterior_{index}")
        self.attend = self.norm = self.gate = None
        if ik:
            norm = builder.inference_attention_layer_norm
            self.attend = builder._attend(norm, f"inference_attend_{index}")
            if norm:
                self.norm = LayerNormGelu(
                    regularizer=builder._regularizer, dtype=builder.dtype_policy, name=f"inference_norm_{index}"
                )
            self.gate = self.add_weight(
                name=f"inference_gate_{index}", shape=(), initializer="zeros", regularizer=builder._regularizer
            )

    def split_features(self, features):
        """The bottom-up features as `(value, key)` pairs: each split once per pass, for every layer's cell.

        Without inference attention a feature is not split: `(feature, None)`.
        """
        if not self.key_channels:
            return [(f, None) for f in features]
        return [tuple(split_channels(f, [self.value_channels, self.key_channels])) for f in features]

    def _attended(self, condition, key, query, deeper_features):
        """Eq. 10-11: the condition attends over its own and the deeper features.

        `key` is `None` without inference attention; `condition` is then
        the whole feature and passes unchanged.
        """
        if self.attend is None:
            return condition, None
        values = [condition] + [value for value, _ in deeper_features]
        keys = [key] + [f_key for _, f_key in deeper_features]
        attended, scores = call_sublayer(self.attend, query, keys, values, return_attention_scores=True)
        if self.norm is not None:
            condition = call_sublayer(self.norm, condition)
        gate = ops.cast(self.gate, self.compute_dtype)
        return ops.concatenate([condition + gate * attended, key], axis=-1), scores

    def call(self, condition, query, prior_raw, features, training=None, seed_generator=None):
        i = self.index
        (h_value, h_key), deeper = features[i], features[i + 1 :]
        if i == 0:
            x, scores = self._attended(h_value, h_key, query, deeper)
            x = call_sublayer(self.top[0], ops.elu(x))
            raw_loc, raw_log_scale = self._split(call_sublayer(self.top[1], ops.elu(x)))
        else:
            merged = call_sublayer(self.merge_condition, condition)
            merged = merged + (call_sublayer(self.merge_h, h_value) if self.merge_h is not None else h_value)
            if self.merge_nonlocal is not None:
                merged = call_sublayer(self.merge_nonlocal, merged, training=training)
            merged_value, merged_key = self.split_features([merged])[0]
            x, scores = self._attended(merged_value, merged_key, query, deeper)
            delta_loc, delta_log_scale = self._split(call_sublayer(self.head, x))
            prior_loc, prior_log_scale = prior_raw
            raw_loc, raw_log_scale = prior_loc + delta_loc, prior_log_scale + delta_log_scale
        raw_log_scale = self._noisy(raw_log_scale, training, seed_generator)
        return DiagonalGaussian.from_raw(raw_loc, raw_log_scale, self.log_scale_bounds), scores
