"""Weight-normalised 2-D convolution (Salimans & Kingma, 2016)."""

import keras
from keras import ops

from keras_avae._validation import check_bool
from keras_avae._validation import check_positive_int
from keras_avae.layers.batched_weight_norm import normalize_kernels
from keras_avae.layers.batched_weight_norm import shared_kernel


@keras.saving.register_keras_serializable(package="keras_avae")
class WeightNormConv2D(keras.layers.Layer):
    """A 2-D convolution whose kernel is `v / ||v|| * exp(log_g)`.

    Weight normalisation (Salimans & Kingma, NeurIPS 2016) as used by NVAE
    and by the attentive VAE: each output channel's kernel is the direction
    `v / ||v||` (norm over kernel height, width and input channels) times a
    learned scale `exp(log_g)`. `log_g` starts at `log ||v||`, so at
    initialisation the layer is the plain convolution with kernel `v`. The
    norm and the scale are computed in float32.

    Args:
        filters: int, the number of output channels.
        kernel_size: int, the (square) kernel size.
        strides: int. Defaults to `1`.
        padding: `"same"` or `"valid"`. Defaults to `"same"`.
        use_bias: bool. Defaults to `True`.
        kernel_initializer: initializer for `v`. Defaults to the reference's
            `VarianceScaling(0.33, "fan_in", "uniform")`.
        bias_initializer: initializer for the bias. Defaults to `"zeros"`.
        kernel_regularizer: regularizer for `v` and `log_g`.
        bias_regularizer: regularizer for the bias.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: tensor of shape `(B, H, W, C_in)`.

    Returns:
        Tensor of shape `(B, H', W', filters)`.

    Example:

    >>> import numpy as np
    >>> conv = WeightNormConv2D(8, 3, strides=2)
    >>> tuple(conv(np.zeros((2, 16, 16, 4), "float32")).shape)
    (2, 8, 8, 8)
    """

    def __init__(
        self,
        filters,
        kernel_size,
        strides=1,
        padding="same",
        use_bias=True,
        kernel_initializer=None,
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # NumPy's too, stored as Python ints (the config must serialise).
        filters = check_positive_int(filters, "filters")
        kernel_size = check_positive_int(kernel_size, "kernel_size")
        strides = check_positive_int(strides, "strides")
        if padding not in ("same", "valid"):
            raise ValueError(f"`padding` must be 'same' or 'valid'. Received: padding={padding!r}")
        check_bool(use_bias, "use_bias")
        self.filters = filters
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.use_bias = use_bias
        if kernel_initializer is None:
            kernel_initializer = keras.initializers.VarianceScaling(
                scale=0.33, mode="fan_in", distribution="uniform"
            )
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)

    def build(self, input_shape):
        channels = input_shape[-1]
        if len(input_shape) != 4 or channels is None:
            raise ValueError(
                "The input must have rank 4 (batch, height, width, channels) with a defined channel axis. "
                f"Received: input_shape={input_shape}"
            )
        # A later call with another rank or channel count: Keras' error, not the backend's.
        self.input_spec = keras.layers.InputSpec(ndim=4, axes={-1: channels})
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.kernel_size, self.kernel_size, channels, self.filters),
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
        )
        # log_g starts at log ||v||. A callable, not a constant: under a
        # symbolic build Keras defers variable initialisation, and the kernel
        # has no value yet when this line runs.
        self.log_g = self.add_weight(
            name="log_g",
            shape=(self.filters,),
            initializer=lambda shape, dtype=None: ops.cast(ops.log(self._kernel_norm()), dtype or "float32"),
            regularizer=self.kernel_regularizer,
        )
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.filters,),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
            )
        else:
            self.bias = None

    def _squared_norm(self, kernel):
        # `kernel * kernel`, not `ops.square`: on torch a tensor operator skips
        # Keras' conversions and `square` is a `pow`.
        return ops.sum(kernel * kernel, axis=(0, 1, 2)) + 1e-12

    def _kernel_norm(self):
        return ops.sqrt(self._squared_norm(ops.cast(self.kernel, "float32")))

    def normalized_kernel(self):
        """The kernel the layer convolves with, `v / ||v|| * exp(log_g)`, in the compute dtype.

        Example:

        >>> import numpy as np
        >>> conv = WeightNormConv2D(3, 1)
        >>> conv.build((1, 4, 4, 2))
        >>> kernel = keras.ops.convert_to_numpy(conv.normalized_kernel())
        >>> bool(np.allclose(np.linalg.norm(kernel.reshape(2, 3), axis=0), np.exp(keras.ops.convert_to_numpy(conv.log_g))))
        True
        """
        if keras.backend.backend() == "torch":
            # One autograd node with closed-form gradients (see
            # `batched_weight_norm`), shared with the pass's other kernels
            # inside `batched_normalized_kernels`.
            kernel = shared_kernel(self)
            if kernel is None:
                kernel = normalize_kernels(
                    [ops.convert_to_tensor(self.kernel).float()], [ops.convert_to_tensor(self.log_g).float()]
                )[0]
            return ops.cast(kernel, self.compute_dtype)
        # exp(log_g) / ||v|| as one product: the fewest ops per call.
        kernel = ops.cast(self.kernel, "float32")
        scale = ops.exp(ops.cast(self.log_g, "float32")) * ops.rsqrt(self._squared_norm(kernel))
        return ops.cast(kernel * scale, self.compute_dtype)

    def call(self, inputs):
        bias = ops.cast(self.bias, self.compute_dtype) if self.use_bias else None
        return _conv2d_channels_last(inputs, self.normalized_kernel(), self.strides, self.padding, bias)

    def compute_output_shape(self, input_shape):
        batch, height, width, _ = input_shape

        def out(size):
            if size is None:
                return None
            if self.padding == "same":
                return -(-size // self.strides)
            return (size - self.kernel_size) // self.strides + 1

        return (batch, out(height), out(width), self.filters)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "filters": self.filters,
                "kernel_size": self.kernel_size,
                "strides": self.strides,
                "padding": self.padding,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
            }
        )
        return config


