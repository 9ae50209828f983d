"""The Gumbel-softmax (categorical-latent) VAE."""

import keras
import numpy as np
import pytest

from keras_avae.models.discrete_vae import DiscreteVAE
from keras_avae.models.discrete_vae import GumbelTemperatureSchedule
from tests.models.test_hierarchical_vae import shapes_batch
from tests.test_case import TestCase
from tests.test_case import to_numpy

TINY = dict(image_shape=(8, 8, 1), num_latents=4, num_categories=3, filters=4, hidden_units=16, seed=0)


def log_px_given_every_code(model, x):
    """`log p(x|z)` of each image for each of the 9 codes of 2 latents x 3 classes, `(B, 9)`, in NumPy."""
    codes = np.stack([np.eye(3)[[a, b]] for a in range(3) for b in range(3)]).astype("float32")
    logits = to_numpy(model.decode(codes))  # (9, 8, 8, 1)
    return np.stack(
        [(x * -np.logaddexp(0, -t) + (1 - x) * -np.logaddexp(0, t)).reshape(len(x), -1).sum(-1) for t in logits],
        axis=1,
    )


@pytest.mark.parametrize(
    "name, value, message",
    [
        # crop: accepted before, and a crop of half the image scored every image 0 nats.
        ("crop", -1, "non-negative int smaller than half"),
        ("crop", 4, "non-negative int smaller than half"),
        ("crop", True, "non-negative int smaller than half"),
        # These named `hard`, `filters` or `units` (a Keras layer's argument).
        ("straight_through", "no", "a bool"),
        ("straight_through", np.True_, "a bool"),
        ("image_shape", (8, 8, 0), "three positive ints"),
        ("image_shape", (0, 0, 1), "three positive ints"),
        ("l2", -1.0, "finite number >= 0"),
        ("seed", -2, "an integer in"),
    ],
)
def test_bad_constructor_values_name_their_argument(name, value, message):
    with pytest.raises(ValueError, match=rf"`{name}` must be .*{message}.*Received: {name}="):
        DiscreteVAE(**dict(TINY, **{name: value}))


def test_numpy_ints_make_the_model_python_ints_make():
    sizes = ("num_latents", "num_categories", "filters", "hidden_units", "crop")
    config = dict(TINY, crop=1)
    model = DiscreteVAE(**dict(config, **{name: np.int64(config[name]) for name in sizes}))
    stored = model.get_config()
    assert all(type(stored[name]) is int for name in sizes)
    assert stored == dict(DiscreteVAE(**config).get_config(), name=stored["name"])


