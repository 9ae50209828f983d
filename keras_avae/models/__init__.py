"""keras-avae models."""

from keras_avae.models.discrete_vae import DiscreteVAE
from keras_avae.models.discrete_vae import GumbelTemperatureSchedule
from keras_avae.models.elbo_model import ELBOModel
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from keras_avae.layers.layer_norm_gelu import LayerNormGelu
