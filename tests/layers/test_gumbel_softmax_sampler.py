import inspect
import json

import keras
import numpy as np
import pytest
from keras import ops
from scipy import stats

from keras_avae.layers import GumbelSoftmaxSampler
from tests.test_case import BACKEND, TestCase, input_gradient, to_numpy

# Significance level of every statistical test in this file. The seeds are
# fixed, so each test is deterministic on a given backend; ALPHA bounds the
# chance that a correct sampler fails it with a fresh seed.
ALPHA = 1e-3

PROBS = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
# Softmax is shift-invariant: the offset checks that only differences matter.
LOGITS = np.log(PROBS) + 1.7


def _tiled_logits(n, logits=LOGITS):
    return np.tile(logits, (n, 1)).astype("float32")



class TestGumbelSoftmaxSampler(TestCase):
    def test_layer_deterministic_inference(self):
        # "mode" inference is deterministic, so eager/XLA and saved/loaded
        # predictions can be compared; fit still samples (training=True).
        self.run_layer_test(
            GumbelSoftmaxSampler,
            {"temperature": 0.5, "hard": True, "inference_mode": "mode", "seed": 1},
            np.random.RandomState(0).normal(size=(2, 3, 5)).astype("float32"),
            expected_output_shape=(2, 3, 5),
            expected_num_trainable_weights=0,
        )

    def test_layer_sampling(self):
        # Sampling draws anew on every call, so outputs of different calls
        # cannot be compared: no XLA or save/load comparison here (see
        # test_sampling_under_jit for XLA).
        self.run_layer_test(
            GumbelSoftmaxSampler,
            {"temperature": 0.5, "seed": 1},
            np.random.RandomState(0).normal(size=(2, 3, 5)).astype("float32"),
            expected_output_shape=(2, 3, 5),
            expected_num_trainable_weights=0,
            run_jit_check=False,
            run_saving_check=False,
        )

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"temperature": 0.3, "hard": False, "axis": 0, "inference_mode": "sample", "seed": 4},
            {"temperature": 0.3, "hard": True, "axis": -2, "inference_mode": "mode", "seed": 4},
        ],
    )
    def test_every_argument_survives_the_config_round_trip(self, kwargs):
        # Protects get_config: an argument missing from it (e.g. temperature)
        # falls back to its default in the revived layer.
        assert set(kwargs) == set(inspect.signature(GumbelSoftmaxSampler.__init__).parameters) - {"self", "kwargs"}
        layer = GumbelSoftmaxSampler(**kwargs)
        revived = GumbelSoftmaxSampler.from_config(layer.get_config())
        for name, value in kwargs.items():
            assert getattr(revived, name) == value, name
        # Same seed, same samples (training=True samples in "mode" too).
        x = np.random.RandomState(5).normal(size=(3, 4)).astype("float32")
        samples = to_numpy(layer(x, training=True))
        np.testing.assert_array_equal(to_numpy(revived(x, training=True)), samples)
        np.testing.assert_array_equal(to_numpy(revived(x)), to_numpy(layer(x)))
        if not kwargs["hard"]:  # the soft samples do depend on the temperature
            default = GumbelSoftmaxSampler(**{**kwargs, "temperature": 1.0})
            assert not np.allclose(to_numpy(default(x, training=True)), samples, atol=1e-3)

    def test_gumbel_max_matches_categorical(self):
        n = 20000
        y = to_numpy(GumbelSoftmaxSampler(hard=True, seed=7)(_tiled_logits(n)))
        counts = y.sum(axis=0)
        _, p_value = stats.chisquare(counts, n * PROBS)
        assert p_value > ALPHA, (counts, p_value)
        # Power: the same counts reject a categorical off by 0.02 in two cells.
        other = np.array([0.48, 0.27, 0.15, 0.07, 0.03])
        _, p_other = stats.chisquare(counts, n * other)
        assert p_other < ALPHA, p_other

    def test_relaxed_samples_follow_concrete_distribution(self):
        import tensorflow as tf
        import tensorflow_probability as tfp

        n, temperature = 4000, 0.6
        logits = LOGITS[:3]
        concrete = tfp.distributions.RelaxedOneHotCategorical(
            tf.constant(temperature, tf.float64), logits=tf.constant(logits, tf.float64)
        )
        theirs = concrete.sample(n, seed=(11, 12)).numpy()

        def two_sample_p_values(ours):
            # One KS test per coordinate, Bonferroni-corrected, and a Welch
            # t-test on the Concrete log-density of the samples.
            ks = [stats.ks_2samp(ours[:, k], theirs[:, k]).pvalue * len(logits) for k in range(len(logits))]
            log_density = stats.ttest_ind(
                concrete.log_prob(ours).numpy(), concrete.log_prob(theirs).numpy(), equal_var=False
            ).pvalue
            return min(ks), log_density

        sampler = GumbelSoftmaxSampler(temperature=temperature, seed=3)
        ours = to_numpy(sampler(_tiled_logits(n, logits)))
        ks, log_density = two_sample_p_values(ours)
        assert ks > ALPHA and log_density > ALPHA, (ks, log_density)
        # Power: samples at a temperature 0.25 off are rejected.
        wrong = to_numpy(sampler(_tiled_logits(n, logits), temperature=0.85))
        ks, log_density = two_sample_p_values(wrong)
        assert min(ks, log_density) < ALPHA, (ks, log_density)

    def test_low_temperature_approaches_one_hot(self):
        x = _tiled_logits(2000)
        cold = to_numpy(GumbelSoftmaxSampler(temperature=0.01, seed=5)(x))
        warm = to_numpy(GumbelSoftmaxSampler(temperature=1.0, seed=5)(x))
        hard = to_numpy(GumbelSoftmaxSampler(temperature=1.0, hard=True, seed=5)(x))
        # Same seed, same noise: the argmax does not depend on the temperature.
        np.testing.assert_array_equal(cold.argmax(-1), hard.argmax(-1))
        np.testing.assert_array_equal(warm.argmax(-1), hard.argmax(-1))
        assert np.mean(cold.max(-1) > 0.99) > 0.95
        assert np.mean(warm.max(-1) > 0.99) < 0.2

    def test_temperature_divides_the_perturbed_logits(self):
        x = _tiled_logits(64)
        base = to_numpy(GumbelSoftmaxSampler(temperature=1.0, seed=4)(x))
        for temperature in (0.3, ops.convert_to_tensor(0.3), keras.Variable(0.3)):
            at_call = to_numpy(GumbelSoftmaxSampler(temperature=1.0, seed=4)(x, temperature=temperature))
            self.assertAllClose(at_call, to_numpy(GumbelSoftmaxSampler(temperature=0.3, seed=4)(x)))
            # y = softmax(z / tau): tau * log(y) is z up to a per-row constant.
            scaled = 0.3 * np.log(at_call)
            self.assertAllClose(
                scaled - scaled.mean(-1, keepdims=True),
                np.log(base) - np.log(base).mean(-1, keepdims=True),
                atol=1e-4,
                rtol=1e-4,
            )
        assert not np.allclose(at_call, base, atol=1e-3)

    def test_hard_forward_is_exactly_one_hot(self):
        x = _tiled_logits(500)
        hard = to_numpy(GumbelSoftmaxSampler(temperature=0.7, hard=True, seed=8)(x))
        soft = to_numpy(GumbelSoftmaxSampler(temperature=0.7, seed=8)(x))
        np.testing.assert_array_equal(hard, np.eye(len(PROBS))[soft.argmax(-1)])

    def test_straight_through_gradient_is_the_soft_gradient(self):
        rng = np.random.RandomState(2)
        logits = rng.normal(size=(4, 6)).astype("float32")
        weights = rng.normal(size=(4, 6)).astype("float32")
        temperature = 0.7

        def weighted(hard):
            layer = GumbelSoftmaxSampler(temperature=temperature, hard=hard, seed=9)
            return lambda t: ops.multiply(layer(t), weights)

        soft_grad = to_numpy(input_gradient(weighted(False), logits))
        hard_grad = to_numpy(input_gradient(weighted(True), logits))
        # Closed form: d/dl sum(w * softmax((l + g) / tau)) = y * (w - y.w) / tau.
        y = to_numpy(GumbelSoftmaxSampler(temperature=temperature, seed=9)(logits))
        expected = y * (weights - np.sum(y * weights, -1, keepdims=True)) / temperature
        self.assertAllClose(soft_grad, expected, atol=1e-5, rtol=1e-4)
        self.assertAllClose(hard_grad, soft_grad, atol=1e-6)
        assert np.abs(expected).max() > 1e-2

    def test_annealing_with_a_variable_under_jit(self):
        class Annealed(keras.Model):
            def __init__(self):
                super().__init__()
                self.tau = keras.Variable(100.0, trainable=False, name="tau")
                self.sampler = GumbelSoftmaxSampler(seed=6)

            def call(self, logits):
                return self.sampler(logits, temperature=self.tau)

        model = Annealed()
        model.compile(jit_compile=BACKEND != "torch")
        x = _tiled_logits(400)
        hot = model.predict(x, batch_size=400, verbose=0)
        model.tau.assign(0.01)
        cold = model.predict(x, batch_size=400, verbose=0)
        # Near-uniform rows at tau = 100, near one-hot rows at tau = 0.01.
        assert np.abs(hot - 1.0 / len(PROBS)).max() < 0.05
        assert np.mean(cold.max(-1) > 0.99) > 0.95

    def test_sampling_under_jit(self):
        inputs = keras.Input((5,))
        model = keras.Model(inputs, GumbelSoftmaxSampler(seed=2)(inputs))
        model.compile(jit_compile=BACKEND != "torch")
        x = _tiled_logits(8)
        first = model.predict(x, verbose=0)
        second = model.predict(x, verbose=0)
        # The seed generator advances inside the compiled function.
        assert not np.allclose(first, second)
        self.assertAllClose(first.sum(-1), np.ones(8), atol=1e-5)

    def test_inference_modes(self):
        x = _tiled_logits(16) + np.random.RandomState(3).normal(size=(16, 5)).astype("float32")
        mode = GumbelSoftmaxSampler(inference_mode="mode", seed=1)
        expected = np.eye(5)[x.argmax(-1)]
        np.testing.assert_array_equal(to_numpy(mode(x)), expected)
        np.testing.assert_array_equal(to_numpy(mode(x, training=False)), expected)
        sampled = to_numpy(mode(x, training=True))
        assert not np.allclose(sampled, expected)
        # The default samples at inference too.
        default = GumbelSoftmaxSampler(seed=1)
        assert not np.allclose(to_numpy(default(x, training=False)), to_numpy(default(x, training=False)))

    def test_axis(self):
        x = np.random.RandomState(4).normal(size=(3, 4, 2)).astype("float32")
        y = to_numpy(GumbelSoftmaxSampler(hard=True, axis=1, seed=0)(x))
        self.assertAllClose(y.sum(axis=1), np.ones((3, 2)))
        assert set(np.unique(y)) == {0.0, 1.0}
        mode = to_numpy(GumbelSoftmaxSampler(axis=-2, inference_mode="mode")(x))
        np.testing.assert_array_equal(mode, np.moveaxis(np.eye(4)[x.argmax(axis=1)], -1, 1))

    def test_mixed_precision_hard_is_exact(self):
        layer = GumbelSoftmaxSampler(hard=True, seed=3, dtype="mixed_float16")
        y = layer(ops.cast(_tiled_logits(50), "float16"))
        assert keras.backend.standardize_dtype(y.dtype) == "float16"
        y = to_numpy(y)
        np.testing.assert_array_equal(y.sum(-1), np.ones(50))
        assert set(np.unique(y)) == {0.0, 1.0}

    def test_invalid_arguments(self):
        for kwargs, name in [
            ({"temperature": 0.0}, "temperature"),
            ({"temperature": -1.0}, "temperature"),
            ({"temperature": "1"}, "temperature"),
            ({"temperature": True}, "temperature"),
            ({"hard": 1}, "hard"),
            ({"axis": 1.0}, "axis"),
            ({"inference_mode": "argmax"}, "inference_mode"),
        ]:
            with pytest.raises(ValueError, match=f"Received: {name}="):
                GumbelSoftmaxSampler(**kwargs)

    @pytest.mark.parametrize("seed", [-1, True, 0.0, "0", 2**31 - 1, 2**32])
    def test_invalid_seed(self, seed):
        # Same range as the other seeded layers; the largest seed still works.
        with pytest.raises(ValueError, match=rf"`seed` must be an integer in \[0, 2147483646\].*seed={seed!r}$"):
            GumbelSoftmaxSampler(seed=seed)

    def test_largest_seed(self):
        y = to_numpy(GumbelSoftmaxSampler(seed=2**31 - 2)(_tiled_logits(3)))
        np.testing.assert_allclose(y.sum(-1), np.ones(3), rtol=1e-6)
        with pytest.raises(ValueError, match="seed=2147483647"):
            GumbelSoftmaxSampler(seed=2**31 - 1)

    @pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 10**400], ids=["inf", "nan", "huge_int"])
    def test_non_finite_temperature(self, temperature):
        with pytest.raises(ValueError, match=rf"`temperature` must be a finite positive.*temperature={temperature}$"):
            GumbelSoftmaxSampler(temperature=temperature)
        call_message = rf"`temperature` must be finite and positive.*temperature={temperature}\b"
        with pytest.raises(ValueError, match=call_message):
            GumbelSoftmaxSampler()(_tiled_logits(2), temperature=temperature)

    @pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-50])
    @pytest.mark.parametrize("hard", [False, True])
    def test_tiny_temperatures_give_one_hot_samples(self, temperature, hard):
        # Before: from about 1e-38 the tempered logits overflowed float32 and
        # the samples were NaN (hard ones too: they add the soft sample).
        logits = np.array([[1000.0, 999.0, -5.0, 0.0]] * 64, "float32")
        y = np.sort(to_numpy(GumbelSoftmaxSampler(temperature=temperature, hard=hard, seed=3)(logits)), axis=-1)
        np.testing.assert_array_equal(y[:, :3], 0.0)
        if hard:
            np.testing.assert_array_equal(y[:, 3], 1.0)
        else:
            # The softmax kernel's own rounding: TensorFlow's gave 1 - 2**-24
            # on CI's machine, 1.0 on others.
            np.testing.assert_allclose(y[:, 3], 1.0, rtol=0, atol=2**-23)
        sampler = GumbelSoftmaxSampler(temperature=temperature, hard=hard, seed=3)
        assert np.all(np.isfinite(to_numpy(input_gradient(lambda x: sampler(x)[:, 0], logits))))

    def test_invalid_call_arguments(self):
        x = _tiled_logits(2)
        with pytest.raises(ValueError, match="Received: temperature=0"):
            GumbelSoftmaxSampler()(x, temperature=0)
        with pytest.raises(ValueError, match="Received: axis=2"):
            GumbelSoftmaxSampler(axis=2)(x)

    @pytest.mark.parametrize(
        "temperature",
        [np.float32(-2.0), np.array(-2.0), np.float64("nan"), np.array([[0.5], [-1.0]]), "tensor"],
        ids=["numpy_scalar", "0d_array", "numpy_nan", "broadcast_array", "tensor"],
    )
    def test_concrete_call_temperatures_are_checked(self, temperature):
        # Before: only Python numbers were checked; -2.0 gave one-hot samples, NaN gave NaN.
        if isinstance(temperature, str):
            temperature = ops.convert_to_tensor(-2.0)
        message = r"`temperature` must be finite and positive\. Received: temperature(=| of shape)"
        with pytest.raises(ValueError, match=message):
            GumbelSoftmaxSampler(seed=0)(_tiled_logits(2), temperature=temperature)
        # Positive broadcastable values still work.
        y = to_numpy(GumbelSoftmaxSampler(seed=0)(_tiled_logits(2), temperature=np.array([[0.5], [2.0]], "float32")))
        self.assertAllClose(y.sum(-1), np.ones(2), atol=1e-5)

    def test_traced_call_temperature_is_not_checked(self):
        # A tensor input of a (jit-compiled) functional model has no values to check.
        logits, tau = keras.Input((5,)), keras.Input((1,))
        model = keras.Model([logits, tau], GumbelSoftmaxSampler(seed=2)(logits, temperature=tau))
        model.compile(jit_compile=BACKEND != "torch")
        y = model.predict([_tiled_logits(4), np.full((4, 1), 0.5, "float32")], verbose=0)
        self.assertAllClose(y.sum(-1), np.ones(4), atol=1e-5)

    def test_numpy_arguments_are_stored_as_python_numbers(self):
        # Before: np.float32(0.5) and np.int64(0) were refused ("Received: axis=0").
        layer = GumbelSoftmaxSampler(temperature=np.float32(0.5), axis=np.int64(0), seed=np.int64(3))
        config = layer.get_config()
        assert [type(config[k]) for k in ("temperature", "axis", "seed")] == [float, int, int]
        json.dumps(keras.saving.serialize_keras_object(layer))
        x = _tiled_logits(3)
        twin = GumbelSoftmaxSampler(temperature=0.5, axis=0, seed=3)
        np.testing.assert_array_equal(to_numpy(layer(x)), to_numpy(twin(x)))
        with pytest.raises(ValueError, match=r"Received: axis='0'$"):
            GumbelSoftmaxSampler(axis="0")
