"""Spatial non-local block (Wang et al. 2018), exact or with FAVOR+ attention."""

import random

import keras
from keras import ops

from keras_avae._validation import check_bool
from keras_avae._validation import check_layer_seed
from keras_avae._validation import check_positive_int
from keras_avae.ops.channels import split_channels
from keras_avae.ops.favor import _numpy_orthogonal_features
from keras_avae.ops.favor import favor_attention
from keras_avae.ops.favor import favor_feature_map
from keras_avae.ops.favor import orthogonal_random_features

_ATTENTIONS = ("softmax", "performer")
_FEATURE_REDRAWS = ("fixed", "training")


@keras.saving.register_keras_serializable(package="keras_avae")
class NonLocalBlock(keras.layers.Layer):
    """Residual self-attention over all positions of a feature map.

    The non-local block of Wang et al., "Non-local Neural Networks" (CVPR
    2018), in the form used by the spatially attentive cells of "Deep
    Attentive Variational Inference" (Apostolopoulou et al., ICLR 2022,
    Sec. 2.6). With `theta`, `phi` and `g` 1x1 convolutions (to `key_dim`,
    `key_dim` and C channels) and the H * W positions `p, q` of the input `x`:

    ```
    A[p, q] = softmax_q(theta(x)[p] . phi(x)[q])
    out[p]  = x[p] + gamma * sum_q A[p, q] g(x)[q]
    ```

    The logits are NOT divided by sqrt(key_dim), as in the paper's reference
    implementation. `gamma` is a scalar weight initialised to 0, so the block
    is exactly the identity at initialisation.

    `attention="softmax"` forms the (H*W x H*W) matrix `A`: O((HW)^2) time
    and memory. `attention="performer"` computes the same quantity with FAVOR+
    (`keras_avae.ops.favor_attention`, one head, logit scale 1): positive
    orthogonal random features estimate the softmax kernel without forming
    `A`, in O(HW * num_random_features) time and memory. The two modes have
    the same weights, so a block trained with one runs with the other. The
    random features are not weights: they are drawn from the integer `seed`
    (resolved at construction when `None` and kept in the config), so a
    `.keras` round trip reproduces them. FAVOR+'s error grows with the size
    of the logits (there is no 1/sqrt(key_dim) to temper them): check it on
    trained weights before swapping modes.

    Args:
        key_dim: positive int, channels of `theta` and `phi`. Defaults to 32
            (the reference's).
        attention: `"softmax"` (exact) or `"performer"` (FAVOR+). Defaults
            to `"softmax"`.
        num_random_features: positive int, FAVOR+ random features (performer
            only). Defaults to 256.
        feature_redraw: `"fixed"`: one draw from `seed` used for every call;
            `"training"`: a fresh draw for every training call, the fixed
            draw at inference (performer only). Defaults to `"fixed"`.
        use_bias: bool, whether the 1x1 convolutions have biases. Defaults to
            `True`.
        kernel_initializer: initializer of the convolution kernels.
        kernel_regularizer: regularizer of the convolution kernels.
        bias_regularizer: regularizer of the convolution biases.
        gamma_initializer: initializer of `gamma`. Defaults to `"zeros"`.
        gamma_regularizer: regularizer of `gamma`.
        seed: int in `[0, 2**31 - 2]` (`seed + 1` seeds the redraws and
            must fit an int32) or `None`, seeds the random features. `None`
            draws an integer at construction (from Python's `random`, which
            `keras.utils.set_random_seed` seeds).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: tensor of shape `(B, H, W, C)`.
        training: bool, training mode (selects redrawn random features with
            `feature_redraw="training"`).

    Returns:
        A tensor of the input's shape, in the layer's compute dtype.

    Example:

    >>> import numpy as np
    >>> x = np.random.normal(size=(2, 8, 8, 16)).astype("float32")
    >>> block = NonLocalBlock(key_dim=4)
    >>> bool(np.all(keras.ops.convert_to_numpy(block(x)) == x))  # gamma = 0
    True
    >>> fast = NonLocalBlock(key_dim=4, attention="performer", seed=0)
    >>> tuple(fast(x).shape)
    (2, 8, 8, 16)
    """

    def __init__(
        self,
        key_dim=32,
        attention="softmax",
        num_random_features=256,
        feature_redraw="fixed",
        use_bias=True,
        kernel_initializer="glorot_uniform",
        kernel_regularizer=None,
        gamma_initializer="zeros",
        seed=None,
        bias_regularizer=None,
        gamma_regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # NumPy's too, stored as Python ints (the config must serialise).
        key_dim = check_positive_int(key_dim, "key_dim")
        if attention not in _ATTENTIONS:
            raise ValueError(f"`attention` must be one of {_ATTENTIONS}. Received: attention={attention!r}")
        num_random_features = check_positive_int(num_random_features, "num_random_features")
        if feature_redraw not in _FEATURE_REDRAWS:
            raise ValueError(
                f"`feature_redraw` must be one of {_FEATURE_REDRAWS}. Received: feature_redraw={feature_redraw!r}"
            )
        check_bool(use_bias, "use_bias")
        seed = check_layer_seed(seed)
        if seed is None:
            # A concrete seed in the config makes the features reproducible
            # after a `.keras` round trip (same range as PerformerAttention).
            seed = random.randint(1, int(1e9))
        self.key_dim = key_dim
        self.attention = attention
        self.num_random_features = num_random_features
        self.feature_redraw = feature_redraw
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.seed = seed
        self._features = None
        self.seed_generator = None
        if attention == "performer" and feature_redraw == "training":
            # `seed + 1` as in `PerformerAttention`, whose dropout draws from
            # `seed` (the fixed features come from NumPy, another stream).
            self.seed_generator = keras.random.SeedGenerator(seed + 1)

    def _conv(self, filters, name):
        # Each convolution gets its own copy of the initializer/regularizer.
        return keras.layers.Conv2D(
            filters,
            kernel_size=1,
            data_format="channels_last",
            use_bias=self.use_bias,
            kernel_initializer=_copy(self.kernel_initializer),
            kernel_regularizer=_copy(self.kernel_regularizer),
            bias_regularizer=_copy(self.bias_regularizer),
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != 4 or input_shape[-1] is None:
            raise ValueError(
                "`inputs` must have rank 4 (batch, height, width, channels) with known channels. "
                f"Received: inputs with shape {input_shape}"
            )
        # A later call with another rank or channel count: Keras' error, not
        # the backend's (a rank-5 input even ran, reshaped).
        self.input_spec = keras.layers.InputSpec(ndim=4, axes={-1: input_shape[-1]})
        self.theta = self._conv(self.key_dim, "theta")
        self.phi = self._conv(self.key_dim, "phi")
        self.g = self._conv(input_shape[-1], "g")
        for conv in (self.theta, self.phi, self.g):
            conv.build(input_shape)
        self.gamma = self.add_weight(
            name="gamma", shape=(), initializer=self.gamma_initializer, regularizer=self.gamma_regularizer
        )

    def _project(self, inputs, convs):
        """The 1x1 convolutions `convs` of `inputs`, each as float32 `(B, H*W, channels)`."""
        batch = ops.shape(inputs)[0]
        if all(_is_pointwise(conv) for conv in convs):
            # A 1x1 convolution is a matrix product over the channels: 2-D
            # products, no layout changes on any backend. On TensorFlow and
            # JAX one per projection (slicing a joint product cost more in
            # its gradient than the products themselves).
            flat = ops.reshape(inputs, (-1, inputs.shape[-1]))

            def product(kernel, bias):
                y = ops.matmul(flat, ops.cast(kernel, self.compute_dtype))
                return y if bias is None else y + ops.cast(bias, self.compute_dtype)

            kernels = [ops.reshape(conv.kernel, (inputs.shape[-1], conv.filters)) for conv in convs]
            biases = [conv.bias if self.use_bias else None for conv in convs]
            if keras.backend.backend() == "torch":
                # One product for all projections, then split: two CPU
                # products with 8 result columns (`key_dim` of the small
                # entries) took 2.8-3.7x as long, forward and backward, as
                # one with 16.
                joint_bias = ops.concatenate(biases, axis=0) if self.use_bias else None
                joint = product(ops.concatenate(kernels, axis=1), joint_bias)
                projected = split_channels(joint, [conv.filters for conv in convs])
            else:
                projected = [product(k, b) for k, b in zip(kernels, biases)]
            projected = [ops.reshape(y, (batch, -1, y.shape[-1])) for y in projected]
        else:  # projections changed by a subclass (see `_conv`)
            projected = [ops.reshape(conv(inputs), (batch, -1, conv.filters)) for conv in convs]
        # Float32 from here: the logits, softmax (or FAVOR+ features) and the
        # weighted sum over all positions.
        return tuple(ops.cast(y, "float32") for y in projected)

    def call(self, inputs, training=None):
        if self.attention == "softmax":
            theta, phi, g = self._project(inputs, (self.theta, self.phi, self.g))
            # Unscaled logits, as in the reference (no 1/sqrt(key_dim)).
            scores = ops.softmax(ops.einsum("bpk,bqk->bpq", theta, phi), axis=-1)
            attended = ops.einsum("bpq,bqc->bpc", scores, g)
        else:
            if training and self.feature_redraw == "training":
                features = orthogonal_random_features(
                    self.num_random_features, self.key_dim, seed=self.seed_generator
                )
            else:
                features = self._fixed_features()
            # One head (no head axis) and scale 1: the softmax path's logits.
            if _is_pointwise(self.g):
                # `g` is linear and the attention weights sum to one, so
                # FAVOR+ applies it to the (C + 1, m) key-value summary
                # instead of to all H*W positions: no (B, H*W, C) product
                # and none of its gradients.
                theta, phi = self._project(inputs, (self.theta, self.phi))
                values = ops.reshape(ops.cast(inputs, "float32"), (ops.shape(inputs)[0], -1, inputs.shape[-1]))
                kernel = ops.reshape(self.g.kernel, (inputs.shape[-1], self.g.filters))
                bias = self.g.bias if self.use_bias else None
                attended = favor_attention(
                    theta, phi, values, features, scale=1.0, value_kernel=kernel, value_bias=bias
                )
            else:
                theta, phi, g = self._project(inputs, (self.theta, self.phi, self.g))
                attended = favor_attention(theta, phi, g, features, scale=1.0)
        attended = ops.cast(ops.reshape(attended, ops.shape(inputs)), self.compute_dtype)
        return inputs + self.gamma * attended

    def attention_map(self, inputs, query_positions):
        """The attention weights `A[p, :]` of chosen query positions.

        Exact in softmax mode; in performer mode the FAVOR+ estimate the
        block computes with (its fixed features), normalised the same way.
        Either way each map sums to 1. An unbuilt block is first built for
        `inputs`' shape, as calling it would.

        Args:
            inputs: tensor of shape `(B, H, W, C)`, the block's input.
            query_positions: list of `(row, col)` pairs in `[0, H) x [0, W)`.

        Returns:
            Float32 tensor `(B, Q, H, W)`: for each query position, its
            weights over every key position.

        Example:

        >>> import numpy as np
        >>> x = np.random.normal(size=(1, 4, 4, 8)).astype("float32")
        >>> block = NonLocalBlock(key_dim=2)
        >>> _ = block(x)
        >>> maps = keras.ops.convert_to_numpy(block.attention_map(x, [(0, 0), (3, 2)]))
        >>> maps.shape, bool(np.allclose(maps.sum(axis=(2, 3)), 1.0))
        ((1, 2, 4, 4), True)
        """
        if not self.built:
            self.build(tuple(inputs.shape))
        # As `__call__` casts (a float32 input under "mixed_float16" met float16 kernels).
        inputs = ops.cast(inputs, self.compute_dtype)
        height, width = inputs.shape[1], inputs.shape[2]
        rows = []
        for position in query_positions:
            row, col = (int(v) for v in position)
            if not (0 <= row < height and 0 <= col < width):
                raise ValueError(
                    f"`query_positions` must lie in [0, {height}) x [0, {width}). Received: query_positions="
                    f"{list(query_positions)!r}"
                )
            rows.append(row * width + col)
        if not rows:
            raise ValueError(f"`query_positions` must name at least one position. Received: {query_positions!r}")
        theta, phi = self._project(inputs, (self.theta, self.phi))
        theta = ops.take(theta, rows, axis=1)
        if self.attention == "softmax":
            weights = ops.softmax(ops.einsum("bpk,bqk->bpq", theta, phi), axis=-1)
        else:
            features = self._fixed_features()
            # The same feature maps (and eps) as `favor_attention` uses: the
            # block's output is exactly these weights times g(x).
            query_features = favor_feature_map(theta[:, :, None, :], features, is_query=True, scale=1.0)
            key_features = favor_feature_map(phi[:, :, None, :], features, is_query=False, scale=1.0)
            products = ops.einsum("bpm,bqm->bpq", query_features[:, :, 0], key_features[:, :, 0])
            weights = products / ops.sum(products, axis=-1, keepdims=True)
        return ops.reshape(weights, (ops.shape(inputs)[0], len(rows), height, width))

    def _fixed_features(self):
        # Drawn once on the host from the integer seed (not per call, and not
        # inside a traced step): the same matrix on every backend and call.
        if self._features is None:
            self._features = _numpy_orthogonal_features(self.num_random_features, self.key_dim, self.seed)
        return ops.convert_to_tensor(self._features)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "key_dim": self.key_dim,
                "attention": self.attention,
                "num_random_features": self.num_random_features,
                "feature_redraw": self.feature_redraw,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
                "gamma_regularizer": keras.regularizers.serialize(self.gamma_regularizer),
                "seed": self.seed,
            }
        )
        return config


def _copy(obj):
    """A fresh copy of an initializer or regularizer (`None` stays `None`)."""
    return None if obj is None else obj.__class__.from_config(obj.get_config())


def _is_pointwise(conv):
    """Whether `conv` is exactly a 1x1, stride-1, linear `Conv2D` (a matrix product)."""
    return (
        type(conv) is keras.layers.Conv2D
        and tuple(conv.kernel_size) == (1, 1)
        and tuple(conv.strides) == (1, 1)
        and tuple(conv.dilation_rate) == (1, 1)
        and conv.groups == 1
        and conv.activation is keras.activations.linear
    )
