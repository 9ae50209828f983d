"""Functional forms of keras-avae's numerics, for users with their own layers."""

from keras_avae.ops.favor import favor_attention
from keras_avae.ops.favor import favor_feature_map
from keras_avae.ops.favor import orthogonal_random_features
