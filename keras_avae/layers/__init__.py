"""Backend-agnostic Keras 3 layers of keras-avae."""

from keras_avae.layers.batch_normalization import BatchNormalization
from keras_avae.layers.depthwise_attend import DepthwiseAttend
from keras_avae.layers.discretized_logistic_mixture import (
    DiscretizedLogisticMixture,
)
from keras_avae.layers.gumbel_softmax_sampler import GumbelSoftmaxSampler
from keras_avae.layers.layer_norm_gelu import LayerNormGelu
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.layers.performer_attention import PerformerAttention
from keras_avae.layers.residual_cell import ResidualCell
from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D
