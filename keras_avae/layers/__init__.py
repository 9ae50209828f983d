"""Backend-agnostic Keras 3 layers of keras-avae."""

from keras_avae.layers.depthwise_attend import DepthwiseAttend
from keras_avae.layers.discretized_logistic_mixture import (
    DiscretizedLogisticMixture,
)
from keras_avae.layers.gumbel_softmax_sampler import GumbelSoftmaxSampler
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.layers.performer_attention import PerformerAttention
