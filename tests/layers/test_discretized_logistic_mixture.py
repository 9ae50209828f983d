import inspect
import json

import keras
import numpy as np
import pytest
from scipy import special
from scipy import stats

from keras_avae.distributions import DiscretizedLogisticMixtureDistribution
from keras_avae.layers import DiscretizedLogisticMixture
from tests.test_case import BACKEND, TestCase, input_gradient, to_numpy

# Significance level of every statistical test in this file (seeds are fixed,
# so each test is deterministic on a given backend).
ALPHA = 1e-3


def _levels(num_bins=256):
    return -1.0 + 2.0 * np.arange(num_bins) / (num_bins - 1)


def _random_params(rng, shape, num_mixtures, num_channels, log_scale_range=(-4.5, -0.5)):
    """Parameters in the documented layout, with realistic ranges."""
    k = num_mixtures
    logits = rng.normal(0.0, 1.5, size=shape + (k,))
    slots = []
    for _ in range(num_channels):
        slots.append(rng.uniform(-1.1, 1.1, size=shape + (k,)))
        slots.append(rng.uniform(*log_scale_range, size=shape + (k,)))
        if num_channels == 3:
            slots.append(rng.normal(0.0, 1.0, size=shape + (k,)))
    return np.concatenate([logits] + slots, axis=-1).astype("float32")


def _numpy_log_prob(params, x, num_bins=256):
    """Per-pixel log-probability of RGB or grey images, NumPy float64.

    Written from the PixelCNN++ equations, unpacking by reshape as the
    reference does (`params[..., K:]` -> `(..., C, 3K)` for RGB).
    """
    params = params.astype(np.float64)
    x = x.astype(np.float64)
    num_channels = x.shape[-1]
    k = params.shape[-1] // (10 if num_channels == 3 else 3)
    rest = params[..., k:].reshape(params.shape[:-1] + (num_channels, -1))
    means = rest[..., :k]
    log_scales = np.maximum(rest[..., k : 2 * k], -7.0)
    x = x[..., None]  # (..., C, 1)
    if num_channels == 3:
        c = np.tanh(rest[..., 2 * k : 3 * k])
        means = np.stack(
            [
                means[..., 0, :],
                means[..., 1, :] + c[..., 0, :] * x[..., 0, :],
                means[..., 2, :] + c[..., 1, :] * x[..., 0, :] + c[..., 2, :] * x[..., 1, :],
            ],
            axis=-2,
        )
    h = 1.0 / (num_bins - 1)
    s = np.exp(log_scales)
    upper = special.expit((x + h - means) / s)
    lower = special.expit((x - h - means) / s)
    log_mass = np.where(
        upper - lower > 1e-5,
        np.log(np.maximum(upper - lower, 1e-12)),
        # Logistic density at the bin centre times the bin width 2h.
        stats.logistic.logpdf(x, loc=means, scale=s) + np.log(2 * h),
    )
    log_mass = np.where(x < -1 + h, special.log_expit((x + h - means) / s), log_mass)
    log_mass = np.where(x > 1 - h, special.log_expit(-(x - h - means) / s), log_mass)
    joint = special.log_softmax(params[..., :k], axis=-1) + log_mass.sum(axis=-2)
    return special.logsumexp(joint, axis=-1)


def _compiled(fn):
    """`jax.jit(fn)` on JAX, else `fn`.

    Eager JAX compiles every op anew for every new shape, which would
    dominate these tests' run time; the other backends run eagerly.
    """
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return fn


def _grid(num_bins, num_channels):
    """All `num_bins ** num_channels` pixel values, `(N, C)`."""
    axes = np.meshgrid(*[_levels(num_bins)] * num_channels, indexing="ij")
    return np.stack([a.ravel() for a in axes], axis=-1).astype("float32")


def _pmf_over_grid(params, num_channels, num_bins=256, **kwargs):
    """Probabilities of every pixel value at every pixel, `(N, H, W)`.

    `params` is `(1, H, W, P)`; it is tiled over the `N` grid values.
    """
    grid = _grid(num_bins, num_channels)
    x = np.broadcast_to(grid[:, None, None, :], (len(grid),) + params.shape[1:3] + (num_channels,))
    tiled = np.repeat(params, len(grid), axis=0)

    def log_prob(p, v):
        dist = DiscretizedLogisticMixtureDistribution(p, num_channels=num_channels, num_bins=num_bins, **kwargs)
        return dist.log_prob(v, reduce=False)

    return np.exp(to_numpy(_compiled(log_prob)(tiled, x))), grid