class TestDiscreteVAE(TestCase):
    def test_non_finite_weights_raise_instead_of_drawing_nan(self):
        # Before: NaN images came back (`keras-avae sample` drew them black).
        model = DiscreteVAE(**TINY)
        x = shapes_batch(3)
        model(x)
        model.set_weights([np.full_like(w, np.nan) for w in model.get_weights()])
        with pytest.raises(FloatingPointError, match=r"3 of the 3 samples hold non-finite values"):
            model.sample(3)
        # torch's categorical sampler refuses NaN probabilities itself (RuntimeError).
        error = RuntimeError if keras.backend.backend() == "torch" else FloatingPointError
        with pytest.raises(error):
            model.reconstruct(x)

    def test_l2_weighs_every_weight_biases_too(self):
        model = DiscreteVAE(**dict(TINY, l2=1e-3))
        model(shapes_batch(2))
        assert len(model.trainable_weights) == 18
        for variable in model.trainable_weights:  # the biases had none
            assert type(variable.regularizer) is keras.regularizers.L2, variable.path
        expected = 1e-3 * sum(np.sum(to_numpy(v) ** 2) for v in model.trainable_weights)
        np.testing.assert_allclose(sum(to_numpy(term) for term in model.losses), expected, rtol=1e-5)

    def test_kl_to_uniform_matches_numpy(self):
        model = DiscreteVAE(**TINY)
        x = shapes_batch(4)
        out = to_numpy(model(x))
        q = to_numpy(model.encode(x))
        np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
        expected = (q * np.log(q * TINY["num_categories"])).sum(-1)
        np.testing.assert_allclose(out["kl_per_layer"], expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(out["kl"], expected.sum(-1), rtol=1e-4, atol=1e-6)

    def test_training_lowers_the_nelbo_and_anneals_temperature(self):
        model = DiscreteVAE(**dict(TINY, hidden_units=64, num_latents=8))
        x = shapes_batch(16)
        model.compile(optimizer=keras.optimizers.Adam(3e-3))
        schedule = GumbelTemperatureSchedule(initial=1.0, minimum=0.5, rate=0.01, update_every=10)
        history = model.fit(x, batch_size=16, epochs=80, verbose=0, callbacks=[schedule])
        nelbo = history.history["nelbo"]
        # ~44.6 nats at initialisation (pixels at their mean), 30-32 after 80
        # steps on every backend (measured); a broken gradient stays near 44.
        assert nelbo[-1] < 0.8 * nelbo[0], (nelbo[0], nelbo[-1])
        np.testing.assert_allclose(float(to_numpy(model.temperature)), schedule.temperature_at(79), rtol=1e-6)
        assert float(to_numpy(model.temperature)) < 1.0

    def test_importance_sampling_converges_to_the_exact_marginal(self):
        # 2 latents x 3 classes: log p(x) is an exact sum over 9 latent codes.
        model = DiscreteVAE(**dict(TINY, num_latents=2, num_categories=3))
        x = shapes_batch(4)
        log_px_z = log_px_given_every_code(model, x)
        exact = np.logaddexp.reduce(log_px_z + 2 * np.log(1 / 3), axis=1)
        # The estimate's standard deviation, from the exact variance of the
        # importance weights w = p(x, z) / q(z) over the 9 codes (delta method).
        q = to_numpy(model.encode(x))  # (4, 2, 3)
        q_code = np.stack([q[:, 0, a] * q[:, 1, b] for a in range(3) for b in range(3)], axis=1)
        weights = np.exp(log_px_z + 2 * np.log(1 / 3) - np.log(q_code) - exact[:, None])
        num_samples = 2000
        standard_error = np.sqrt(((q_code * weights**2).sum(1) - 1) / num_samples)  # 0.008-0.015 nats here
        estimate = model.log_likelihood(x, num_samples=num_samples, chunk_size=500)
        # 5 standard errors: a fixed 0.02 nats failed on one draw at 3.4 of them.
        np.testing.assert_array_less(np.abs(estimate - exact), 5 * standard_error + 1e-3)
        # A single sample is a lower bound on average (Jensen).
        single = np.mean([model.log_likelihood(x, num_samples=1) for _ in range(50)], axis=0)
        assert np.mean(single) <= np.mean(exact) + 0.01

    def test_inference_call_is_the_discrete_models_elbo(self):
        """`nll` at inference is `-log p(x|z)` for exact draws `z ~ q`: its mean is the enumerated expectation."""
        model = DiscreteVAE(**dict(TINY, num_latents=2, num_categories=3))
        x = shapes_batch(4)
        log_px_z = log_px_given_every_code(model, x)
        q = to_numpy(model.encode(x))  # (4, 2, 3)
        q_codes = np.stack([q[:, 0, a] * q[:, 1, b] for a in range(3) for b in range(3)], axis=1)  # (4, 9)
        expected_nll = -(q_codes * log_px_z).sum(axis=1)
        draws = 500
        nll = to_numpy(model(np.repeat(x, draws, axis=0), training=False))["nll"].reshape(4, draws)
        stderr = nll.std(axis=1, ddof=1) / np.sqrt(draws)
        assert np.all(np.abs(nll.mean(axis=1) - expected_nll) < 4 * stderr + 1e-3), (nll.mean(axis=1), expected_nll)
        # Every value is one of the nine codes' (a hard draw, not a relaxed mixture).
        assert np.all(np.min(np.abs(nll[..., None] + log_px_z[:, None, :]), axis=-1) < 1e-3)
        # The ELBO bounds the exact log p(x).
        exact = np.logaddexp.reduce(log_px_z + 2 * np.log(1 / 3), axis=1)
        kl = to_numpy(model(x, training=False))["kl"]
        assert np.all(-expected_nll - kl <= exact + 1e-4)

    def test_methods(self):
        model = DiscreteVAE(**TINY)
        x = shapes_batch(4)
        assert tuple(model.sample(3).shape) == (3, 8, 8, 1)
        recon = to_numpy(model.reconstruct(x))
        assert recon.shape == x.shape and 0 <= recon.min() and recon.max() <= 1
        with pytest.raises(ValueError, match="num_categories"):
            DiscreteVAE(**dict(TINY, num_categories=1))

    def test_inference_methods_are_compiled_passes_that_draw_what_eager_calls_draw(self):
        # Before, they ran eagerly: on JAX each primitive compiled on first
        # use, on PyTorch every call recorded an autograd graph.
        model = DiscreteVAE(**TINY)
        model.build()
        x = shapes_batch(4)
        decoded = []
        decode = model.decode
        model.decode = lambda z, training=None: decoded.append(1) or decode(z, training=training)
        state = to_numpy(model.seed_generator.state).copy()
        passes = [model.reconstruct(x), model.reconstruct(x), model.sample(3), model.sample(3)]
        # Compiled on JAX: traced once per shape; run on every call elsewhere.
        assert len(decoded) == (2 if keras.backend.backend() == "jax" else 4)
        model.seed_generator.state.assign(state)
        eager = [model._reconstruct_pass(x), model._reconstruct_pass(x), model._sample_pass(3), model._sample_pass(3)]
        for got, expected in zip(passes, eager):
            np.testing.assert_allclose(got, to_numpy(expected), atol=1e-6)
        assert not np.allclose(passes[2], passes[3])  # the seed state advanced between calls
        np.testing.assert_allclose(model.encode(x), np.exp(to_numpy(model.bottom_up(x))), rtol=1e-6)

    def test_save_and_load_round_trip(self, tmp_path):
        model = DiscreteVAE(**TINY)
        model.build()
        x = shapes_batch(4)
        path = str(tmp_path / "dvae.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        assert isinstance(restored, DiscreteVAE)
        self.assertAllClose(restored.encode(x), model.encode(x), atol=1e-6)


class TestInferenceInputs(TestCase):
    @pytest.fixture(scope="class")
    def model(self):
        model = DiscreteVAE(**TINY)
        model.build()
        return model

    @pytest.mark.parametrize("value", [np.nan, np.inf])
    def test_non_finite_images_name_the_argument(self, model, value):
        x = shapes_batch(3)
        x[1, 0, 0, 0] = value
        pattern = r"`x` contains 1 non-finite values \(NaN or inf\), in images \[1\]\. Received: x with shape \(3, 8, 8, 1\)"
        for method in (model.log_likelihood, model.reconstruct, model.encode):
            with pytest.raises(ValueError, match=pattern):
                method(x)

    def test_empty_batch_names_the_argument(self, model):
        for method in (model.log_likelihood, model.reconstruct, model.encode):
            with pytest.raises(ValueError, match=r"`x` is an empty batch"):
                method(np.zeros((0, 8, 8, 1), "float32"))

    def test_bad_num_samples_and_temperature(self, model):
        for num_samples in (0, 1.5, False):
            with pytest.raises(ValueError, match=r"`num_samples` must be a positive int"):
                model.sample(num_samples)
        with pytest.raises(ValueError, match=r"`temperature` must be a finite positive number\. Received: temperature=inf"):
            DiscreteVAE(**dict(TINY, temperature=float("inf")))

    def test_inference_methods_return_numpy_arrays(self, model):
        x = shapes_batch(2)
        log_px = model.log_likelihood(x, num_samples=2)
        assert type(log_px) is np.ndarray and log_px.dtype == np.float64
        for out in (model.sample(2), model.reconstruct(x), model.encode(x)):
            assert type(out) is np.ndarray and out.dtype == np.float32