def _conv2d_channels_last(inputs, kernel, strides, padding, bias=None):
    """`ops.conv` plus an optional `(F,)` bias, for `(B, H, W, C)` inputs and `(k, k, C, F)` kernels.

    On torch, `ops.conv` copies the inputs to channels-first and back, and
    the output again, on every call. Permuted views of the same memory are
    what torch calls the channels-last format, which its CPU and GPU
    convolutions take as they are: no copies of inputs or outputs. The bias
    goes into the convolution itself on torch: its gradient comes out of the
    convolution's backward kernel instead of a separate reduction over the
    output.
    """
    empty = [length == 0 for length in inputs.shape[1:3]]
    if any(empty):
        # An empty image (ResidualCell's shifted phases of a one-pixel-high or
        # -wide input): torch's conv2d refuses it and TensorFlow's returns it
        # unchanged, with the input's channels. Convolve `size` zero rows
        # (columns) instead and keep none of the output's: an empty output of
        # the right shape, and a zero gradient for the kernel.
        size = kernel.shape[0]
        fill = [[0, 0], [0, size if empty[0] else 0], [0, size if empty[1] else 0], [0, 0]]
        outputs = _conv2d_channels_last(ops.pad(inputs, fill), kernel, strides, padding, bias)
        return outputs[:, : 0 if empty[0] else None, : 0 if empty[1] else None]
    if keras.backend.backend() != "torch":
        outputs = ops.conv(inputs, kernel, strides=strides, padding=padding)
        return outputs if bias is None else outputs + bias
    import torch.nn.functional as F

    inputs = ops.convert_to_tensor(inputs)
    kernel = ops.convert_to_tensor(kernel)
    size = kernel.shape[0]
    pad = 0
    if padding == "same":
        # TensorFlow's "same": any odd total padding goes after, not before.
        pads = []
        for length in inputs.shape[1:3]:
            total = max((-(-length // strides) - 1) * strides + size - length, 0)
            pads.append((total // 2, total - total // 2))
        if all(before == after for before, after in pads):
            pad = (pads[0][0], pads[1][0])
        else:
            inputs = F.pad(inputs, (0, 0, pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
    bias = None if bias is None else ops.convert_to_tensor(bias)
    # The kernel in torch's own layout: `normalized_kernel` already lays it out
    # so (no copy here); other kernels are copied (they are small). For one
    # image and one output channel torch takes a slow path whose backward
    # refuses a permuted kernel view ("grad_weight must be contiguous").
    kernel = kernel.permute(3, 2, 0, 1).contiguous()
    outputs = F.conv2d(inputs.permute(0, 3, 1, 2), kernel, bias, stride=strides, padding=pad)
    return outputs.permute(0, 2, 3, 1)

