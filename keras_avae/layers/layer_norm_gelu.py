"""`x + GELU(LayerNorm(x))`: the context normalisation of the attentive VAE (paper eq. 5-6)."""

import keras
from keras import ops

from keras_avae._validation import check_finite_number


@keras.saving.register_keras_serializable(package="keras_avae")
class LayerNormGelu(keras.layers.Layer):
    """`x + GELU(LayerNorm(x))`, the normalisation of paper eq. 5-6.

    LayerNorm statistics in float32; GELU is the tanh approximation (as the
    reference's `tfa.activations.gelu`).

    Args:
        epsilon: positive float, the LayerNorm epsilon. Defaults to `1e-5`
            (the reference's).
        regularizer: regularizer for the LayerNorm's gamma and beta.
        **kwargs: base layer arguments.

    Example:

    >>> import numpy as np
    >>> tuple(LayerNormGelu()(np.ones((2, 4, 4, 3), "float32")).shape)
    (2, 4, 4, 3)
    """

    def __init__(self, epsilon=1e-5, regularizer=None, **kwargs):
        super().__init__(**kwargs)
        # Checked here, as `DepthwiseAttend` does: Keras' LayerNormalization
        # takes any epsilon, and a negative or NaN one gave NaN outputs
        # silently (a string, a TypeError at the first call).
        check_finite_number(epsilon, "epsilon", lambda v: v > 0, "> 0")
        self.epsilon = float(epsilon)  # NumPy's too, stored as a Python float
        self.regularizer = keras.regularizers.get(regularizer)
        self.norm = keras.layers.LayerNormalization(
            epsilon=self.epsilon,
            gamma_regularizer=self.regularizer,
            beta_regularizer=self.regularizer,
            dtype=self.dtype_policy,
            name="layer_norm",
        )

    def build(self, input_shape):
        self.norm.build(input_shape)

    def call(self, inputs):
        return inputs + ops.gelu(self.norm(inputs), approximate=True)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"epsilon": self.epsilon, "regularizer": keras.regularizers.serialize(self.regularizer)})
        return config
