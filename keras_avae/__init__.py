"""keras-avae: deep attentive variational autoencoders for Keras 3."""

from keras_avae import datasets
from keras_avae import distributions
from keras_avae import evaluation
from keras_avae import layers
from keras_avae import models
from keras_avae import ops
from keras_avae import training
from keras_avae import zoo

__version__ = "0.1.0.dev0"
