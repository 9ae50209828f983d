"""Depth-wise attention over the contexts of earlier layers (paper eq. 3-6)."""

import math

import keras
from keras import ops

from keras_avae._validation import check_bool
from keras_avae._validation import is_finite_real


@keras.saving.register_keras_serializable(package="keras_avae")
class DepthwiseAttend(keras.layers.Layer):
    """Per-pixel attention over a sequence of earlier contexts.

    Implements `Attend(c_<l, s_l, k_<l)` of "Deep Attentive Variational
    Inference" (Apostolopoulou et al., ICLR 2022), eq. 3-6. At every pixel
    `(i, j)` the query `s(i, j)` in R^Q scores each of the N contexts by its
    key, and the output is the convex combination of the contexts there:

    ```
    alpha_m(i, j) = softmax_m(scale * s(i, j) . k_m(i, j))          (eq. 4)
    c_hat(i, j)   = sum_m alpha_m(i, j) c_m(i, j)                   (eq. 3)
    ```

    Pixels never interact, so the cost is linear in H * W and in N. With
    `normalize_values` each context is first replaced by
    `c + GELU(LayerNorm(c))` (eq. 5, one LayerNorm shared by all contexts) and
    with `normalize_output` so is the result (eq. 6). GELU is the tanh
    approximation, as `tfa.activations.gelu` in the reference code.

    The reference implementation multiplies the logits by a learnable scale
    initialised to 1 and does not divide by sqrt(Q); that is the default.
    `initial_scale=None` starts from 1/sqrt(Q) instead, and
    `learnable_scale=False` keeps the scale fixed (`learnable_scale=False,
    initial_scale=1.0` is eq. 4 as printed).

    No weight depends on N, so one instance may attend over 2 contexts in one
    call and 5 in the next. Contexts may be given as Python lists: the layer
    then never stacks them into a new (B, N, H, W, C) tensor, it computes the
    N small logit maps, takes the softmax across them and accumulates the
    weighted contexts one at a time. A hierarchy of L layers that passes lists
    therefore holds no O(L^2) copies of its contexts, as long as it also
    normalises each context once itself and sets `normalize_values=False`
    (with `normalize_values=True` every call makes, and keeps for the
    backward pass, a normalised copy of each of its N contexts).

    Args:
        learnable_scale: bool. Whether the logit scale is a trainable scalar
            weight. Defaults to `True`.
        initial_scale: positive float or `None`. The (initial) logit scale;
            `None` means 1/sqrt(Q) with Q the query channels. Defaults to
            `1.0`.
        normalize_values: bool. Apply `c + GELU(LayerNorm(c))` to every
            context before attending (eq. 5). Defaults to `True`.
        normalize_output: bool. Apply `c + GELU(LayerNorm(c))` to the result
            (eq. 6). Defaults to `True`.
        epsilon: positive float, the LayerNorm epsilon. Defaults to `1e-5`
            (the reference's).
        regularizer: regularizer of the LayerNorms' gamma and beta and of
            the learnable logit scale.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: tensor of shape `(B, H, W, Q)`, the query `s` of each pixel.
        keys: tensor of shape `(B, N, H, W, Q)` or a list of N tensors of
            shape `(B, H, W, Q)`, one key per context.
        values: tensor of shape `(B, N, H, W, C)` or a list of N tensors of
            shape `(B, H, W, C)`, the contexts.
        return_attention_scores: bool. Also return the attention weights.
            Defaults to `False`.

    Returns:
        The attended context `c_hat`, shape `(B, H, W, C)`, and with
        `return_attention_scores=True` also the weights `alpha`, shape
        `(B, H, W, N)` (they sum to 1 over the last axis).

    Example:

    >>> import numpy as np
    >>> query = np.random.normal(size=(2, 4, 4, 3)).astype("float32")
    >>> keys = [np.random.normal(size=(2, 4, 4, 3)).astype("float32")
    ...         for _ in range(5)]
    >>> values = [np.random.normal(size=(2, 4, 4, 8)).astype("float32")
    ...           for _ in range(5)]
    >>> layer = DepthwiseAttend()
    >>> output, scores = layer(query, keys, values, return_attention_scores=True)
    >>> tuple(output.shape), tuple(scores.shape)
    ((2, 4, 4, 8), (2, 4, 4, 5))
    >>> tuple(layer(query, keys[:2], values[:2]).shape)  # fewer contexts
    (2, 4, 4, 8)
    """

    def __init__(
        self,
        learnable_scale=True,
        initial_scale=1.0,
        normalize_values=True,
        normalize_output=True,
        epsilon=1e-5,
        regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        for name, flag in (
            ("learnable_scale", learnable_scale),
            ("normalize_values", normalize_values),
            ("normalize_output", normalize_output),
        ):
            check_bool(flag, name)
        if initial_scale is not None and not _is_positive_number(initial_scale):
            raise ValueError(
                "`initial_scale` must be a positive number or `None` (for "
                f"1/sqrt(query channels)). Received: initial_scale={initial_scale!r}"
            )
        if not _is_positive_number(epsilon):
            raise ValueError(f"`epsilon` must be a positive number. Received: epsilon={epsilon!r}")
        self.learnable_scale = learnable_scale
        self.initial_scale = None if initial_scale is None else float(initial_scale)
        self.normalize_values = normalize_values
        self.normalize_output = normalize_output
        self.epsilon = float(epsilon)
        self.regularizer = keras.regularizers.get(regularizer)

        self.value_norm = None
        self.output_norm = None
        if normalize_values:
            self.value_norm = self._layer_norm("value_norm")
        if normalize_output:
            self.output_norm = self._layer_norm("output_norm")

    def _layer_norm(self, name):
        return keras.layers.LayerNormalization(
            epsilon=self.epsilon,
            gamma_regularizer=self.regularizer,
            beta_regularizer=self.regularizer,
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, query_shape, keys_shape=None, values_shape=None):
        # Keras passes no shape for an empty list of contexts: `None` below.
        _, query_channels, value_channels = _check_shapes(query_shape, keys_shape, values_shape)
        if query_channels is None:
            raise ValueError(
                f"The last axis of `query` must be known when the layer is built. Received: query_shape={query_shape}"
            )
        if value_channels is None:
            raise ValueError(
                "The last axis of `values` must be known when the layer is built. "
                f"Received: values_shape={values_shape}"
            )
        # Checked on every later call (an `InputSpec` sees only `query`).
        self._built_channels = (query_channels, value_channels)
        scale = self.initial_scale
        if scale is None:
            scale = 1.0 / math.sqrt(query_channels)
        if self.learnable_scale:
            # Read in float32 even under mixed precision: it multiplies the
            # float32 logits.
            self.scale = self.add_weight(
                name="scale",
                shape=(),
                initializer=keras.initializers.Constant(scale),
                regularizer=self.regularizer,
                autocast=False,
            )
        else:
            self.scale = scale
        context_shape = tuple(query_shape[:-1]) + (value_channels,)
        for norm in (self.value_norm, self.output_norm):
            if norm is not None:
                norm.build(context_shape)

    def _check_call_shapes(self, query_shape, keys_shape, values_shape):
        """The module's `_check_shapes`, and once built, the channels the layer was built for."""
        shapes = _check_shapes(query_shape, keys_shape, values_shape)
        if getattr(self, "_built_channels", None):
            for name, channels, built in zip(("query", "values"), shapes[1:], self._built_channels):
                if not _compatible(channels, built):
                    raise ValueError(
                        f"`{name}` must have {built} channels, as when the layer was built. "
                        f"Received: query_shape={tuple(query_shape)}, keys_shape={keys_shape} and "
                        f"values_shape={values_shape}"
                    )
        return shapes

    def call(self, query, keys, values, return_attention_scores=False):
        # Shapes are checked on every call: N, and list vs. stacked, may change.
        self._check_call_shapes(query.shape, _shapes(keys), _shapes(values))

        # Logits (B, H, W, N) in float32. The products stay in the compute
        # dtype (but float16, see `_dot`) so that only the original query and
        # keys are kept for the backward pass, not float32 copies of them.
        if isinstance(keys, (list, tuple)):
            logits = ops.stack([_dot(query, key) for key in keys], axis=-1)
        else:
            logits = ops.moveaxis(_dot(ops.expand_dims(query, 1), keys), 1, -1)
        if logits.shape[-1] == 1:
            # One context takes all the weight (Keras warns on a size-1 softmax).
            scores = ops.ones_like(logits)
        else:
            scores = ops.softmax(ops.multiply(logits, self.scale), axis=-1)
        weights = ops.cast(scores, self.compute_dtype)

        if isinstance(values, (list, tuple)):
            # One context at a time: no stacked (B, N, H, W, C) copy. The sum
            # accumulates in float32; each product keeps only the original
            # context (and a small weight map) for the backward pass.
            output = None
            for m, value in enumerate(values):
                term = ops.cast(weights[..., m : m + 1] * self._normalize(self.value_norm, value), "float32")
                output = term if output is None else output + term
            output = ops.cast(output, self.compute_dtype)
        else:
            output = ops.einsum("bhwn,bnhwc->bhwc", weights, self._normalize(self.value_norm, values))
        output = self._normalize(self.output_norm, output)

        if return_attention_scores:
            return output, weights
        return output

    @staticmethod
    def _normalize(norm, x):
        """`x + GELU(LayerNorm(x))` (eq. 5-6), or `x` when `norm` is off."""
        if norm is None:
            return x
        return x + ops.gelu(norm(x))

    def compute_output_shape(self, query_shape, keys_shape, values_shape):
        _, _, value_channels = self._check_call_shapes(query_shape, keys_shape, values_shape)
        return tuple(query_shape[:-1]) + (value_channels,)

    def compute_output_spec(self, query, keys, values, return_attention_scores=False):
        if type(self).call is not DepthwiseAttend.call:
            # A subclass's own `call` may return something else: trace it (Keras'
            # `Layer` would use the inherited `compute_output_shape`).
            return keras.Operation.compute_output_spec(
                self, query, keys, values, return_attention_scores=return_attention_scores
            )
        num_contexts, _, value_channels = self._check_call_shapes(query.shape, _shapes(keys), _shapes(values))
        output = keras.KerasTensor(tuple(query.shape[:-1]) + (value_channels,), dtype=self.compute_dtype)
        if not return_attention_scores:
            return output
        scores = keras.KerasTensor(tuple(query.shape[:-1]) + (num_contexts,), dtype=self.compute_dtype)
        return output, scores

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "learnable_scale": self.learnable_scale,
                "initial_scale": self.initial_scale,
                "normalize_values": self.normalize_values,
                "normalize_output": self.normalize_output,
                "epsilon": self.epsilon,
                "regularizer": keras.regularizers.serialize(self.regularizer),
            }
        )
        return config