def _tfp_single_channel(params, levels):
    """Per-pixel log-pmf from TFP: QuantizedDistribution in 0..255 space."""
    import tensorflow as tf
    import tensorflow_probability as tfp

    tfd = tfp.distributions
    params = params.astype(np.float64)
    k = params.shape[-1] // 3
    logits, means, log_scales = params[..., :k], params[..., k : 2 * k], np.maximum(params[..., 2 * k :], -7.0)
    # x in [-1, 1] maps to y = 127.5 (x + 1) in [0, 255]; level k is the bin
    # [k - 0.5, k + 0.5]. TFP's bins are (y - 1, y] (Y = ceil(X)), hence
    # the shift of the location by -0.5.
    mixture = tfd.MixtureSameFamily(
        tfd.Categorical(logits=tf.constant(logits)),
        tfd.Logistic(loc=tf.constant(127.5 * (means + 1.0) - 0.5), scale=tf.constant(127.5 * np.exp(log_scales))),
    )
    quantized = tfd.QuantizedDistribution(
        mixture, low=tf.constant(0.0, tf.float64), high=tf.constant(255.0, tf.float64)
    )
    return quantized.log_prob(tf.constant(levels, tf.float64)).numpy()



def _chi_square_p_value(counts, probs, min_expected=5.0):
    """Pearson's test, pooling the cells with expected counts below 5."""
    expected = counts.sum() * probs
    small = expected < min_expected
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    # Renormalise away float32 rounding of the pmf (sums to 1 to ~1e-6).
    expected *= observed.sum() / expected.sum()
    return stats.chisquare(observed, expected).pvalue


@keras.saving.register_keras_serializable(package="keras_avae_tests")
def negative_log_likelihood(y_true, y_pred):
    return -y_pred


