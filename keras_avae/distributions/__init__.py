"""Distributions used by keras-avae's likelihoods."""

from keras_avae.distributions.discretized_logistic_mixture import (
    DiscretizedLogisticMixtureDistribution,
)
