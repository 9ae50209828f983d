"""keras-avae models."""

from keras_avae.models.hierarchical_vae import HierarchicalVAE
from keras_avae.models.hierarchical_vae import LayerNormGelu