class TestDiscretizedLogisticMixtureDistribution(TestCase):
    def test_single_channel_matches_tfp(self):
        rng = np.random.RandomState(0)
        params = _random_params(rng, (1, 2, 3), num_mixtures=4, num_channels=1)
        probs, grid = _pmf_over_grid(params, num_channels=1)
        expected = _tfp_single_channel(params[0], np.arange(256.0)[:, None, None])
        # Everywhere to 1e-6 in probability (components whose bin mass is
        # below 1e-5 use PixelCNN++'s mid-point approximation, TFP the exact
        # mass) ...
        np.testing.assert_allclose(probs, np.exp(expected), atol=1e-6)
        # ... and in log space on the bins that carry mass.
        mass = np.exp(expected) > 1e-4
        assert mass.sum() > 100
        np.testing.assert_allclose(np.log(probs[mass]), expected[mass], atol=5e-4)

        # Reduced log-probability of whole images: sum over H and W.
        x = rng.randint(0, 256, size=(5, 2, 3, 1))
        dist = DiscretizedLogisticMixtureDistribution(np.repeat(params, 5, axis=0), num_channels=1)
        log_prob = dist.log_prob(x / 127.5 - 1.0)
        assert keras.backend.standardize_dtype(log_prob.dtype) == "float32"
        assert tuple(log_prob.shape) == (5,)
        expected = _tfp_single_channel(params[0], x[..., 0].astype(np.float64)).sum(axis=(1, 2))
        # Random levels fall in the tails too, where the mid-point
        # approximation differs from TFP's exact mass by up to a few 1e-4.
        self.assertAllClose(log_prob, expected, atol=5e-3, rtol=0)

    def test_pmf_sums_to_one(self):
        rng = np.random.RandomState(1)
        k = 3
        shape = (1, 2, 4, k)
        regimes = {"random": _random_params(rng, shape[:-1], num_mixtures=k, num_channels=1)}
        # Log-scales below the -7 floor, means anywhere, one on a bin boundary.
        regimes["tiny_scales"] = np.concatenate(
            [rng.normal(size=shape), rng.uniform(-1, 1, size=shape), np.full(shape, -9.0)], axis=-1
        )
        regimes["tiny_scales"][0, 0, 0, k] = -1.0 + 1.0 / 255
        regimes["near_edges"] = np.concatenate(
            [
                rng.normal(size=shape),
                rng.choice([-1.02, -1.0, -0.996, 0.993, 0.998, 1.0, 1.01], size=shape),
                rng.uniform(-7.0, -3.0, size=shape),
            ],
            axis=-1,
        )
        regimes["wide"] = np.concatenate(
            [rng.normal(size=shape), rng.uniform(-1, 1, size=shape), rng.uniform(1.0, 4.0, size=shape)], axis=-1
        )
        regimes["far_outside"] = np.concatenate(
            [rng.normal(size=shape), rng.choice([-3.0, 3.0], size=shape), rng.uniform(-3.0, -1.0, size=shape)],
            axis=-1,
        )
        for regime, params in regimes.items():
            probs, _ = _pmf_over_grid(params.astype("float32"), num_channels=1)
            np.testing.assert_allclose(probs.sum(axis=0), 1.0, atol=1e-5, err_msg=regime)

    def test_reference_edge_bug_overcounts_the_top_level(self):
        # A mixture with visible mass at the top levels.
        params = np.array([[[[0.0, 0.0, 0.97, 0.5, -3.5, -2.0]]]], "float32")
        correct, _ = _pmf_over_grid(params, num_channels=1)
        buggy, _ = _pmf_over_grid(params, num_channels=1, reference_edge_bug=True)
        np.testing.assert_allclose(correct.sum(), 1.0, atol=1e-5)
        # Level 254 gets the whole upper tail: the excess is p(255).
        assert correct[255, 0, 0] > 0.05
        np.testing.assert_allclose(buggy.sum() - 1.0, correct[255, 0, 0], rtol=1e-4)
        np.testing.assert_allclose(buggy[:254], correct[:254], rtol=1e-6)

    def test_rgb_log_prob_matches_numpy(self):
        rng = np.random.RandomState(2)
        params = _random_params(rng, (3, 4, 2), num_mixtures=3, num_channels=3)
        x = (rng.randint(0, 256, size=(3, 4, 2, 3)) / 127.5 - 1.0).astype("float32")
        # Half the images near a component mean, where the mass is.
        near = np.clip(params[..., 3:6].mean(-1, keepdims=True) + rng.normal(0, 0.05, size=(3, 4, 2, 3)), -1, 1)
        x[:2] = (np.round((near[:2] + 1) * 127.5) / 127.5 - 1.0).astype("float32")
        per_pixel, per_image = _compiled(
            lambda p, v: (
                DiscretizedLogisticMixtureDistribution(p).log_prob(v, reduce=False),
                DiscretizedLogisticMixtureDistribution(p).log_prob(v),
            )
        )(params, x)
        expected = _numpy_log_prob(params, x)
        self.assertAllClose(per_pixel, expected, atol=1e-4, rtol=1e-5)
        self.assertAllClose(per_image, expected.sum(axis=(1, 2)), atol=1e-3, rtol=1e-5)

    def test_single_channel_log_prob_matches_numpy(self):
        rng = np.random.RandomState(3)
        params = _random_params(rng, (2, 3, 3), num_mixtures=5, num_channels=1, log_scale_range=(-8.0, 1.0))
        x = (rng.randint(0, 256, size=(2, 3, 3, 1)) / 127.5 - 1.0).astype("float32")
        log_prob = _compiled(lambda p, v: DiscretizedLogisticMixtureDistribution(p, 1).log_prob(v, reduce=False))
        self.assertAllClose(log_prob(params, x), _numpy_log_prob(params, x), atol=1e-4, rtol=1e-5)

    @pytest.mark.parametrize("num_bins", [8, 16])
    def test_rgb_pmf_sums_to_one(self, num_bins):
        rng = np.random.RandomState(4)
        params = _random_params(rng, (1, 1, 2), num_mixtures=2, num_channels=3, log_scale_range=(-3.0, 0.0))
        probs, grid = _pmf_over_grid(params, num_channels=3, num_bins=num_bins)
        np.testing.assert_allclose(probs.sum(axis=0), 1.0, atol=1e-5)
        # And it is the coupled likelihood, not just any normalised pmf.
        x = np.broadcast_to(grid[:, None, None], (len(grid), 1, 2, 3))
        expected = np.exp(_numpy_log_prob(np.repeat(params, len(grid), 0), x, num_bins))
        np.testing.assert_allclose(probs, expected, atol=1e-6, rtol=1e-4)

    def test_rgb_marginal_of_red_is_the_red_mixture(self):
        # Summing the 256-level RGB pmf over green and blue leaves the red
        # mixture; the first 3K parameters of the RGB layout are exactly the
        # grey layout of the red channel.
        rng = np.random.RandomState(5)
        params = _random_params(rng, (1, 1, 1), num_mixtures=2, num_channels=3, log_scale_range=(-4.0, -1.0))
        green_blue = _grid(256, 2)
        red_pmf, _ = _pmf_over_grid(params[..., :6], num_channels=1)
        log_prob = _compiled(lambda p, v: DiscretizedLogisticMixtureDistribution(p).log_prob(v, reduce=False))
        tiled = np.repeat(params, len(green_blue), 0)
        for red_level in (97, 255):
            red = np.full((len(green_blue), 1), _levels()[red_level], "float32")
            x = np.concatenate([red, green_blue], axis=-1)[:, None, None, :]
            marginal = np.exp(to_numpy(log_prob(tiled, x))).sum()
            np.testing.assert_allclose(marginal, red_pmf[red_level, 0, 0], atol=1e-6, rtol=1e-4)

    def test_samples_follow_the_pmf(self):
        rng = np.random.RandomState(6)
        params = _random_params(rng, (1, 1, 1), num_mixtures=3, num_channels=1, log_scale_range=(-3.0, -1.5))
        probs, _ = _pmf_over_grid(params, num_channels=1)
        n = 20000
        dist = DiscretizedLogisticMixtureDistribution(np.repeat(params, n, 0), num_channels=1)
        samples = to_numpy(dist.sample(seed=keras.random.SeedGenerator(3)))
        self.assertAllClose(samples, np.round((samples + 1) * 127.5) / 127.5 - 1, atol=1e-6)
        counts = np.bincount(np.round((samples.ravel() + 1) * 127.5).astype(int), minlength=256)
        assert _chi_square_p_value(counts, probs[:, 0, 0]) > ALPHA

        # Temperature T samples the same mixture with scales multiplied by T.
        cooled = params.copy()
        cooled[..., 6:] += np.log(0.5)
        cooled_probs, _ = _pmf_over_grid(cooled, num_channels=1)
        sample = _compiled(lambda p: DiscretizedLogisticMixtureDistribution(p, 1).sample(0.5, seed=4))
        samples = to_numpy(sample(dist.params))
        cooled_counts = np.bincount(np.round((samples.ravel() + 1) * 127.5).astype(int), minlength=256)
        assert _chi_square_p_value(cooled_counts, cooled_probs[:, 0, 0]) > ALPHA
        # Power: each sample set rejects the other's pmf.
        assert _chi_square_p_value(counts, cooled_probs[:, 0, 0]) < ALPHA
        assert _chi_square_p_value(cooled_counts, probs[:, 0, 0]) < ALPHA

    def test_rgb_samples_follow_the_coupled_pmf(self):
        # 8 levels per channel: all 512 RGB values get expected counts, and
        # the coarse grid makes the coupling on quantised values visible.
        rng = np.random.RandomState(7)
        params = _random_params(rng, (1, 1, 1), num_mixtures=2, num_channels=3, log_scale_range=(-2.5, -1.5))
        params[..., [6, 7, 12, 13, 18, 19]] = 2.0  # strong couplings: tanh(2) = 0.96
        probs, _ = _pmf_over_grid(params, num_channels=3, num_bins=8)
        n = 20000
        sample = _compiled(lambda p: DiscretizedLogisticMixtureDistribution(p, num_bins=8).sample(seed=5))
        samples = to_numpy(sample(np.repeat(params, n, 0))).reshape(n, 3)
        levels = np.round((samples + 1) * 3.5).astype(int)
        assert _chi_square_p_value(np.bincount(levels @ [64, 8, 1], minlength=512), probs[:, 0, 0]) > ALPHA

        # Power: coupling on the clipped but unquantised previous channels
        # (PixelCNN++'s sampler) gives another pmf, and the test sees it.
        p = params[0, 0, 0].astype(np.float64)
        weights = special.softmax(p[:2])
        slots = p[2:].reshape(3, 6)
        component = np.random.RandomState(0).choice(2, p=weights, size=n)
        mu, log_s, c = (slots[:, i : i + 2][:, component] for i in (0, 2, 4))
        c = np.tanh(c)
        x = np.clip(mu + np.exp(log_s) * stats.logistic.rvs(size=(3, n), random_state=1), -1, 1)
        x[1] = np.clip(x[1] + c[0] * x[0], -1, 1)
        x[2] = np.clip(x[2] + c[1] * x[0] + c[2] * x[1], -1, 1)
        levels = np.round((x.T + 1) * 3.5).astype(int)
        assert _chi_square_p_value(np.bincount(levels @ [64, 8, 1], minlength=512), probs[:, 0, 0]) < ALPHA

    def test_zero_temperature_gives_the_quantised_coupled_means(self):
        rng = np.random.RandomState(8)
        params = _random_params(rng, (2, 3, 3), num_mixtures=3, num_channels=3)
        params[..., :3] = [30.0, 0.0, 0.0]  # component 0 only
        k = 3
        mu = [params[..., k + 3 * k * c] for c in range(3)]
        coeff = [np.tanh(params[..., 3 * k + 3 * k * c]) for c in range(3)]

        def quantise(v):
            return np.round((np.clip(v, -1, 1) + 1) * 127.5) / 127.5 - 1

        red = quantise(mu[0])
        green = quantise(mu[1] + coeff[0] * red)
        blue = quantise(mu[2] + coeff[1] * red + coeff[2] * green)
        expected = np.stack([red, green, blue], axis=-1)
        sample = _compiled(lambda p, t: DiscretizedLogisticMixtureDistribution(p).sample(t, seed=2))
        self.assertAllClose(sample(params, 0.0), expected, atol=1e-6)
        # The spread around those values shrinks with the temperature; at
        # 1e-3 only pixels within 1e-3 scales of a bin boundary change level.
        spread = [np.abs(to_numpy(sample(params, t)) - expected).mean() for t in (1.0, 0.1, 1e-3)]
        assert spread[0] > spread[1] > spread[2], spread
        assert spread[2] < 0.25 * 2 / 255, spread

    def test_mean_matches_numpy(self):
        rng = np.random.RandomState(9)
        params = _random_params(rng, (2, 3, 2), num_mixtures=4, num_channels=3)
        params[0, 0, 0, 4:8] = 3.0  # red means beyond the range: clipped
        k = 4
        rest = params[..., k:].astype(np.float64).reshape(params.shape[:-1] + (3, 3 * k))
        mu, c = rest[..., :k], np.tanh(rest[..., 2 * k :])
        red = mu[..., 0, :]
        green = mu[..., 1, :] + c[..., 0, :] * red
        blue = mu[..., 2, :] + c[..., 1, :] * red + c[..., 2, :] * green
        weights = special.softmax(params[..., :k].astype(np.float64), axis=-1)
        expected = np.clip(np.stack([(weights * m).sum(-1) for m in (red, green, blue)], -1), -1, 1)
        mean = DiscretizedLogisticMixtureDistribution(params, num_channels=3).mean()
        self.assertAllClose(mean, expected, atol=1e-5, rtol=1e-5)
        assert to_numpy(mean)[0, 0, 0, 0] == 1.0

        grey = _random_params(rng, (2, 2, 2), num_mixtures=3, num_channels=1)
        weights = special.softmax(grey[..., :3].astype(np.float64), axis=-1)
        expected = np.clip((weights * grey[..., 3:6]).sum(-1, keepdims=True), -1, 1)
        grey_mean = DiscretizedLogisticMixtureDistribution(grey, num_channels=1).mean()
        self.assertAllClose(grey_mean, expected, atol=1e-6)

    def test_gradients_are_finite_for_extreme_parameters(self):
        rng = np.random.RandomState(10)
        params = _random_params(rng, (2, 4, 4), num_mixtures=3, num_channels=3)
        params[0, :2] *= 30.0  # saturated logits, coefficients and scales
        params[0, 2:, :, 3:] = rng.choice([-20.0, -7.0, 5.0], size=(2, 4, 27))
        x = _levels()[rng.choice([0, 1, 128, 254, 255], size=(2, 4, 4, 3))].astype("float32")

        def log_prob(p):
            return DiscretizedLogisticMixtureDistribution(p, num_channels=3).log_prob(x)

        assert np.all(np.isfinite(to_numpy(log_prob(params))))
        grad = to_numpy(input_gradient(log_prob, params))
        assert np.all(np.isfinite(grad))
        assert np.abs(grad).max() > 0

    def test_broadcasting_leading_axes(self):
        # (S, B, H, W, P) parameters, e.g. importance samples: log_prob sums H, W.
        rng = np.random.RandomState(11)
        params = _random_params(rng, (2, 3, 2, 2), num_mixtures=2, num_channels=1)
        x = (rng.randint(0, 256, size=(2, 3, 2, 2, 1)) / 127.5 - 1.0).astype("float32")
        log_prob = _compiled(lambda p, v: DiscretizedLogisticMixtureDistribution(p, 1).log_prob(v))(params, x)
        self.assertAllClose(log_prob, _numpy_log_prob(params, x).sum(axis=(-2, -1)), atol=1e-3, rtol=1e-5)

    def test_invalid_arguments(self):
        params = np.zeros((1, 2, 2, 10), "float32")
        for kwargs, name in [
            ({"num_channels": 2}, "num_channels"),
            ({"num_channels": 3.0}, "num_channels"),
            ({"num_bins": 1}, "num_bins"),
            ({"num_bins": 255.0}, "num_bins"),
            ({"reference_edge_bug": 1}, "reference_edge_bug"),
            ({"reference_edge_bug": True, "num_bins": 16}, "num_bins"),
            ({"params": np.zeros((1, 2, 2, 11), "float32")}, "params.shape"),
            ({"params": np.zeros((2, 10), "float32")}, "params.shape"),
        ]:
            with pytest.raises(ValueError, match=f"Received: {name}="):
                DiscretizedLogisticMixtureDistribution(**{"params": params, **kwargs})

    def test_invalid_method_arguments(self):
        dist = DiscretizedLogisticMixtureDistribution(np.zeros((1, 2, 2, 10), "float32"))
        with pytest.raises(ValueError, match=r"Received: x.shape="):
            dist.log_prob(np.zeros((1, 2, 2, 1), "float32"))
        with pytest.raises(ValueError, match="Received: temperature=-0.5"):
            dist.sample(temperature=-0.5)

    def test_log_prob_refuses_concrete_levels_outside_the_grid(self):
        # Before: 8-bit pixels got a finite, meaningless score (x=255: about -1020 a pixel).
        dist = DiscretizedLogisticMixtureDistribution(np.zeros((1, 2, 2, 10), "float32"))
        with pytest.raises(ValueError, match=r"`x` in \[-1.0, 1.0\]. Received: x with values in \[0.0, 255.0\]$"):
            dist.log_prob(np.array([0.0, 255.0, 1.0, 0.5], "float32").reshape(1, 2, 2, 1).repeat(3, axis=-1))
        with pytest.raises(ValueError, match=r"Received: x with values in \[-1.5, -1.5\]$"):
            dist.log_prob(keras.ops.full((1, 2, 2, 3), -1.5))
        # The grid's ends are in; non-finite values pass, as in `fit` (a NaN in plain view).
        grid_ends = np.array([-1.0, 1.0, 1.0, -1.0], "float32").reshape(1, 2, 2, 1).repeat(3, axis=-1)
        assert np.all(np.isfinite(to_numpy(dist.log_prob(grid_ends))))
        assert np.all(np.isnan(to_numpy(dist.log_prob(np.where(grid_ends > 0, np.nan, grid_ends)))))