def _is_positive_number(x):
    return is_finite_real(x) and x > 0  # NumPy's too (stored as Python floats)


def _dot(query, key):
    """`sum_q query * key` over the last axis, summed in float32.

    float16 products overflow past 65504 (|q| = |k| = 256 is enough), so
    they are taken in float32; bfloat16 has float32's range and keeps them.
    """
    if keras.backend.standardize_dtype(query.dtype) == "float16":
        query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
    return ops.sum(ops.cast(ops.multiply(query, key), "float32"), axis=-1)


def _shapes(x):
    if isinstance(x, (list, tuple)):
        return [tuple(t.shape) for t in x]
    return tuple(x.shape)


def _is_shape_list(shape):
    """True for a list of shapes (list input), False for one shape (stacked).

    Shapes come back from a saved build config as lists, so a list of ints is
    one shape; an empty list is a list of no contexts.
    """
    return isinstance(shape, (list, tuple)) and all(isinstance(s, (tuple, list)) for s in shape)


def _context_shapes(shape, name):
    """Number of contexts and the per-context `(B, H, W, channels)` shapes."""
    if shape is None:
        shape = []
    if _is_shape_list(shape):
        shapes = [tuple(s) for s in shape]
        for i, s in enumerate(shapes):
            if len(s) != 4:
                raise ValueError(
                    f"Each tensor in `{name}` must have rank 4 (batch, height, width, channels). "
                    f"Received: {name}[{i}] with shape {s}"
                )
        num_contexts = len(shapes)
    else:
        shape = tuple(shape)
        if len(shape) != 5:
            raise ValueError(
                f"`{name}` must be a rank-5 tensor (batch, contexts, height, width, channels) "
                f"or a list of rank-4 tensors. Received: {name} with shape {shape}"
            )
        num_contexts = shape[1]
        shapes = [(shape[0],) + shape[2:]]
    if num_contexts == 0:
        raise ValueError(f"`{name}` must hold at least one context. Received: {name} with shape {shape}")
    return num_contexts, shapes


