"""Both VAEs through the model-level harness (`TestCase.run_vae_model_test`)."""

from keras_avae.models.discrete_vae import DiscreteVAE
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from tests.models import test_discrete_vae
from tests.models import test_hierarchical_vae
from tests.models.test_hierarchical_vae import shapes_batch
from tests.test_case import TestCase


class TestModelHarness(TestCase):
    def test_hierarchical_vae(self):
        self.run_vae_model_test(HierarchicalVAE, test_hierarchical_vae.TINY, shapes_batch(4), mixed_precision_atol=2.0)

    def test_hierarchical_vae_performer_logistic_mixture(self):
        config = dict(
            test_hierarchical_vae.TINY,
            image_shape=(8, 8, 3),
            likelihood="logistic_mixture",
            nonlocal_attention="performer",
            nonlocal_num_random_features=8,
        )
        x = shapes_batch(4).repeat(3, axis=-1) * 2.0 - 1.0
        self.run_vae_model_test(HierarchicalVAE, config, x)

    def test_discrete_vae(self):
        self.run_vae_model_test(DiscreteVAE, test_discrete_vae.TINY, shapes_batch(4), mixed_precision_atol=2.0)
