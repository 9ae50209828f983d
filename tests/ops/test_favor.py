"""FAVOR+ ops against NumPy references: exact attention, explicit kernel matrices, chi(d)."""

import doctest
import re

import keras
import numpy as np
import pytest
import scipy.stats
from keras import ops

from keras_avae.ops import favor as favor_module
from keras_avae.ops import favor_attention
from keras_avae.ops import favor_feature_map
from keras_avae.ops import orthogonal_random_features
from tests.test_case import BACKEND
from tests.test_case import TestCase
from tests.test_case import to_numpy

# === NumPy references ===


def np_features(x, w, kernel="softmax", is_query=True, scale=None, eps=1e-6):
    """The documented feature map, written out for (B, L, N, d) inputs."""
    m, d = w.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    x = x * np.sqrt(scale)
    proj = np.einsum("blnd,md->blnm", x, w)
    if kernel == "relu":
        return (np.maximum(proj, 0.0) + eps) / np.sqrt(m)
    exponent = proj - 0.5 * np.sum(x**2, axis=-1, keepdims=True)
    axes = (-1,) if is_query else (1, 3)
    exponent = exponent - exponent.max(axis=axes, keepdims=True)
    return (np.exp(exponent) + eps) / np.sqrt(m)


def np_kernel_attention(q_features, k_features, v, causal=False, key_mask=None):
    """Quadratic-time linear attention: the explicit (T, S) kernel matrix, normalised."""
    kernel = np.einsum("btnm,bsnm->bnts", q_features, k_features)
    if causal:
        kernel = kernel * np.tril(np.ones(kernel.shape[-2:]))
    if key_mask is not None:
        kernel = kernel * key_mask[:, None, None, :]
    normaliser = kernel.sum(-1).transpose(0, 2, 1)[..., None]
    # A query without any valid key gets zeros (the documented convention).
    return np.einsum("bnts,bsnd->btnd", kernel, v) / np.where(normaliser > 0, normaliser, 1.0)


def np_softmax_attention(q, k, v, scale=None, causal=False):
    """Exact `softmax(scale Q K^T) V` for (B, L, N, d) inputs."""
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = scale * np.einsum("btnd,bsnd->bnts", q, k)
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:])) > 0, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnd->btnd", weights, v), weights


def first_order_mse(q, k, v, num_features, scale=None, causal=False):
    """Predicted mean squared error of FAVOR+ softmax attention with iid features.

    With `m` iid N(0, I) features each kernel estimate is `K_ij (1 + delta_ij)`
    with `E delta = 0` and `Cov(delta_ij, delta_il) = expm1((x_i + y_j).(x_i + y_l)) / m`
    (x, y the scaled query and keys; a Gaussian moment computation). To first
    order in delta the error of query i is `sum_j a_ij delta_ij (v_j - o_i)`,
    hence `E|err_i|^2 = sum_jl a_ij a_il Cov(delta_ij, delta_il) (v_j - o_i).(v_l - o_i)`.
    Orthogonal features can only lower it (Performer paper, Theorem 2).
    Returns the prediction per batch element, head and query, shape (B, N, T).
    """
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    out, weights = np_softmax_attention(q, k, v, scale, causal=causal)
    x, y = q * np.sqrt(scale), k * np.sqrt(scale)
    z = x[:, :, None] + y[:, None, :]  # (B, T, S, N, d)
    covariance = np.expm1(np.einsum("btjnd,btlnd->bntjl", z, z)) / num_features
    deviation = v[:, None, :] - out[:, :, None]  # (B, T, S, N, d_v)
    gram = np.einsum("btjne,btlne->bntjl", deviation, deviation)
    return np.einsum("bntj,bntl,bntjl,bntjl->bnt", weights, weights, covariance, gram)


def gradients(fn, *args):
    """Gradients of the scalar `fn(*args)` with respect to every argument, as NumPy."""
    args = [np.asarray(a, "float32") for a in args]
    if BACKEND == "jax":
        import jax

        return [np.asarray(g) for g in jax.grad(fn, argnums=tuple(range(len(args))))(*args)]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        tensors = [tf.constant(a) for a in args]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            y = fn(*tensors)
        return [g.numpy() for g in tape.gradient(y, tensors)]
    import torch

    tensors = [torch.tensor(a, requires_grad=True) for a in args]
    fn(*tensors).backward()
    return [t.grad.numpy() for t in tensors]


