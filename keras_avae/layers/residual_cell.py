"""The NVAE-style residual cell of the attentive VAE, optionally non-local."""

import functools
import random

import keras
import numpy as np
from keras import ops

from keras_avae._validation import check_bool
from keras_avae._validation import check_finite_number
from keras_avae._validation import check_layer_seed
from keras_avae._validation import is_int
from keras_avae._validation import is_integer
from keras_avae.keras_compat import call_sublayer
from keras_avae.layers.batch_normalization import BatchNormalization
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D
from keras_avae.layers.weight_norm_conv2d import _conv2d_channels_last

_SCALES = ("same", "down", "up")
_ATTENTIONS = ("softmax", "performer")


@keras.saving.register_keras_serializable(package="keras_avae")
class ResidualCell(keras.layers.Layer):
    """Two (BatchNorm -> [NonLocal] -> Swish -> 3x3 conv) nodes and a shortcut.

    The residual cell of NVAE (Vahdat & Kautz, 2020) as used by "Deep
    Attentive Variational Inference": `output = residual_scale * residual +
    shortcut`. With `nonlocal_key_dim` set, a `NonLocalBlock` sits in each
    node between the batch norm and the activation (paper Sec. 2.6, Fig. 3).

    - `scale="same"`: channels and size kept; the shortcut is the identity.
    - `scale="down"`: stride 2 in the first node, channels doubled; the
      shortcut is a factorised reduce (Swish, then four stride-2 1x1 convs on
      the input shifted by 0 or 1 pixel, concatenated).
    - `scale="up"`: nearest-neighbour x2 upsampling before the nodes
      (computed after the first node's batch norm, non-local block and
      Swish, which commute with it: the same function at a quarter of the
      positions), channels halved; the shortcut is a bilinear
      (corner-aligned) x2 resize, an optional non-local block and a
      bias-free 1x1 conv.

    All convolutions are weight-normalised.

    Args:
        scale: `"same"`, `"down"` or `"up"`.
        nonlocal_key_dim: int or `None`. Key channels of the non-local blocks;
            `None` (default) means no non-local block.
        nonlocal_attention: `"softmax"` or `"performer"`, for the non-local
            blocks. Defaults to `"softmax"`.
        nonlocal_num_random_features: int, FAVOR+ features for
            `nonlocal_attention="performer"`. Defaults to `256`.
        residual_scale: float. Defaults to `0.1`.
        bn_momentum: float. Defaults to `0.9` (the reference's).
        bn_epsilon: float. Defaults to `1e-5`.
        synchronized_batch_norm: bool. Synchronise batch statistics across
            replicas under a `tf.distribute` strategy (TensorFlow backend).
            Defaults to `False`.
        kernel_regularizer: regularizer for every weight: the convolutions,
            the batch norms and the non-local blocks (kernels, biases, gamma).
        seed: int or `None`, for the non-local blocks' random features
            (`None`: drawn at construction and kept in the config, so a
            reloaded cell has the same features).
        **kwargs: base layer arguments.

    Call arguments:
        inputs: tensor of shape `(B, H, W, C)`.
        training: bool, batch-norm mode.

    Returns:
        `(B, H, W, C)` for `"same"`, `(B, H/2, W/2, 2C)` for `"down"`,
        `(B, 2H, 2W, C/2)` for `"up"`.

    Example:

    >>> import numpy as np
    >>> cell = ResidualCell("down")
    >>> tuple(cell(np.zeros((2, 8, 8, 6), "float32")).shape)
    (2, 4, 4, 12)
    """

    def __init__(
        self,
        scale="same",
        nonlocal_key_dim=None,
        nonlocal_attention="softmax",
        nonlocal_num_random_features=256,
        residual_scale=0.1,
        bn_momentum=0.9,
        bn_epsilon=1e-5,
        synchronized_batch_norm=False,
        kernel_regularizer=None,
        seed=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if scale not in _SCALES:
            raise ValueError(f"`scale` must be one of {_SCALES}. Received: scale={scale!r}")
        if is_integer(nonlocal_key_dim):
            nonlocal_key_dim = int(nonlocal_key_dim)  # NumPy's too, stored as a Python int
        if nonlocal_key_dim is not None and (not is_int(nonlocal_key_dim) or nonlocal_key_dim < 1):
            raise ValueError(
                f"`nonlocal_key_dim` must be a positive int or None. Received: nonlocal_key_dim={nonlocal_key_dim!r}"
            )
        if nonlocal_attention not in _ATTENTIONS:
            raise ValueError(
                f"`nonlocal_attention` must be one of {_ATTENTIONS}. "
                f"Received: nonlocal_attention={nonlocal_attention!r}"
            )
        if is_integer(nonlocal_num_random_features):
            nonlocal_num_random_features = int(nonlocal_num_random_features)  # NumPy's too, stored as a Python int
        if not is_int(nonlocal_num_random_features) or nonlocal_num_random_features < 1:
            raise ValueError(
                "`nonlocal_num_random_features` must be a positive int. "
                f"Received: nonlocal_num_random_features={nonlocal_num_random_features!r}"
            )
        check_finite_number(residual_scale, "residual_scale", lambda v: True, "")
        check_finite_number(bn_momentum, "bn_momentum", lambda v: 0 <= v <= 1, "in [0, 1]")
        check_finite_number(bn_epsilon, "bn_epsilon", lambda v: v > 0, "> 0")
        check_bool(synchronized_batch_norm, "synchronized_batch_norm")
        seed = check_layer_seed(seed)
        if seed is None and nonlocal_key_dim is not None:
            # A concrete seed in the config, so that a saved and reloaded cell
            # has the same random features (its blocks would each draw anew).
            seed = random.randint(1, int(1e9))
        self.scale = scale
        self.nonlocal_key_dim = nonlocal_key_dim
        self.nonlocal_attention = nonlocal_attention
        self.nonlocal_num_random_features = nonlocal_num_random_features
        self.residual_scale = residual_scale
        self.bn_momentum = bn_momentum
        self.bn_epsilon = bn_epsilon
        self.synchronized_batch_norm = synchronized_batch_norm
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.seed = seed

    def _nonlocal(self, name):
        return NonLocalBlock(
            key_dim=self.nonlocal_key_dim,
            attention=self.nonlocal_attention,
            num_random_features=self.nonlocal_num_random_features,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.kernel_regularizer,
            gamma_regularizer=self.kernel_regularizer,
            seed=self.seed,
            dtype=self.dtype_policy,
            name=name,
        )

    def build(self, input_shape):
        channels = input_shape[-1]
        if channels is None:
            raise ValueError(f"The channel axis must be defined. Received: input_shape={input_shape}")
        if self.scale == "up" and channels % 2:
            raise ValueError(f"scale='up' halves the channels, so they must be even. Received: input_shape={input_shape}")
        out_channels = {"same": channels, "down": 2 * channels, "up": channels // 2}[self.scale]
        self.out_channels = out_channels
        batch, height, width = input_shape[0], input_shape[1], input_shape[2]
        if self.scale == "up":
            height, width = _double(height), _double(width)

        self.node_norms, self.node_nonlocals, self.node_convs = [], [], []
        node_in = channels
        for i in range(2):
            norm = BatchNormalization(
                momentum=self.bn_momentum,
                epsilon=self.bn_epsilon,
                synchronized=self.synchronized_batch_norm,
                gamma_regularizer=self.kernel_regularizer,
                beta_regularizer=self.kernel_regularizer,
                dtype=self.dtype_policy,
                name=f"node{i}_bn",
            )
            stride = 2 if (self.scale == "down" and i == 0) else 1
            conv = WeightNormConv2D(
                out_channels,
                3,
                strides=stride,
                kernel_regularizer=self.kernel_regularizer,
                bias_regularizer=self.kernel_regularizer,
                dtype=self.dtype_policy,
                name=f"node{i}_conv",
            )
            shape = (batch, height, width, node_in)
            norm.build(shape)
            nonlocal_block = None
            if self.nonlocal_key_dim is not None:
                nonlocal_block = self._nonlocal(f"node{i}_nonlocal")
                nonlocal_block.build(shape)
            conv.build(shape)
            self.node_norms.append(norm)
            self.node_nonlocals.append(nonlocal_block)
            self.node_convs.append(conv)
            if stride == 2:
                height, width = _half(height), _half(width)
            node_in = out_channels

        in_shape = tuple(input_shape)
        if self.scale == "down":
            quarter = out_channels // 4
            splits = [quarter, quarter, quarter, out_channels - 3 * quarter]
            self.reduce_convs = []
            for i, filters in enumerate(splits):
                conv = WeightNormConv2D(
                    filters,
                    1,
                    strides=2,
                    padding="valid",
                    kernel_regularizer=self.kernel_regularizer,
                    bias_regularizer=self.kernel_regularizer,
                    dtype=self.dtype_policy,
                    name=f"reduce{i}_conv",
                )
                conv.build(in_shape)
                self.reduce_convs.append(conv)
        elif self.scale == "up":
            up_shape = (batch, _double(input_shape[1]), _double(input_shape[2]), channels)
            self.shortcut_nonlocal = None
            if self.nonlocal_key_dim is not None:
                self.shortcut_nonlocal = self._nonlocal("shortcut_nonlocal")
                self.shortcut_nonlocal.build(up_shape)
            self.shortcut_conv = WeightNormConv2D(
                out_channels,
                1,
                use_bias=False,
                kernel_regularizer=self.kernel_regularizer,
                dtype=self.dtype_policy,
                name="shortcut_conv",
            )
            self.shortcut_conv.build(up_shape)

    def call(self, inputs, training=None):
        if self.scale == "up" and None in tuple(inputs.shape[1:3]):
            raise ValueError(
                "scale='up' needs the height and width of its inputs when it is called (its upsampling and its "
                f"shortcut's bilinear resize are built for them). Received: inputs.shape={tuple(inputs.shape)}"
            )
        x = inputs
        for i, (norm, nonlocal_block, conv) in enumerate(zip(self.node_norms, self.node_nonlocals, self.node_convs)):
            x = call_sublayer(norm, x, training=training)
            if nonlocal_block is not None:
                x = call_sublayer(nonlocal_block, x, training=training)
            x = ops.silu(x)
            if self.scale == "up" and i == 0:
                # The cell upsamples its input, but batch norm, the non-local
                # block and Swish commute exactly with nearest-neighbour
                # upsampling (each pixel repeated 4 times leaves the batch
                # statistics, every attention ratio and the key stabiliser
                # unchanged), so they run at a quarter of the positions.
                x = _nearest_upsample(x)
            x = call_sublayer(conv, x)
        return self.residual_scale * x + self._shortcut(inputs, training)

    def _shortcut(self, inputs, training):
        if self.scale == "same":
            return inputs
        if self.scale == "down":
            u = ops.silu(inputs)
            if None not in inputs.shape[1:3] and inputs.shape[1] % 2 == 0 and inputs.shape[2] % 2 == 0:
                return self._phase_reduce(u)
            # Even/odd pixel phases, so no input pixel is skipped by stride 2.
            shifted = [u, u[:, 1:, 1:], u[:, :, 1:], u[:, 1:, :]]
            parts = [conv(s) for conv, s in zip(self.reduce_convs, shifted)]
            height, width = ops.shape(parts[0])[1], ops.shape(parts[0])[2]
            parts = [_pad_to(p, height, width) for p in parts]
            return ops.concatenate(parts, axis=-1)
        batch, height, width, channels = ops.shape(inputs)[0], inputs.shape[1], inputs.shape[2], inputs.shape[3]
        # Corner-aligned bilinear x2 resize as two fixed interpolation
        # matrices (keras.ops.image.resize has no align_corners).
        rows = ops.convert_to_tensor(_align_corners_matrix(height), dtype=self.compute_dtype)
        cols = ops.convert_to_tensor(_align_corners_matrix(width), dtype=self.compute_dtype)
        # Two broadcast matrix products over (h, w * c) and (w, c) views: no
        # transposes (an einsum moves the contracted axis last and back).
        x = ops.matmul(rows, ops.reshape(inputs, (batch, height, width * channels)))
        x = ops.matmul(cols, ops.reshape(x, (-1, width, channels)))
        x = ops.reshape(x, (batch, 2 * height, 2 * width, channels))
        if self.shortcut_nonlocal is not None:
            x = call_sublayer(self.shortcut_nonlocal, x, training=training)
        return call_sublayer(self.shortcut_conv, x)

    def _phase_reduce(self, u):
        """The factorised reduce of even-sized inputs as one 2x2, stride-2 convolution.

        The four 1x1 stride-2 convolutions read the four pixel phases
        `(0, 0), (1, 1), (0, 1), (1, 0)` of each 2x2 block: each is one tap
        of a 2x2 kernel, zero elsewhere, and their outputs sit side by side.
        One convolution replaces four, three shifted copies of the input
        and the concatenation (and their gradients).
        """
        # Each 1x1 kernel times a one-hot 2x2 tap: on torch `ops.pad` builds a
        # Keras operation per call (about 130 us), a product costs a few.
        taps = ops.convert_to_tensor(_PHASE_TAPS, self.compute_dtype)
        kernels = [conv.normalized_kernel() * taps[i] for i, conv in enumerate(self.reduce_convs)]
        biases = [ops.cast(conv.bias, self.compute_dtype) for conv in self.reduce_convs]
        return _conv2d_channels_last(u, ops.concatenate(kernels, axis=-1), 2, "valid", ops.concatenate(biases, axis=0))

    def compute_output_shape(self, input_shape):
        batch, height, width, channels = input_shape
        if self.scale == "same":
            return tuple(input_shape)
        if self.scale == "down":
            return (batch, _half(height), _half(width), 2 * channels)
        return (batch, _double(height), _double(width), channels // 2)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "scale": self.scale,
                "nonlocal_key_dim": self.nonlocal_key_dim,
                "nonlocal_attention": self.nonlocal_attention,
                "nonlocal_num_random_features": self.nonlocal_num_random_features,
                "residual_scale": self.residual_scale,
                "bn_momentum": self.bn_momentum,
                "bn_epsilon": self.bn_epsilon,
                "synchronized_batch_norm": self.synchronized_batch_norm,
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "seed": self.seed,
            }
        )
        return config


# The factorised reduce's four pixel phases (0, 0), (1, 1), (0, 1), (1, 0) as
# one-hot (2, 2, 1, 1) taps of a 2x2 kernel.
_PHASE_TAPS = np.zeros((4, 2, 2, 1, 1), "float32")
for _i, (_row, _col) in enumerate(((0, 0), (1, 1), (0, 1), (1, 0))):
    _PHASE_TAPS[_i, _row, _col] = 1.0


def _half(size):
    """A stride-2 output size; `None` (unknown) stays `None`."""
    return None if size is None else -(-size // 2)


def _double(size):
    return None if size is None else 2 * size


@functools.lru_cache(maxsize=32)
def _align_corners_matrix(size):
    """(2*size, size) bilinear interpolation weights with aligned corners (cached: one per size)."""
    out = 2 * size
    matrix = np.zeros((out, size), "float32")
    if size == 1:
        matrix[:, 0] = 1.0
        return matrix
    positions = np.arange(out) * (size - 1) / (out - 1)
    low = np.floor(positions).astype(int)
    high = np.minimum(low + 1, size - 1)
    frac = (positions - low).astype("float32")
    matrix[np.arange(out), low] += 1.0 - frac
    matrix[np.arange(out), high] += frac
    return matrix


def _nearest_upsample(x):
    """x2 nearest-neighbour upsampling of `(B, H, W, C)`: a broadcast and a reshape.

    (`ops.repeat` on two axes is dozens of ops on TensorFlow, and so is its
    gradient; a broadcast's gradient is one sum.)
    """
    if keras.backend.backend() == "torch":
        # The broadcast's gradient on torch is a sum over two strided size-2
        # axes, 10-15x slower than torch's own nearest-neighbour kernels
        # (forward and backward at (32, 16, 16, 32): 3.9 ms against 0.27 ms),
        # which take the channels-last memory of this (B, C, H, W) view as it is.
        import torch.nn.functional as F

        x = ops.convert_to_tensor(x)
        return F.interpolate(x.permute(0, 3, 1, 2), scale_factor=2, mode="nearest").permute(0, 2, 3, 1)
    batch, height, width, channels = ops.shape(x)[0], x.shape[1], x.shape[2], x.shape[3]
    x = ops.broadcast_to(x[:, :, None, :, None, :], (batch, height, 2, width, 2, channels))
    return ops.reshape(x, (batch, 2 * height, 2 * width, channels))


def _pad_to(x, height, width):
    """Zero-pads the bottom/right of `x` to `(height, width)` (odd inputs)."""
    pad_h = height - ops.shape(x)[1]
    pad_w = width - ops.shape(x)[2]
    if isinstance(pad_h, int) and isinstance(pad_w, int) and pad_h == 0 and pad_w == 0:
        return x
    return ops.pad(x, [[0, 0], [0, pad_h], [0, pad_w], [0, 0]])
