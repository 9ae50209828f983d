"""Latent Gaussians against NumPy/SciPy formulas (and TFP where it runs)."""

import numpy as np
import pytest
from scipy import stats

from keras_avae.distributions.bernoulli import bernoulli_log_prob
from keras_avae.distributions.gaussian import DiagonalGaussian
from keras_avae.distributions.gaussian import soft_bound
from tests.test_case import to_numpy

RNG = np.random.default_rng(0)


def test_soft_bounds():
    x = np.linspace(-50, 50, 101).astype("float32")
    np.testing.assert_allclose(to_numpy(soft_bound(x, -5.0, 5.0)), 5 * np.tanh(x / 10), rtol=1e-5, atol=1e-6)
    t = np.clip((x + 1) / 6, 0, 1)
    np.testing.assert_allclose(to_numpy(soft_bound(x, -1.0, 5.0)), -1 + 6 * t * t * (3 - 2 * t), rtol=1e-5, atol=1e-5)
    # The reference value quoted in the design notes: raw 0 maps to -0.556.
    np.testing.assert_allclose(to_numpy(soft_bound(np.float32(0), -1.0, 5.0)), -0.5555556, rtol=1e-5)


def test_bounded_parameterisation():
    raw_loc = RNG.normal(size=(2, 3, 3, 4)).astype("float32") * 20
    raw_scale = RNG.normal(size=(2, 3, 3, 4)).astype("float32") * 20
    q = DiagonalGaussian.from_raw(raw_loc, raw_scale)
    np.testing.assert_allclose(to_numpy(q.loc), 5 * np.tanh(raw_loc / 10), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(q.scale), np.exp(5 * np.tanh(raw_scale / 10)) + 0.01, rtol=1e-5)


def test_log_prob_and_kl_against_scipy_and_closed_form():
    shape = (3, 4, 4, 2)
    mq, mp = RNG.normal(size=shape), RNG.normal(size=shape)
    sq, sp = np.exp(RNG.normal(size=shape) * 0.5), np.exp(RNG.normal(size=shape) * 0.5)
    q, p = DiagonalGaussian(mq, sq), DiagonalGaussian(mp, sp)
    z = RNG.normal(size=shape)
    expected_lp = stats.norm(mq, sq).logpdf(z).reshape(3, -1).sum(-1)
    np.testing.assert_allclose(to_numpy(q.log_prob(z)), expected_lp, rtol=1e-4)
    kl = np.log(sp / sq) + (sq**2 + (mq - mp) ** 2) / (2 * sp**2) - 0.5
    np.testing.assert_allclose(to_numpy(q.kl_divergence(p)), kl.reshape(3, -1).sum(-1), rtol=1e-4)


def test_kl_matches_a_monte_carlo_estimate():
    shape = (1, 1, 1, 1)
    q, p = DiagonalGaussian(np.full(shape, 0.3), np.full(shape, 0.7)), DiagonalGaussian(np.zeros(shape), np.ones(shape))
    z = np.stack([to_numpy(q.sample(seed=s)) for s in range(2000)])
    mc = np.mean([to_numpy(q.log_prob(zi) - p.log_prob(zi)) for zi in z[:300]])
    assert abs(mc - float(to_numpy(q.kl_divergence(p))[0])) < 0.1
    # Samples follow N(0.3, 0.7^2): Kolmogorov-Smirnov at the 1% level.
    assert stats.kstest(z.ravel(), stats.norm(0.3, 0.7).cdf).pvalue > 0.01


def test_bernoulli_log_prob_and_crop():
    logits = RNG.normal(size=(2, 6, 6, 1)).astype("float32")
    x = (RNG.random((2, 6, 6, 1)) > 0.5).astype("float32")
    p = 1 / (1 + np.exp(-logits))
    full = np.log(np.where(x == 1, p, 1 - p))
    np.testing.assert_allclose(to_numpy(bernoulli_log_prob(logits, x)), full.reshape(2, -1).sum(-1), rtol=1e-5)
    cropped = full[:, 2:-2, 2:-2].reshape(2, -1).sum(-1)
    np.testing.assert_allclose(to_numpy(bernoulli_log_prob(logits, x, crop=2)), cropped, rtol=1e-5)
    # Before: crops that leave no pixel scored a perfect 0 (-1, 3, 4), and 1.5 a TypeError.
    for crop in (-1, 3, 4, 1.5, True):
        with pytest.raises(ValueError, match=rf"`crop` must be a non-negative int smaller than half.*crop={crop!r}$"):
            bernoulli_log_prob(logits, x, crop=crop)


def test_bernoulli_log_prob_of_grey_levels_and_extreme_logits():
    # Grey levels score minus the cross-entropy on every backend; logits of
    # +-100 stay finite and exact (NumPy in float64 as the reference).
    logits = np.array([5.0, -3.0, 100.0, -100.0, 100.0, 0.5], "float32").reshape(1, 1, 6, 1)
    x = np.array([0.3, 0.7, 1.0, 0.0, 0.0, 0.25], "float32").reshape(1, 1, 6, 1)
    lg, xd = logits.astype("float64"), x.astype("float64")
    expected = np.sum(xd * -np.logaddexp(0, -lg) + (1 - xd) * -np.logaddexp(0, lg))
    np.testing.assert_allclose(to_numpy(bernoulli_log_prob(logits, x))[0], expected, rtol=1e-6)
