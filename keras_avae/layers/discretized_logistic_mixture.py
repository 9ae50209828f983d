"""Output head that maps features to a discretized logistic mixture."""

import keras

from keras_avae._validation import check_positive_int
from keras_avae.distributions.discretized_logistic_mixture import (
    DiscretizedLogisticMixtureDistribution,
)


@keras.saving.register_keras_serializable(package="keras_avae")
class DiscretizedLogisticMixture(keras.layers.Layer):
    """Image likelihood head: a convolution to PixelCNN++ mixture parameters.

    Maps features `(B, H, W, F)` with a `kernel_size` convolution ("same"
    padding) to the `P` parameters per pixel of a mixture of `num_mixtures`
    discretized logistics and returns a
    `keras_avae.distributions.DiscretizedLogisticMixtureDistribution`, whose
    `log_prob(x)`, `sample()` and `mean()` give the likelihood, samples and
    mean image (see that class for the parameter layout and the edge bins).
    `P = 10 * num_mixtures` for RGB, `3 * num_mixtures` for one channel.

    In the functional API the returned distribution holds `KerasTensor`
    parameters, so `log_prob` and `mean` build graph operations:
    `keras.Model([features, x], head(features).log_prob(x))` works, trains
    and saves. `sample` draws random numbers and needs concrete parameters
    (call it inside a `call()`, or on a model's outputs).

    Reference:
        - [Salimans et al., 2017](https://arxiv.org/abs/1701.05517),
          PixelCNN++: Improving the PixelCNN with Discretized Logistic
          Mixture Likelihood and Other Modifications.

    Args:
        num_mixtures: int, number of mixture components `K`. Defaults to 10
            (NVAE; PixelCNN++ and the paper's reference use 5 and 10).
        num_channels: 1 or 3, image channels. Defaults to 3.
        num_bins: int >= 2, pixel levels. Defaults to 256.
        kernel_size: int or tuple of 2 ints, the convolution's window.
            Defaults to 1.
        reference_edge_bug: bool. If `True`, the distribution reproduces the
            reference's `x > 0.99` upper-edge test, whose pmf sums to more
            than 1 (for comparisons with published numbers only). Defaults to
            `False`.
        kernel_initializer: initializer of the convolution kernel.
        bias_initializer: initializer of the convolution bias.
        kernel_regularizer: optional regularizer of the kernel.
        bias_regularizer: optional regularizer of the bias.
        **kwargs: base layer keyword arguments (`name`, `dtype`, ...).

    Call arguments:
        features: float tensor `(B, H, W, F)`.

    Returns:
        A `DiscretizedLogisticMixtureDistribution` over `(B, H, W, C)` images
        whose parameters `(B, H, W, P)` are in the layer's compute dtype
        (`log_prob` is float32 regardless).

    Example:

    >>> features = keras.Input((8, 8, 16))
    >>> images = keras.Input((8, 8, 3))
    >>> dist = DiscretizedLogisticMixture(num_mixtures=5)(features)
    >>> model = keras.Model([features, images], dist.log_prob(images))
    >>> model.output.shape
    (None,)
    """

    def __init__(
        self,
        num_mixtures=10,
        num_channels=3,
        num_bins=256,
        kernel_size=1,
        reference_edge_bug=False,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # NumPy integers are stored as Python ints (the config must serialise).
        num_mixtures = check_positive_int(num_mixtures, "num_mixtures")
        DiscretizedLogisticMixtureDistribution.check_arguments(num_channels, num_bins, reference_edge_bug)
        if isinstance(kernel_size, (tuple, list)):
            if len(kernel_size) not in (1, 2):
                raise ValueError(f"`kernel_size` must be an int or 2 ints. Received: kernel_size={kernel_size!r}")
            kernel_size = type(kernel_size)(check_positive_int(size, "kernel_size") for size in kernel_size)
        else:
            kernel_size = check_positive_int(kernel_size, "kernel_size")
        self.num_mixtures = num_mixtures
        self.num_channels = int(num_channels)
        self.num_bins = int(num_bins)
        self.kernel_size = kernel_size
        self.reference_edge_bug = reference_edge_bug
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)

    @property
    def num_params(self):
        return DiscretizedLogisticMixtureDistribution.num_params(self.num_mixtures, self.num_channels)

    def build(self, features_shape):
        if len(features_shape) != 4:
            raise ValueError(f"`features` must have shape (B, H, W, F). Received: features_shape={features_shape}")
        self.projection = keras.layers.Conv2D(
            self.num_params,
            self.kernel_size,
            padding="same",
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            dtype=self.dtype_policy,
            name="projection",
        )
        self.projection.build(features_shape)
        self.built = True

    def _distribution(self, params):
        return DiscretizedLogisticMixtureDistribution(
            params,
            num_channels=self.num_channels,
            num_bins=self.num_bins,
            reference_edge_bug=self.reference_edge_bug,
        )

    def call(self, features):
        return self._distribution(self.projection(features))

    def compute_output_shape(self, features_shape):
        """The shape of the returned distribution's parameters."""
        return tuple(features_shape[:-1]) + (self.num_params,)

    def compute_output_spec(self, features):
        if type(self).call is not DiscretizedLogisticMixture.call:
            # A subclass's own `call` may return something else: trace it (Keras'
            # `Layer` would use the inherited `compute_output_shape`).
            return keras.Operation.compute_output_spec(self, features)
        params = keras.KerasTensor(self.compute_output_shape(features.shape), dtype=self.compute_dtype)
        return self._distribution(params)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_mixtures": self.num_mixtures,
                "num_channels": self.num_channels,
                "num_bins": self.num_bins,
                "kernel_size": self.kernel_size,
                "reference_edge_bug": self.reference_edge_bug,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
            }
        )
        return config