def _compatible(a, b):
    return a is None or b is None or a == b


def _check_shapes(query_shape, keys_shape, values_shape):
    """Validates the three inputs; returns (N, query channels, value channels)."""
    query_shape = tuple(query_shape)
    if len(query_shape) != 4:
        raise ValueError(
            f"`query` must have rank 4 (batch, height, width, channels). Received: query with shape {query_shape}"
        )
    num_keys, key_shapes = _context_shapes(keys_shape, "keys")
    num_values, value_shapes = _context_shapes(values_shape, "values")
    if not _compatible(num_keys, num_values):
        raise ValueError(
            "`keys` and `values` must hold the same number of contexts. "
            f"Received: {num_keys} keys (keys_shape={keys_shape}) and "
            f"{num_values} values (values_shape={values_shape})"
        )
    for name, shapes, full_shape in (("keys", key_shapes, keys_shape), ("values", value_shapes, values_shape)):
        for s in shapes:
            if not all(_compatible(a, b) for a, b in zip(s[:3], query_shape[:3])):
                raise ValueError(
                    f"`{name}` must have the batch size and spatial shape of `query`. "
                    f"Received: query_shape={query_shape} and {name}_shape={full_shape}"
                )
    query_channels = query_shape[-1]
    for s in key_shapes:
        if not _compatible(s[-1], query_channels):
            raise ValueError(
                "`keys` must have as many channels as `query`. "
                f"Received: query_shape={query_shape} and keys_shape={keys_shape}"
            )
    value_channels = value_shapes[0][-1]
    for s in value_shapes[1:]:
        if not _compatible(s[-1], value_channels):
            raise ValueError(f"All `values` must have the same channels. Received: values_shape={values_shape}")
        value_channels = value_channels if value_channels is not None else s[-1]
    return (num_keys if num_keys is not None else num_values), query_channels, value_channels