def random_qkv(seed, batch=2, length=12, heads=2, dim=8, value_dim=5, std=1.0):
    rng = np.random.default_rng(seed)
    q = std * rng.normal(size=(batch, length, heads, dim)).astype("float32")
    k = std * rng.normal(size=(batch, length, heads, dim)).astype("float32")
    v = rng.normal(size=(batch, length, heads, value_dim)).astype("float32")
    return q, k, v


def feature_seed(kind, seed):
    """An int seed (NumPy draw on the host) or a `SeedGenerator` (a backend draw)."""
    return seed if kind == "int" else keras.random.SeedGenerator(seed)


def documented_features(gaussian, num_features, dim, scaling):
    """The draw `orthogonal_random_features` documents, from its Gaussians:
    the first ceil(m/d) d*d numbers fill the blocks, whose unique QR factor
    with a positive diagonal of R gives d orthonormal rows each; the next
    m*d numbers give the rows' chi(d) lengths (`"chi"`), else sqrt(d)."""
    blocks = -(-num_features // dim)
    size = blocks * dim * dim
    rows = []
    for block in gaussian[:size].astype("float64").reshape(blocks, dim, dim):
        q, r = np.linalg.qr(block)
        rows.append((q * np.sign(np.diag(r))).T)
    directions = np.concatenate(rows)[:num_features]
    if scaling == "chi":
        norms = np.linalg.norm(gaussian[size:].astype("float64").reshape(num_features, dim), axis=1)
    else:
        norms = np.full(num_features, np.sqrt(dim))
    return directions * norms[:, None]


SEED_KINDS = pytest.mark.parametrize("kind", ["int", "generator"])


class TestOrthogonalRandomFeatures(TestCase):
    @SEED_KINDS
    @pytest.mark.parametrize("scaling", ["chi", "sqrt"])
    def test_blocks_are_orthogonal(self, scaling, kind):
        dim, num_features = 4, 10  # blocks of 4, 4 and 2 rows
        w = to_numpy(orthogonal_random_features(num_features, dim, seed=feature_seed(kind, 3), scaling=scaling))
        assert w.shape == (num_features, dim)
        norms = np.linalg.norm(w, axis=1)
        for start in range(0, num_features, dim):
            block = w[start : start + dim]
            gram = block @ block.T
            np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-5)
        if scaling == "sqrt":
            np.testing.assert_allclose(norms, np.sqrt(dim), rtol=1e-5)
        else:
            assert np.unique(np.round(norms, 4)).size == num_features

    @SEED_KINDS
    @pytest.mark.parametrize("scaling", ["chi", "sqrt"])
    def test_follows_the_documented_draw(self, scaling, kind):
        # Which Gaussians give the directions and which the lengths: a wrong
        # split makes lengths depend on directions (rows no longer N(0, I)).
        num_features, dim = 10, 4
        total = 3 * dim * dim + (num_features * dim if scaling == "chi" else 0)
        if kind == "int":
            gaussian = np.random.default_rng(5).standard_normal(total, dtype=np.float32)
        else:  # the same stream as a generator seeded alike
            gaussian = to_numpy(keras.random.normal((total,), seed=keras.random.SeedGenerator(5), dtype="float32"))
        w = orthogonal_random_features(num_features, dim, seed=feature_seed(kind, 5), scaling=scaling)
        np.testing.assert_allclose(to_numpy(w), documented_features(gaussian, num_features, dim, scaling), atol=2e-5)

    @SEED_KINDS
    def test_chi_norms_follow_chi_distribution(self, kind):
        # Kolmogorov-Smirnov against chi(d), significance level 0.001.
        dim = 5
        w = to_numpy(orthogonal_random_features(2000, dim, seed=feature_seed(kind, 0), scaling="chi"))
        p_value = scipy.stats.kstest(np.linalg.norm(w, axis=1), scipy.stats.chi(dim).cdf).pvalue
        assert p_value > 1e-3, p_value

    @SEED_KINDS
    def test_directions_are_isotropic(self, kind):
        # Haar directions: E[u] = 0 and E[u u^T] = I/d. 1000 independent blocks
        # of 4 rows; tolerance 5 standard errors of each entry's mean.
        dim, blocks = 4, 1000
        w = orthogonal_random_features(blocks * dim, dim, seed=feature_seed(kind, 1), scaling="sqrt")
        w = to_numpy(w) / np.sqrt(dim)
        per_block_mean = w.reshape(blocks, dim, dim).mean(axis=1)
        mean, stderr = per_block_mean.mean(0), per_block_mean.std(0) / np.sqrt(blocks)
        assert np.all(np.abs(mean) < 5 * stderr + 1e-12), (mean, stderr)
        # Signed first coordinate of row 0 of each block: QR without the sign
        # fix biases it; Haar makes it symmetric about 0.
        first = w.reshape(blocks, dim, dim)[:, 0, 0]
        assert abs(first.mean()) < 5 * first.std() / np.sqrt(blocks)

    def test_seeds(self):
        a = to_numpy(orthogonal_random_features(6, 3, seed=7))
        self.assertAllClose(orthogonal_random_features(6, 3, seed=7), a)
        assert not np.allclose(to_numpy(orthogonal_random_features(6, 3, seed=8)), a)
        generator = keras.random.SeedGenerator(7)
        first = to_numpy(orthogonal_random_features(6, 3, seed=generator))
        second = to_numpy(orthogonal_random_features(6, 3, seed=generator))
        assert not np.allclose(first, second)

    def test_dtype(self):
        w = orthogonal_random_features(4, 4, seed=0, dtype="float16")
        assert keras.backend.standardize_dtype(w.dtype) == "float16"

    @pytest.mark.parametrize(
        "kwargs, name",
        [
            ({"num_features": 0, "dim": 4}, "num_features=0"),
            ({"num_features": 4, "dim": -1}, "dim=-1"),
            ({"num_features": 4, "dim": 4, "scaling": "gauss"}, "scaling='gauss'"),
            ({"num_features": 4, "dim": 2, "seed": -1}, "`seed` must be a non-negative int.*seed=-1"),
        ],
    )
    def test_bad_arguments(self, kwargs, name):
        with pytest.raises(ValueError, match=name):
            orthogonal_random_features(**kwargs)