class TestDiscretizedLogisticMixture(TestCase):
    def test_layer(self):
        self.run_layer_test(
            DiscretizedLogisticMixture,
            {"num_mixtures": 2, "num_channels": 3},
            np.random.RandomState(0).normal(size=(2, 4, 4, 5)).astype("float32"),
            expected_output_shape=(2, 4, 4, 3),
            expected_num_trainable_weights=2,
            output_to_tensor=lambda dist: dist.mean(),
        )

    def test_layer_single_channel(self):
        # Fit, XLA and saving take the same path for one channel as for three
        # (test_layer); the grey head's own weights, shapes and mixed
        # precision are checked here.
        self.run_layer_test(
            DiscretizedLogisticMixture,
            {"num_mixtures": 3, "num_channels": 1, "kernel_size": 3, "kernel_regularizer": "l2"},
            np.random.RandomState(0).normal(size=(2, 4, 4, 5)).astype("float32"),
            expected_output_shape=(2, 4, 4, 1),
            expected_num_trainable_weights=2,
            output_to_tensor=lambda dist: dist.mean(),
            run_training_check=False,
            run_jit_check=False,
            run_saving_check=False,
        )

    def test_symbolic_call_returns_a_distribution(self):
        layer = DiscretizedLogisticMixture(num_mixtures=4, num_channels=1, reference_edge_bug=True)
        dist = layer(keras.Input((None, None, 6)))
        assert isinstance(dist, DiscretizedLogisticMixtureDistribution)
        assert isinstance(dist.params, keras.KerasTensor)
        assert dist.params.shape == (None, None, None, 12) == layer.compute_output_shape((None, None, None, 6))
        assert (dist.num_mixtures, dist.num_channels, dist.num_bins, dist.reference_edge_bug) == (4, 1, 256, True)
        assert dist.mean().shape == (None, None, None, 1)
        # Before: each backend's own error from inside keras.random.uniform.
        with pytest.raises(ValueError, match=r"`sample\(\)` draws random numbers.*Received: params=<KerasTensor"):
            dist.sample(seed=1)

    def test_subclass_call_gives_its_own_symbolic_output(self):
        # Before: the symbolic call returned the base class's distribution,
        # whatever the subclass's `call` returned.
        class MeanImage(DiscretizedLogisticMixture):
            def call(self, features):
                return super().call(features).mean()

        class Sharper(DiscretizedLogisticMixture):  # still a distribution
            def call(self, features):
                return self._distribution(2.0 * self.projection(features))

        features = keras.Input((3, 3, 4))
        mean = MeanImage(num_mixtures=2)(features)
        assert isinstance(mean, keras.KerasTensor) and mean.shape == (None, 3, 3, 3)
        data = np.random.RandomState(7).normal(size=(2, 3, 3, 4)).astype("float32")
        model = keras.Model(features, mean)
        self.assertAllClose(model(data), model.layers[-1](data), atol=1e-6)
        dist = Sharper(num_mixtures=2, num_channels=1)(features)
        assert isinstance(dist, DiscretizedLogisticMixtureDistribution) and dist.params.shape == (None, 3, 3, 6)

    def test_eager_call_matches_the_projection(self):
        features = np.random.RandomState(1).normal(size=(2, 3, 3, 4)).astype("float32")
        layer = DiscretizedLogisticMixture(num_mixtures=2, num_channels=3, num_bins=16)
        dist = layer(features)
        kernel, bias = (to_numpy(w) for w in layer.projection.weights)
        self.assertAllClose(dist.params, features @ kernel[0, 0] + bias, atol=1e-5)
        x = (np.random.RandomState(2).randint(0, 16, size=(2, 3, 3, 3)) / 7.5 - 1).astype("float32")
        log_prob = _compiled(lambda p, v: DiscretizedLogisticMixtureDistribution(p, num_bins=16).log_prob(v))
        assert dist.num_bins == 16
        expected = _numpy_log_prob(to_numpy(dist.params), x, num_bins=16).sum(axis=(1, 2))
        self.assertAllClose(log_prob(dist.params, x), expected, atol=1e-3)

    def test_functional_log_prob_model_trains_and_saves(self):
        rng = np.random.RandomState(3)
        features_data = rng.normal(size=(8, 4, 4, 6)).astype("float32")
        images = (rng.randint(0, 256, size=(8, 4, 4, 3)) / 127.5 - 1.0).astype("float32")
        features = keras.Input((4, 4, 6))
        x = keras.Input((4, 4, 3))
        head = DiscretizedLogisticMixture(num_mixtures=2)
        model = keras.Model([features, x], head(features).log_prob(x))
        assert model.output.shape == (None,)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=negative_log_likelihood)
        history = model.fit([features_data, images], np.zeros(8), batch_size=8, epochs=3, verbose=0)
        losses = history.history["loss"]
        assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
        expected = to_numpy(head(features_data).log_prob(images))
        self.assertAllClose(model.predict([features_data, images], verbose=0), expected, atol=1e-4)
        self.run_model_saving_test(model, [features_data, images], atol=1e-5)

    @pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
    def test_mixed_precision_log_prob_is_float32(self, policy):
        rng = np.random.RandomState(4)
        features = rng.normal(size=(2, 4, 4, 5)).astype("float32")
        x = (rng.randint(0, 256, size=(2, 4, 4, 3)) / 127.5 - 1.0).astype("float32")
        layer = DiscretizedLogisticMixture(num_mixtures=3, dtype=policy)
        dist = layer(features)
        compute_dtype = policy.split("_")[1]
        assert dist.dtype == compute_dtype
        log_prob, sample, mean = dist.log_prob(x), dist.sample(seed=1), dist.mean()
        dtypes = [keras.backend.standardize_dtype(t.dtype) for t in (log_prob, sample, mean)]
        assert dtypes == ["float32", "float32", compute_dtype], dtypes
        # The same (rounded) parameters evaluated in float64 by NumPy.
        self.assertAllClose(log_prob, _numpy_log_prob(to_numpy(dist.params), x).sum(axis=(1, 2)), atol=1e-3)

    @pytest.mark.parametrize(
        "kwargs",
        [
            {
                "num_mixtures": 2,
                "num_channels": 1,
                "num_bins": 256,
                "kernel_size": 3,
                "reference_edge_bug": True,
                "kernel_initializer": "he_uniform",
                "bias_initializer": "ones",
                "kernel_regularizer": "l2",
                "bias_regularizer": "l1",
            },
            {
                "num_mixtures": 3,
                "num_channels": 3,
                "num_bins": 16,
                "kernel_size": (1, 3),
                "reference_edge_bug": False,
                "kernel_initializer": "he_uniform",
                "bias_initializer": "ones",
                "kernel_regularizer": "l2",
                "bias_regularizer": "l1",
            },
        ],
        ids=["edge_bug", "num_bins"],
    )
    def test_every_argument_survives_the_config_round_trip(self, kwargs):
        # Protects get_config: an argument missing from it (e.g.
        # reference_edge_bug) falls back to its default in the revived layer.
        arguments = set(inspect.signature(DiscretizedLogisticMixture.__init__).parameters) - {"self", "kwargs"}
        assert set(kwargs) == arguments
        layer = DiscretizedLogisticMixture(**kwargs)
        revived = DiscretizedLogisticMixture.from_config(layer.get_config())
        for name, value in kwargs.items():
            if name.endswith("_initializer"):
                assert keras.initializers.serialize(getattr(revived, name)) == keras.initializers.serialize(
                    keras.initializers.get(value)
                ), name
            elif name.endswith("_regularizer"):
                assert keras.regularizers.serialize(getattr(revived, name)) == keras.regularizers.serialize(
                    keras.regularizers.get(value)
                ), name
            else:
                assert getattr(revived, name) == value, name
        # Same weights, same likelihood, on images with the edge levels
        # (0, 1, num_bins - 2 and num_bins - 1: the edge bug's level 254).
        rng = np.random.RandomState(6)
        num_bins, num_channels = kwargs["num_bins"], kwargs["num_channels"]
        features = rng.normal(size=(2, 3, 3, 4)).astype("float32")
        levels = rng.choice([0, 1, num_bins // 2, num_bins - 2, num_bins - 1], size=(2, 3, 3, num_channels))
        x = _levels(num_bins)[levels].astype("float32")
        compiled = {}  # one compiled log_prob per set of distribution flags

        def log_prob(dist, **overrides):
            flags = {"num_channels": dist.num_channels, "num_bins": dist.num_bins}
            flags["reference_edge_bug"] = dist.reference_edge_bug
            flags.update(overrides)
            key = tuple(flags.values())
            if key not in compiled:
                compiled[key] = _compiled(lambda p, v: DiscretizedLogisticMixtureDistribution(p, **flags).log_prob(v))
            return to_numpy(compiled[key](dist.params, x))

        dist = layer(features)
        expected = log_prob(dist)
        revived(features)
        revived.set_weights(layer.get_weights())
        np.testing.assert_array_equal(log_prob(revived(features)), expected)
        if kwargs["reference_edge_bug"]:  # the flag changes these log-probabilities
            assert np.all(np.abs(log_prob(dist, reference_edge_bug=False) - expected) > 1e-2)

    def test_numpy_integers_are_stored_as_python_ints(self):
        # Before: refused, with messages that read "Received: num_mixtures=2".
        layer = DiscretizedLogisticMixture(
            num_mixtures=np.int64(2), num_channels=np.int64(1), num_bins=np.int32(16), kernel_size=(np.int64(1), 3)
        )
        config = layer.get_config()
        assert [type(config[k]) for k in ("num_mixtures", "num_channels", "num_bins")] == [int, int, int]
        assert [type(size) for size in config["kernel_size"]] == [int, int]
        json.dumps(keras.saving.serialize_keras_object(layer))
        with pytest.raises(ValueError, match=r"`num_mixtures` must be a positive int. Received: num_mixtures='2'$"):
            DiscretizedLogisticMixture(num_mixtures="2")
        with pytest.raises(ValueError, match=r"Received: num_bins=np.float32\(16.0\)$"):
            DiscretizedLogisticMixture(num_bins=np.float32(16))

    def test_invalid_arguments(self):
        for kwargs, name in [
            ({"num_mixtures": 0}, "num_mixtures"),
            ({"num_mixtures": 2.0}, "num_mixtures"),
            ({"num_channels": 4}, "num_channels"),
            ({"num_bins": 1}, "num_bins"),
            ({"kernel_size": 0}, "kernel_size"),
            ({"kernel_size": (1, 2, 3)}, "kernel_size"),
            ({"reference_edge_bug": "yes"}, "reference_edge_bug"),
            ({"reference_edge_bug": True, "num_bins": 32}, "num_bins"),
        ]:
            with pytest.raises(ValueError, match=f"Received: {name}="):
                DiscretizedLogisticMixture(**kwargs)
