"""Performer (FAVOR+) multi-head attention, a drop-in for MultiHeadAttention."""

import random

import keras
from keras import ops

from keras_avae._validation import check_layer_seed
from keras_avae._validation import is_finite_real
from keras_avae._validation import is_int
from keras_avae._validation import is_integer
from keras_avae.layers.attention_layout import SequenceLayout
from keras_avae.layers.attention_layout import fill_rows_without_keys
from keras_avae.ops.favor import check_favor_eps
from keras_avae.ops.favor import favor_attention
from keras_avae.ops.favor import orthogonal_random_features

_KERNELS = ("softmax", "relu")
_FEATURE_REDRAWS = ("fixed", "training")
_SCALINGS = ("chi", "sqrt")


@keras.saving.register_keras_serializable(package="keras_avae")
class PerformerAttention(keras.layers.MultiHeadAttention):
    """Multi-head attention in linear time with FAVOR+ random features.

    Implements the Performer's FAVOR+ mechanism (Choromanski et al.,
    "Rethinking Attention with Performers", ICLR 2021,
    https://arxiv.org/abs/2009.14794): `softmax(Q K^T / sqrt(key_dim)) V` is
    approximated by `D^-1 (phi(Q) (phi(K)^T V))` with positive orthogonal
    random features `phi` (see `keras_avae.ops.favor_attention`), so time and
    memory grow linearly with the sequence length instead of quadratically.
    The estimate of each attention weight is unbiased up to the normalisation,
    and its error falls as `num_random_features ** -0.5`.

    The layer subclasses `keras.layers.MultiHeadAttention` and has exactly its
    weights, in the same order, so a trained `MultiHeadAttention` is swapped
    for a `PerformerAttention` with the same constructor arguments by
    `performer.set_weights(mha.get_weights())`. The random features are not
    weights: they are drawn from the integer `seed` (resolved at construction
    when `None` and kept in the config), so a `.keras` round trip gives the
    same features and the same outputs.

    What differs from `MultiHeadAttention`, all because FAVOR+ never forms
    the `(T, S)` attention matrix:

    - Masks: everything that does not depend on the query position is
      applied exactly as `MultiHeadAttention` applies it: key padding
      (`value_mask`, `key_mask`, Keras-propagated masks, or an
      `attention_mask` in `MultiHeadAttention`'s layout with size-1 query
      axes, such as `(B, 1, S)` or `(1, S)`), query masks and
      `use_causal_mask=True`. A masked query, or one without any valid key,
      gets what `MultiHeadAttention` gives it: the mean of all values
      (uniform weights) on one attention axis of a 3-D input, zeros when
      `dropout > 0` or with several attention axes. An
      `attention_mask` that depends on the query position (a dense `(T, S)`
      or `(B, T, S)` mask, a 2-D `(B, S)` mask with `B > 1`, which
      `MultiHeadAttention` reads as `(T, S)`) or on the head raises a
      `ValueError` naming its shape.
    - `return_attention_scores=True`, `sliding_window` and
      `flash_attention=True` raise a `ValueError`.
    - `dropout` cannot drop single attention probabilities. It drops whole
      key/value positions (independently per batch element and head) from the
      weighted sum while keeping the normaliser, scaling the kept ones by
      `1 / (1 - dropout)`: this is `MultiHeadAttention`'s attention dropout
      with one mask shared by all queries. It has the same expectation.

    `attention_axes` works as in `MultiHeadAttention`, e.g. `(1, 2)` for
    images `(B, H, W, C)`: the attention axes are flattened into one
    sequence (row-major; causal masking follows that order) and the other
    axes join the batch, so the cost stays linear in the number of positions.

    Subclasses can override `_compute_favor_attention`, which receives the
    projected and flattened query, key and value with the key mask and the
    causal flag (the counterpart of `MultiHeadAttention._compute_attention`).

    Args:
        num_heads: positive int, number of attention heads.
        key_dim: positive int, size of each head for query and key.
        value_dim: positive int or `None` (= `key_dim`), size of each head
            for value.
        dropout: float in `[0, 1)`, the rate of the key/value dropout
            described above.
        use_bias: bool, whether the projections have biases.
        output_shape: output size besides batch and sequence; `None` projects
            back to the query's last dimension.
        attention_axes: int or tuple of the axes attention runs over; `None`
            means every axis but the batch and the last, as in
            `MultiHeadAttention`.
        sliding_window: must be `None`; accepted so that a
            `MultiHeadAttention` config can be passed as is.
        flash_attention: must be `None` or `False` (likewise).
        kernel_initializer: initializer of the projection kernels.
        bias_initializer: initializer of the projection biases.
        kernel_regularizer: regularizer of the projection kernels.
        bias_regularizer: regularizer of the projection biases.
        activity_regularizer: regularizer of the output.
        kernel_constraint: constraint of the projection kernels.
        bias_constraint: constraint of the projection biases.
        use_gate: bool, the sigmoid output gate of `MultiHeadAttention`.
        seed: int in `[0, 2**31 - 2]` (`seed + 1` seeds the feature
            redraws and must fit an int32) or `None`. Seeds the fixed random
            features, their redraws and dropout. `None` draws an integer at
            construction (from Python's `random`, which
            `keras.utils.set_random_seed` seeds).
        num_random_features: positive int m, random features per head.
            Defaults to 256.
        kernel: `"softmax"` (unbiased positive features for the softmax
            kernel) or `"relu"` (the Performer's generalised ReLU kernel: a
            different attention, not an approximation of softmax). Defaults
            to `"softmax"`.
        feature_redraw: `"fixed"`: one draw from `seed`, used for every call;
            `"training"`: a fresh draw for every training call (the seed
            generator advances), the fixed draw at inference. Defaults to
            `"fixed"`.
        orthogonal_scaling: `"chi"` (rows with chi-distributed norms, which
            keeps the softmax estimate unbiased) or `"sqrt"` (rows of norm
            `sqrt(key_dim)`). Defaults to `"chi"`.
        eps: float in [0, 1] added to every feature (relative to the
            largest one) to keep the normaliser away from zero. Defaults to
            `1e-6`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: query tensor of shape `(B, T, dim)` (or `(B, ..., dim)` with
            several axes, see `attention_axes`).
        value: value tensor of shape `(B, S, dim)` (likewise).
        key: optional key tensor shaped like `value` but for its last axis;
            defaults to `value`.
        query_mask: optional `(B, T)` mask of valid queries (by default the
            query's Keras mask); see above for what masked queries get.
            As in `MultiHeadAttention`, the output carries the query's Keras
            mask, not an explicit `query_mask`.
        value_mask: optional `(B, S)` boolean mask of valid keys.
        key_mask: optional `(B, S)` boolean mask of valid keys.
        attention_mask: optional boolean mask in `MultiHeadAttention`'s
            layout whose query axes have size 1, e.g. `(B, 1, S)`; see above.
        return_attention_scores: must be `False`.
        training: bool, training mode (dropout and feature redraw).
        use_causal_mask: bool; query `t` attends only to keys `s <= t`
            (needs `T == S`). Computed with chunked prefix sums, still in
            linear time.

    Returns:
        The attention output, shaped like the query but for its last axis,
        which is the query's last dimension or `output_shape`, in the
        layer's compute dtype.

    Example:

    >>> import numpy as np
    >>> x = np.random.normal(size=(2, 16, 8)).astype("float32")
    >>> layer = PerformerAttention(num_heads=2, key_dim=4, seed=0)
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (2, 16, 8)

    Attention over both axes of images, in linear time in H x W:

    >>> images = np.random.normal(size=(2, 4, 4, 8)).astype("float32")
    >>> layer = PerformerAttention(num_heads=2, key_dim=4, attention_axes=(1, 2), seed=0)
    >>> tuple(layer(images, images).shape)
    (2, 4, 4, 8)

    Swapping in FAVOR+ for a (trained) `MultiHeadAttention`, with its
    constructor arguments and its weights:

    >>> mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> exact = mha(x, x)
    >>> performer = PerformerAttention.from_config(mha.get_config())
    >>> performer.build(x.shape, x.shape)
    >>> performer.set_weights(mha.get_weights())
    >>> approx = performer(x, x)  # error falls as num_random_features ** -0.5
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        attention_axes=None,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        num_random_features=256,
        kernel="softmax",
        feature_redraw="fixed",
        orthogonal_scaling="chi",
        eps=1e-6,
        **kwargs,
    ):
        # NumPy numbers are taken as Python ones (the config must serialise).
        num_random_features = int(num_random_features) if is_integer(num_random_features) else num_random_features
        eps = float(eps) if is_finite_real(eps) else eps
        dropout = float(dropout) if is_finite_real(dropout) else dropout
        if not is_int(num_random_features) or num_random_features <= 0:
            raise ValueError(
                "`num_random_features` must be a positive integer. "
                f"Received: num_random_features={num_random_features!r}"
            )
        if kernel not in _KERNELS:
            raise ValueError(f"`kernel` must be one of {_KERNELS}. Received: kernel={kernel!r}")
        if feature_redraw not in _FEATURE_REDRAWS:
            raise ValueError(
                f"`feature_redraw` must be one of {_FEATURE_REDRAWS}. Received: feature_redraw={feature_redraw!r}"
            )
        if orthogonal_scaling not in _SCALINGS:
            raise ValueError(
                f"`orthogonal_scaling` must be one of {_SCALINGS}. Received: orthogonal_scaling={orthogonal_scaling!r}"
            )
        check_favor_eps(eps)
        if not _is_number(dropout) or not 0 <= dropout < 1:
            raise ValueError(f"`dropout` must be a float in [0, 1). Received: dropout={dropout!r}")
        if sliding_window is not None:
            raise ValueError(
                "PerformerAttention does not support `sliding_window`: FAVOR+ cannot apply a banded "
                f"mask in linear time. Received: sliding_window={sliding_window}"
            )
        if flash_attention:
            raise ValueError(
                "PerformerAttention computes FAVOR+ attention, not MultiHeadAttention's exact fused kernel: "
                f"`flash_attention` must be None or False. Received: flash_attention={flash_attention}"
            )
        seed = check_layer_seed(seed)
        if seed is None:
            # A concrete seed in the config makes the features reproducible
            # after a `.keras` round trip; same range as Keras' default seeds.
            seed = random.randint(1, int(1e9))
        super().__init__(
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            # Set below: MultiHeadAttention refuses dropout whenever flash
            # attention is enabled globally, which does not concern FAVOR+.
            dropout=0.0,
            use_bias=use_bias,
            output_shape=output_shape,
            attention_axes=attention_axes,
            sliding_window=None,
            flash_attention=False,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            use_gate=use_gate,
            seed=seed,
            **kwargs,
        )
        self._dropout = dropout
        self._flash_attention = False
        self.num_random_features = num_random_features
        self.kernel = kernel
        self.feature_redraw = feature_redraw
        self.orthogonal_scaling = orthogonal_scaling
        self.eps = eps
        # Only what is random at call time has a seed generator (and its
        # state variable): feature redraws here, dropout in MultiHeadAttention's
        # dropout layer. `seed + 1` keeps the two streams apart.
        self.features_seed_generator = None
        if feature_redraw == "training":
            self.features_seed_generator = keras.random.SeedGenerator(seed + 1)

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        rank = len(query_shape)
        axes = self._attention_axes  # made non-negative by `_build_attention`
        if len(set(axes)) != len(axes) or not all(1 <= axis <= rank - 2 for axis in axes):
            raise ValueError(
                f"`attention_axes` must be distinct axes of the query between 1 and {rank - 2} (batch and "
                f"feature axes excluded). Received: attention_axes={self._attention_axes}, "
                f"query_shape={tuple(query_shape)}"
            )

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        self._check_call_arguments(query, attention_mask, return_attention_scores)
        if key is None:
            key = value
        query, key, value = (_without_keras_mask(t) for t in (query, key, value))
        if self._use_gate:
            gate = self._gate_dense(query)
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)

        # Attention runs over one flattened sequence axis; the other axes
        # join the batch. Masks follow the same layout.
        layout = self._layout(len(query.shape))
        query_shape, key_shape = ops.shape(query), ops.shape(key)
        query, key, value = (layout.to_sequences(t) for t in (query, key, value))
        key_padding = None
        masks = [layout.mask_to_sequences(ops.cast(m, "bool")) for m in (value_mask, key_mask) if m is not None]
        masks.append(layout.key_padding(attention_mask, key_shape))
        for mask in masks:
            if mask is not None:
                key_padding = mask if key_padding is None else ops.logical_and(key_padding, mask)
        if query_mask is not None:
            query_mask = layout.mask_to_sequences(ops.cast(query_mask, "bool"))

        output = self._compute_favor_attention(
            query, key, value, key_mask=key_padding, use_causal_mask=use_causal_mask, training=training
        )
        # MultiHeadAttention's fused path (no dropout, one attention axis of
        # a rank-3 input) gives uniform weights where its explicit softmax
        # gives zeros; follow the one it takes.
        fused = self._dropout == 0 and len(query_shape) == 4
        output = fill_rows_without_keys(output, value, query_mask, key_padding, use_causal_mask, uniform=fused)
        output = layout.from_sequences(output, query_shape)
        if self._use_gate:
            output = output * gate
        return self._output_dense(output)

    def _compute_favor_attention(self, query, key, value, key_mask=None, use_causal_mask=False, training=None):
        """FAVOR+ attention of projected sequences; the step a subclass may override.

        The counterpart of `MultiHeadAttention._compute_attention` (which
        this layer does not call): `call` projects the inputs, flattens the
        attention axes into one sequence axis (the other axes join the
        batch), gathers the key masks into `key_mask`, calls this method,
        then gives masked queries and queries without a valid key what
        `MultiHeadAttention` gives them (see the class docstring), and
        applies the gate and the output projection.

        Args:
            query: `(B, T, num_heads, key_dim)` projected queries.
            key: `(B, S, num_heads, key_dim)` projected keys.
            value: `(B, S, num_heads, value_dim)` projected values.
            key_mask: `None` or a `(B, S)` boolean tensor, `True` for valid
                keys.
            use_causal_mask: bool; query `t` attends only to keys `s <= t`.
            training: bool, training mode (dropout and feature redraw).

        Returns:
            `(B, T, num_heads, value_dim)` attention output.
        """
        if training and self.features_seed_generator is not None:
            features_seed = self.features_seed_generator
        else:
            features_seed = self.seed
        features = orthogonal_random_features(
            self.num_random_features, self._key_dim, seed=features_seed, scaling=self.orthogonal_scaling
        )
        if training and self._dropout > 0:
            # Dropping value rows = dropping those keys' terms from every
            # query's weighted sum, with the normaliser left intact.
            value = keras.random.dropout(
                value, self._dropout, noise_shape=(None, None, None, 1), seed=self._dropout_layer.seed_generator
            )
        return favor_attention(
            query, key, value, features, kernel=self.kernel, causal=bool(use_causal_mask), key_mask=key_mask, eps=self.eps
        )

    def _check_call_arguments(self, query, attention_mask, return_attention_scores):
        if return_attention_scores:
            raise ValueError(
                "PerformerAttention cannot return attention scores: FAVOR+ never forms the attention "
                "matrix. Received: return_attention_scores=True"
            )
        if attention_mask is not None:
            self._layout(len(query.shape) + 1).key_padding(attention_mask)

    def _layout(self, projected_rank):
        axes = self._attention_axes
        if axes is None:  # not built yet: MultiHeadAttention's default
            axes = tuple(range(1, projected_rank - 2))
        return SequenceLayout(projected_rank, axes)

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        if type(self).call is not PerformerAttention.call:
            # A subclass's own `call` may return something else: trace it
            # (MultiHeadAttention's spec is always shaped like the query).
            # Only the arguments the caller gave: its `call` may take fewer.
            optional = {
                "key": key,
                "query_mask": query_mask,
                "value_mask": value_mask,
                "key_mask": key_mask,
                "attention_mask": attention_mask,
                "return_attention_scores": return_attention_scores or None,
                "training": training,
                "use_causal_mask": use_causal_mask or None,
            }
            kwargs = {name: arg for name, arg in optional.items() if arg is not None}
            return keras.Operation.compute_output_spec(self, query, value, **kwargs)
        self._check_call_arguments(query, attention_mask, return_attention_scores)
        return super().compute_output_spec(query, value, key)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_random_features": self.num_random_features,
                "kernel": self.kernel,
                "feature_redraw": self.feature_redraw,
                "orthogonal_scaling": self.orthogonal_scaling,
                "eps": self.eps,
            }
        )
        return config


def _without_keras_mask(x):
    """`x`, or a copy without its Keras mask when it carries one.

    The masks already arrived as `*_mask` arguments; a masked input would make
    the projections (which do not support masking) warn that they drop it.
    Unlike `MultiHeadAttention`, the caller's tensor keeps its mask.
    """
    if getattr(x, "_keras_mask", None) is None:
        return x
    return ops.copy(x)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)