class TestFavorFeatureMap(TestCase):
    @pytest.mark.parametrize("kernel", ["softmax", "relu"])
    @pytest.mark.parametrize("is_query", [True, False])
    def test_matches_numpy(self, kernel, is_query):
        q, _, _ = random_qkv(0)
        w = to_numpy(orthogonal_random_features(16, 8, seed=0))
        actual = favor_feature_map(q, w, kernel=kernel, is_query=is_query, scale=0.3, eps=1e-3)
        expected = np_features(q, w, kernel, is_query, scale=0.3, eps=1e-3)
        assert keras.backend.standardize_dtype(actual.dtype) == "float32"
        self.assertAllClose(actual, expected, atol=1e-6, rtol=1e-4)

    def test_softmax_features_are_unbiased(self):
        # phi(q).phi(k) exp(c_q + c_k) estimates exp(q.k): the stabilisers c
        # (recomputed here from the same W) are undone, eps = 0. Each of 2000
        # independent blocks of 4 orthogonal features gives one estimate; the
        # mean must lie within 4 standard errors (two-sided level ~6e-5 under
        # the normal approximation) and the standard error must be small
        # enough (< 5%) for the check to mean something.
        dim, blocks = 4, 2000
        rng = np.random.default_rng(1)
        q = (0.5 * rng.normal(size=(1, 3, 1, dim))).astype("float32")
        k = (0.5 * rng.normal(size=(1, 3, 1, dim))).astype("float32")
        w = to_numpy(orthogonal_random_features(blocks * dim, dim, seed=2))
        phi_q = to_numpy(favor_feature_map(q, w, is_query=True, scale=1.0, eps=0.0))[0, :, 0]
        phi_k = to_numpy(favor_feature_map(k, w, is_query=False, scale=1.0, eps=0.0))[0, :, 0]
        c_q = (q[0, :, 0] @ w.T - 0.5 * np.sum(q[0, :, 0] ** 2, -1, keepdims=True)).max(-1)
        c_k = (k[0, :, 0] @ w.T - 0.5 * np.sum(k[0, :, 0] ** 2, -1, keepdims=True)).max()
        for i in range(3):
            for j in range(3):
                terms = phi_q[i] * phi_k[j] * np.exp(c_q[i] + c_k) * (blocks * dim)
                per_block = terms.reshape(blocks, dim).mean(1)
                estimate, stderr = per_block.mean(), per_block.std(ddof=1) / np.sqrt(blocks)
                exact = np.exp(q[0, i, 0] @ k[0, j, 0])
                assert stderr < 0.05 * exact, (i, j, stderr, exact)
                assert abs(estimate - exact) < 4 * stderr, (i, j, estimate, exact, stderr)

    @pytest.mark.parametrize("std", [1e3, 6e4])
    def test_key_features_stay_in_range_at_huge_norms(self, std):
        # The exponent is `W x - |x|^2 / 2 - c` with |x|^2 / 2 of order
        # std^2: subtracting it in one go lost the features' range (up to 1.03
        # at std 1e3, inf and NaN attention at 6e4, in 5 of 30 draws).
        w = orthogonal_random_features(16, 8, seed=0)
        for seed in range(10):
            q, k, v = random_qkv(seed, std=std)
            features = to_numpy(favor_feature_map(k, w, is_query=False, eps=0.0))
            assert np.all(np.isfinite(features)) and features.min() >= 0.0, seed
            # The largest feature of each element and head is exactly exp(0) / sqrt(m).
            np.testing.assert_array_equal(features.max(axis=(1, 3)), 0.25)
            out = to_numpy(favor_attention(q, k, v, w))
            # Each output is a weighted mean of the values of its element and head.
            low, high = v.min(axis=1, keepdims=True), v.max(axis=1, keepdims=True)
            assert np.all(np.isfinite(out)), seed
            assert np.all((out >= low - 1e-5) & (out <= high + 1e-5)), seed

    def test_bad_arguments(self):
        q, _, _ = random_qkv(0)
        w = orthogonal_random_features(16, 8, seed=0)
        with pytest.raises(ValueError, match="kernel='cosine'"):
            favor_feature_map(q, w, kernel="cosine")
        with pytest.raises(ValueError, match="eps=-1"):
            favor_feature_map(q, w, eps=-1)
        with pytest.raises(ValueError, match="scale=0"):
            favor_feature_map(q, w, scale=0)
        # Before: accepted, giving NaN attention (inf in float32).
        for eps in (float("inf"), 1e39, 2.0):
            message = rf"`eps` must be a non-negative float of at most 1.*eps={re.escape(repr(eps))}"
            with pytest.raises(ValueError, match=message):
                favor_attention(q, q, q, w, eps=eps)
        # Before: a backend's matmul error naming no argument.
        message = r"`random_features` must have one column per channel.*\(8\).*shape=\(16, 3\)"
        with pytest.raises(ValueError, match=message):
            favor_attention(q, q, q, orthogonal_random_features(16, 3, seed=0))
        # Before: inf gave NaN attention, a string a TypeError, and "no" was causal.
        for scale in (float("inf"), float("nan"), "0.5", True):
            message = rf"`scale` must be a finite positive number.*scale={re.escape(repr(scale))}"
            with pytest.raises(ValueError, match=message):
                favor_attention(q, q, q, w, scale=scale)
        for causal in ("no", 1, None):
            with pytest.raises(ValueError, match=rf"`causal` must be a bool. Received: causal={causal!r}"):
                favor_attention(q, q, q, w, causal=causal)

    def test_mismatched_shapes_name_the_arrays(self):
        # Before: TensorFlow raised from inside an einsum, while JAX and
        # PyTorch broadcast a batch or a head of size 1 and returned a result.
        q, k, v = random_qkv(0)  # (2, T, 2, 8)
        w = orthogonal_random_features(16, 8, seed=0)
        cases = [
            ((q, k[:1], v[:1], None), r"query axis 0, key axis 0, value axis 0"),
            ((q, k[:, :, :1], v[:, :, :1], None), r"query axis 2, key axis 2, value axis 2"),
            ((q, k, v[:, :-1], None), r"key axis 1, value axis 1"),
            ((q, k, v, np.ones((2, k.shape[1] - 1), bool)), r"key axis 1, value axis 1, key_mask axis 1"),
            ((q, k[..., :4], v, None), r"query axis 3, key axis 3"),
            ((q, k, v, np.ones((2, k.shape[1], 1), bool)), r"`key_mask` must be a \(B, S\) tensor"),
            ((q, k[0], v, None), r"must be \(B, T, N, d\), \(B, S, N, d\) and \(B, S, N, d_v\)"),
        ]
        for (query, key, value, key_mask), message in cases:
            with pytest.raises(ValueError, match=message + r".*Received: query.shape="):
                favor_attention(query, key, value, w, key_mask=key_mask)
        # A key_mask given as a list is still read.
        mask = np.ones((2, k.shape[1]), bool)
        mask[0, -3:] = False
        expected = favor_attention(q, k, v, w, key_mask=mask)
        self.assertAllClose(favor_attention(q, k, v, w, key_mask=mask.tolist()), expected)
        # Single head without a head axis: (B, T, d).
        with pytest.raises(ValueError, match=r"key axis 1, value axis 1"):
            favor_attention(q[:, :, 0], k[:, :, 0], v[:, :-1, 0], w)


class TestFavorAttention(TestCase):
    def test_converges_to_exact_softmax_attention(self):
        # The RMS error over 6 seeds falls with m and stays below 1.5x the
        # first-order prediction for iid features (`first_order_mse`, which
        # falls as m^-1/2): orthogonal features do no worse, and 1.5 absorbs
        # the sampling error of an RMS over 6 seeds of a heavy-tailed error.
        q, k, v = random_qkv(0, std=0.5)
        exact, _ = np_softmax_attention(q, k, v)
        errors = []
        for m in (16, 64, 256, 1024):
            per_seed = []
            for seed in range(6):
                w = orthogonal_random_features(m, 8, seed=seed)
                per_seed.append(np.linalg.norm(to_numpy(favor_attention(q, k, v, w)) - exact, axis=-1))
            rms = np.sqrt(np.mean(np.square(per_seed)))
            predicted = np.sqrt(np.mean(first_order_mse(q, k, v, m)))
            assert rms < 1.5 * predicted, (m, rms, predicted)
            errors.append(rms)
        assert all(a > b for a, b in zip(errors, errors[1:])), errors
        # m^-1/2 predicts a factor 8; at m=16 the error saturates (outputs are
        # convex combinations of the values), so ask for 3.
        assert errors[-1] < errors[0] / 3, errors

    def test_causal_matches_exact_causal_attention(self):
        q, k, v = random_qkv(1, std=0.5)
        exact, _ = np_softmax_attention(q, k, v, causal=True)
        errors = []
        for seed in range(4):
            w = orthogonal_random_features(1024, 8, seed=seed)
            out = to_numpy(favor_attention(q, k, v, w, causal=True))
            errors.append(np.linalg.norm(out - exact, axis=-1))
            # The first query attends only to itself: exact.
            self.assertAllClose(out[:, 0], v[:, 0], atol=1e-5)
        predicted = np.sqrt(np.mean(first_order_mse(q, k, v, 1024, causal=True)))
        assert np.sqrt(np.mean(np.square(errors))) < 1.5 * predicted

    @pytest.mark.parametrize("kernel, eps", [("softmax", 0.0), ("relu", 1e-3)])
    def test_causal_equals_prefix_attention(self, kernel, eps):
        # With the same features, position t of causal FAVOR+ is non-causal
        # FAVOR+ on positions 0..t. eps = 0 for softmax: the causal keys'
        # stabiliser is a max over the whole sequence, not over the prefix.
        # 300 positions = 3 chunks of 128, the last one padded.
        length = 300
        q, k, v = random_qkv(2, length=length)
        w = orthogonal_random_features(16, 8, seed=0)
        causal = to_numpy(favor_attention(q, k, v, w, kernel=kernel, causal=True, eps=eps))
        for t in (0, 128):
            prefix = favor_attention(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], w, kernel=kernel, eps=eps)
            self.assertAllClose(causal[:, t], to_numpy(prefix)[:, -1], atol=1e-5, rtol=1e-4, msg=f"t={t}")
        full = favor_attention(q, k, v, w, kernel=kernel, eps=eps)
        self.assertAllClose(causal[:, -1], to_numpy(full)[:, -1], atol=1e-5, rtol=1e-4)
        # Every position at once: prefix t as a key mask on batch element t
        # (masking is checked against slicing in the key-mask tests below).
        prefix_masks = np.tril(np.ones((length, length), bool))
        q_rows = np.repeat(q[:1], length, axis=0)
        k_rows = np.repeat(k[:1], length, axis=0)
        v_rows = np.repeat(v[:1], length, axis=0)
        prefixes = favor_attention(q_rows, k_rows, v_rows, w, kernel=kernel, key_mask=prefix_masks, eps=eps)
        diagonal = to_numpy(prefixes)[np.arange(length), np.arange(length)]
        self.assertAllClose(causal[0], diagonal, atol=1e-5, rtol=1e-4)

    @pytest.mark.parametrize("kernel", ["softmax", "relu"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_matches_explicit_kernel_matrix(self, kernel, causal):
        # Against the quadratic-time formula with the same features: checks
        # the factorised (and chunked causal) sums, masking included.
        q, k, v = random_qkv(3, length=300)
        key_mask = np.ones((2, 300), bool)
        key_mask[0, 100:] = False
        key_mask[1, ::3] = False
        w = to_numpy(orthogonal_random_features(16, 8, seed=0))
        actual = favor_attention(q, k, v, w, kernel=kernel, causal=causal, key_mask=key_mask, eps=1e-3)
        q_features = np_features(q, w, kernel, True, eps=1e-3)
        # Masked keys have zero features and do not enter the keys' stabiliser.
        k_features = np.zeros(q_features.shape)
        for b in range(2):
            valid_keys = k[b][key_mask[b]][None]
            k_features[b, key_mask[b]] = np_features(valid_keys, w, kernel, False, eps=1e-3)[0]
        expected = np_kernel_attention(q_features, k_features, v, causal=causal, key_mask=key_mask)
        self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-4)

    @pytest.mark.parametrize("kernel", ["softmax", "relu"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_single_head_without_head_axis(self, kernel, causal):
        # (B, L, d) inputs: the explicit kernel matrix of one head.
        q, k, v = random_qkv(6, length=40, heads=1)
        key_mask = np.ones((2, 40), bool)
        key_mask[1, 25:] = False
        w = to_numpy(orthogonal_random_features(16, 8, seed=0))
        actual = favor_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], w, kernel, causal, key_mask, eps=1e-3)
        q_features = np_features(q, w, kernel, True, eps=1e-3)
        k_features = np.zeros(q_features.shape)
        for b in range(2):
            k_features[b, key_mask[b]] = np_features(k[b][key_mask[b]][None], w, kernel, False, eps=1e-3)[0]
        expected = np_kernel_attention(q_features, k_features, v, causal=causal, key_mask=key_mask)
        assert tuple(actual.shape) == (2, 40, v.shape[-1])
        self.assertAllClose(actual, expected[:, :, 0], atol=1e-5, rtol=1e-4)

    @pytest.mark.parametrize("causal", [False, True])
    def test_key_mask_equals_dropping_keys(self, causal):
        q, k, v = random_qkv(4)
        w = orthogonal_random_features(16, 8, seed=0)
        # Mask the last 6 keys of element 0 and none of element 1.
        key_mask = np.ones((2, 12), "float32")
        key_mask[0, 6:] = 0
        k_garbage = k.copy()
        k_garbage[0, 6:] = 50.0  # huge masked keys must not touch the stabiliser
        masked = to_numpy(favor_attention(q, k_garbage, v, w, causal=causal, key_mask=key_mask))
        dropped = to_numpy(favor_attention(q[:1, :6], k[:1, :6], v[:1, :6], w, causal=causal))
        self.assertAllClose(masked[0, :6], dropped[0], atol=1e-6, rtol=1e-5)
        if not causal:
            dropped = to_numpy(favor_attention(q[:1], k[:1, :6], v[:1, :6], w))
            self.assertAllClose(masked[0], dropped[0], atol=1e-6, rtol=1e-5)
        self.assertAllClose(masked[1], to_numpy(favor_attention(q, k, v, w, causal=causal))[1], atol=1e-6)

    def test_fully_masked_gives_zeros(self):
        q, k, v = random_qkv(5)
        w = orthogonal_random_features(16, 8, seed=0)
        out = to_numpy(favor_attention(q, k, v, w, key_mask=np.zeros((2, 12), bool)))
        np.testing.assert_array_equal(out, 0.0)

    @pytest.mark.parametrize("kernel, causal", [("softmax", True), ("softmax", False), ("relu", True)])
    def test_gradients_are_finite(self, kernel, causal):
        key_mask = np.ones((2, 12), bool)
        key_mask[0, 5:] = False
        w = orthogonal_random_features(16, 8, seed=0)

        def loss(q, k, v):
            out = favor_attention(q, k, v, w, kernel=kernel, causal=causal, key_mask=key_mask)
            return ops.sum(ops.square(out))

        # std 100: logits of order 1e4, far beyond exp's float32 range.
        for std in (1.0, 100.0):
            grads = gradients(loss, *random_qkv(6, std=std))
            for g in grads:
                assert np.all(np.isfinite(g)), std
            assert np.any(grads[0] != 0) and np.any(grads[2] != 0), std
            # Masked keys get no gradient.
            np.testing.assert_array_equal(grads[1][0, 5:], 0.0)
            np.testing.assert_array_equal(grads[2][0, 5:], 0.0)

    @pytest.mark.parametrize("kernel", ["softmax", "relu"])
    def test_single_head_path_has_the_general_paths_values_and_gradients(self, kernel):
        # Without a head axis, non-causal attention takes its own two-product
        # path (with per-backend layouts of the features); with a head axis
        # of size 1 it takes the general einsum path. Same function.
        w = orthogonal_random_features(16, 8, seed=0)
        weights = np.random.default_rng(1).normal(size=(2, 40, 5)).astype("float32")

        def single_head(q, k, v):
            out = favor_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], w, kernel=kernel, eps=1e-3)
            return ops.sum(ops.multiply(out, weights))

        def general(q, k, v):
            out = favor_attention(q, k, v, w, kernel=kernel, eps=1e-3)
            return ops.sum(ops.multiply(out[:, :, 0], weights))

        qkv = random_qkv(8, length=40, heads=1, std=2.0)
        self.assertAllClose(to_numpy(single_head(*qkv)), to_numpy(general(*qkv)), rtol=1e-5)
        for actual, expected in zip(gradients(single_head, *qkv), gradients(general, *qkv)):
            assert np.any(expected != 0)
            self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-4)

    @pytest.mark.skipif(BACKEND != "torch", reason="the memory layout of torch results")
    @pytest.mark.parametrize("masked", [False, True])
    def test_single_head_result_is_contiguous_on_torch(self, masked):
        # A transposed (strided) result made every elementwise op that mixed
        # it with contiguous tensors (a non-local block's residual, the
        # gradients) several times slower on torch.
        q, k, v = (x[:, :, 0] for x in random_qkv(8, length=12, heads=1))
        mask = np.arange(12)[None, :] < np.array([[12], [7]]) if masked else None
        w = orthogonal_random_features(16, 8, seed=0)
        out = favor_attention(q, k, v, w, key_mask=mask, value_kernel=np.ones((v.shape[-1], 3), "float32"))
        assert tuple(out.shape) == (2, 12, 3) and out.is_contiguous()

    @pytest.mark.parametrize("heads,causal,masked", [(None, False, False), (None, False, True), (None, True, True), (2, False, True)])
    def test_value_kernel_equals_projecting_the_values(self, heads, causal, masked):
        # One head, not causal: the projection is applied to the key-value
        # summary; otherwise to the values. Either way the explicit kernel
        # matrix over `v @ K + b`, and the gradients of projecting first.
        q, k, v = random_qkv(11, length=30, heads=heads or 1)
        if heads is None:
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        rng = np.random.default_rng(12)
        kernel = rng.normal(size=(5, 3)).astype("float32")
        bias = rng.normal(size=(3,)).astype("float32")
        key_mask = None
        if masked:
            key_mask = np.ones((2, 30), bool)
            key_mask[1, 20:] = False
        w = orthogonal_random_features(16, 8, seed=0)
        actual = favor_attention(q, k, v, w, causal=causal, key_mask=key_mask, eps=1e-3, value_kernel=kernel, value_bias=bias)
        with_heads = (lambda x: x) if heads else (lambda x: x[:, :, None])
        q_features = np_features(with_heads(q), to_numpy(w), eps=1e-3)
        k_features = np.zeros(q_features.shape)
        mask = np.ones((2, 30), bool) if key_mask is None else key_mask
        for b in range(2):
            k_features[b, mask[b]] = np_features(with_heads(k)[b][mask[b]][None], to_numpy(w), is_query=False, eps=1e-3)[0]
        projected = with_heads(v) @ kernel + bias
        expected = np_kernel_attention(q_features, k_features, projected, causal=causal, key_mask=mask)
        assert tuple(actual.shape) == tuple(projected.shape[:2]) + (() if heads is None else (heads,)) + (3,)
        self.assertAllClose(actual, expected if heads else expected[:, :, 0], atol=1e-5, rtol=1e-4)

        weights = rng.normal(size=tuple(actual.shape)).astype("float32")

        def on_summary(q, k, v, kernel, bias):
            out = favor_attention(q, k, v, w, causal=causal, key_mask=key_mask, eps=1e-3, value_kernel=kernel, value_bias=bias)
            return ops.sum(ops.multiply(out, weights))

        def projected_first(q, k, v, kernel, bias):
            out = favor_attention(q, k, ops.matmul(v, kernel) + bias, w, causal=causal, key_mask=key_mask, eps=1e-3)
            return ops.sum(ops.multiply(out, weights))

        args = (q, k, v, kernel, bias)
        for actual_grad, expected_grad in zip(gradients(on_summary, *args), gradients(projected_first, *args)):
            assert np.any(expected_grad != 0)
            self.assertAllClose(actual_grad, expected_grad, atol=1e-5, rtol=1e-4)

    def test_value_kernel_without_bias_and_bad_shapes(self):
        q, k, v = random_qkv(13, heads=1)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        w = orthogonal_random_features(16, 8, seed=0)
        kernel = np.random.default_rng(14).normal(size=(5, 4)).astype("float32")
        self.assertAllClose(
            favor_attention(q, k, v, w, value_kernel=kernel), favor_attention(q, k, v @ kernel, w), atol=1e-5, rtol=1e-4
        )
        with pytest.raises(ValueError, match=r"value_kernel.*\(5, d_out\).*shape \(4, 4\)"):
            favor_attention(q, k, v, w, value_kernel=kernel[:4])
        with pytest.raises(ValueError, match=r"value_bias.*\(4,\).*shape \(5,\)"):
            favor_attention(q, k, v, w, value_kernel=kernel, value_bias=np.zeros(5, "float32"))
        with pytest.raises(ValueError, match="value_bias` needs a `value_kernel"):
            favor_attention(q, k, v, w, value_bias=np.zeros(4, "float32"))

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_half_precision_inputs(self, dtype):
        # Internals run in float32; large logits that overflow float16's exp
        # stay finite, and the result comes back in the query's dtype.
        q, k, v = random_qkv(7, std=10.0)
        w = orthogonal_random_features(16, 8, seed=0)
        out = favor_attention(ops.cast(q, dtype), ops.cast(k, dtype), ops.cast(v, dtype), w, causal=True)
        assert keras.backend.standardize_dtype(out.dtype) == dtype
        self.assertAllFinite(out)
        reference = favor_attention(
            to_numpy(ops.cast(q, dtype)).astype("float32"),
            to_numpy(ops.cast(k, dtype)).astype("float32"),
            to_numpy(ops.cast(v, dtype)).astype("float32"),
            w,
            causal=True,
        )
        self.assertAllClose(out, reference, atol=0.05, rtol=0.05)

    def test_custom_scale(self):
        # NonLocalBlock calls it with scale=1 (logits theta^T phi, no 1/sqrt(d)).
        q, k, v = random_qkv(8, std=0.3)
        exact, _ = np_softmax_attention(q, k, v, scale=1.0)
        errors = []
        for seed in range(4):
            w = orthogonal_random_features(1024, 8, seed=seed)
            errors.append(np.linalg.norm(to_numpy(favor_attention(q, k, v, w, scale=1.0)) - exact, axis=-1))
        predicted = np.sqrt(np.mean(first_order_mse(q, k, v, 1024, scale=1.0)))
        assert np.sqrt(np.mean(np.square(errors))) < 1.5 * predicted

    def test_causal_length_mismatch_raises(self):
        q, k, v = random_qkv(0)
        w = orthogonal_random_features(16, 8, seed=0)
        with pytest.raises(ValueError, match="causal=True"):
            favor_attention(q[:, :5], k, v, w, causal=True)

    def test_jit_compiles(self):
        if BACKEND == "jax":
            import jax

            compile_fn = jax.jit
        elif BACKEND == "tensorflow":
            import tensorflow as tf

            def compile_fn(f):
                return tf.function(f, jit_compile=True)
        else:
            pytest.skip("XLA compilation is for TensorFlow and JAX")
        q, k, v = random_qkv(9, length=300)

        def fn(q, k, v):
            w = orthogonal_random_features(16, 8, seed=0)
            return favor_attention(q, k, v, w, causal=True)

        self.assertAllClose(compile_fn(fn)(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)


def test_docstring_examples():
    results = doctest.testmod(favor_module, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0 and results.failed == 0, results
