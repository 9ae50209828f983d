import doctest
import json

import keras
import numpy as np
import pytest
from keras import ops

from keras_avae.layers import NonLocalBlock
from keras_avae.layers import non_local_block
from keras_avae.ops.favor import orthogonal_random_features
from tests.test_case import TestCase
from tests.test_case import gradients
from tests.test_case import largest_intermediate_size
from tests.test_case import to_numpy

B, H, W, C, K = 2, 5, 7, 6, 4


def _input(shape=(B, H, W, C), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _set_random_weights(block, qk_std, seed=1):
    """Random conv weights (theta/phi kernels and biases with std `qk_std`), gamma 0.8."""
    rng = np.random.default_rng(seed)
    params = {}
    for v in block.weights:
        name = v.path.split("/")[-1] if v.path.endswith("gamma") else "/".join(v.path.split("/")[-2:])
        if name == "gamma":
            value = np.float32(0.8)
        else:
            std = 0.5 if name.startswith("g/") else qk_std
            value = (std * rng.normal(size=v.shape)).astype("float32")
        v.assign(value)
        params[name] = np.asarray(value, np.float64)
    return params


def _np_conv1x1(x, params, name):
    return np.einsum("bhwc,ck->bhwk", x, params[f"{name}/kernel"][0, 0]) + params[f"{name}/bias"]


def _np_projections(x, params):
    x = np.asarray(x, np.float64)
    batch = x.shape[0]
    theta, phi, g = (
        _np_conv1x1(x, params, n).reshape(batch, -1, params[f"{n}/kernel"].shape[-1]) for n in ("theta", "phi", "g")
    )
    return x, theta, phi, g


def _np_non_local(x, params):
    """Exact non-local block, float64: x + gamma * softmax(theta phi^T) g."""
    x, theta, phi, g = _np_projections(x, params)
    logits = np.einsum("bpk,bqk->bpq", theta, phi)
    a = np.exp(logits - logits.max(axis=-1, keepdims=True))
    a /= a.sum(axis=-1, keepdims=True)
    return x + params["gamma"] * np.einsum("bpq,bqc->bpc", a, g).reshape(x.shape)


def _np_favor_non_local(x, params, features):
    """FAVOR+ non-local block, float64, from the positive random feature map.

    phi(u) = m^-1/2 exp(W u - |u|^2 / 2) estimates exp(q . k) (logit scale 1);
    attention is D^-1 phi(Q) (phi(K)^T g) with D = phi(Q) (phi(K)^T 1).
    """
    x, theta, phi, g = _np_projections(x, params)
    w = np.asarray(features, np.float64)

    def feature_map(u):
        return np.exp(u @ w.T - 0.5 * np.sum(u**2, axis=-1, keepdims=True)) / np.sqrt(w.shape[0])

    q, k = feature_map(theta), feature_map(phi)
    numerator = np.einsum("bpm,bmc->bpc", q, np.einsum("bqm,bqc->bmc", k, g))
    denominator = np.einsum("bpm,bm->bp", q, k.sum(axis=1))
    return x + params["gamma"] * (numerator / denominator[..., None]).reshape(x.shape)


def _relative_error(actual, desired):
    return np.linalg.norm(actual - desired) / np.linalg.norm(desired)


class TestNonLocalBlock(TestCase):
    @pytest.mark.parametrize("attention", ["softmax", "performer"])
    def test_identity_at_initialization(self, attention):
        x = _input()
        block = NonLocalBlock(key_dim=K, attention=attention, num_random_features=16, seed=0)
        np.testing.assert_array_equal(to_numpy(block(x)), x)
        # gamma is the only thing that makes it the identity.
        assert float(to_numpy(block.gamma)) == 0.0

    def test_softmax_matches_numpy_reference(self):
        x = _input()
        block = NonLocalBlock(key_dim=K)
        block(x)
        params = _set_random_weights(block, qk_std=0.6)
        self.assertAllClose(block(x), _np_non_local(x, params), atol=1e-5, rtol=1e-5)

    def test_no_bias(self):
        x = _input()
        block = NonLocalBlock(key_dim=K, use_bias=False)
        block(x)
        assert len(block.trainable_weights) == 4
        params = _set_random_weights(block, qk_std=0.6)
        params.update({f"{n}/bias": 0.0 for n in ("theta", "phi", "g")})
        self.assertAllClose(block(x), _np_non_local(x, params), atol=1e-5, rtol=1e-5)

    def test_performer_matches_numpy_favor(self):
        # The performer path is FAVOR+ of (theta, phi, g) with logit scale 1,
        # using the random features drawn from the block's seed.
        x = _input()
        block = NonLocalBlock(key_dim=K, attention="performer", num_random_features=32, seed=7)
        block(x)
        params = _set_random_weights(block, qk_std=0.3)
        features = to_numpy(orthogonal_random_features(32, K, seed=7))
        # Tolerance: FAVOR+ adds eps = 1e-6 (relative to the largest feature)
        # to every feature, which the reference leaves out.
        self.assertAllClose(block(x), _np_favor_non_local(x, params, features), atol=1e-4, rtol=1e-3)

    @pytest.mark.parametrize("use_bias", [True, False])
    def test_performer_values_and_gradients_equal_projecting_every_position(self, use_bias):
        # The performer path applies `g` to FAVOR+'s key-value summary; a
        # subclass whose `g` is not a plain `Conv2D` takes the path that
        # computes g(x) at every position. Same function.
        class PlainConv(keras.layers.Conv2D):
            pass

        class EveryPosition(NonLocalBlock):
            def _conv(self, filters, name):
                conv = super()._conv(filters, name)
                return PlainConv.from_config(conv.get_config()) if name == "g" else conv

        x = _input()
        fast = NonLocalBlock(key_dim=K, attention="performer", num_random_features=16, use_bias=use_bias, seed=3)
        slow = EveryPosition(key_dim=K, attention="performer", num_random_features=16, use_bias=use_bias, seed=3)
        fast(x)
        slow(x)
        _set_random_weights(fast, qk_std=0.5)
        slow.set_weights(fast.get_weights())
        assert non_local_block._is_pointwise(fast.g) and not non_local_block._is_pointwise(slow.g)
        self.assertAllClose(fast(x), slow(x), atol=1e-5, rtol=1e-5)
        weights = _input(x.shape, seed=4)

        def loss(y):
            return ops.sum(ops.multiply(y, weights))

        (fast_x, fast_w), (slow_x, slow_w) = (gradients(b, loss, {"inputs": x}) for b in (fast, slow))
        self.assertAllClose(fast_x["inputs"], slow_x["inputs"], atol=1e-5, rtol=1e-4)
        for actual, expected in zip(fast_w, slow_w):
            assert np.any(expected != 0)
            self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-4)

    def test_attention_map_softmax_is_the_numpy_softmax_row(self):
        x = _input()
        block = NonLocalBlock(key_dim=K)
        block(x)
        params = _set_random_weights(block, qk_std=0.6)
        _, theta, phi, _ = _np_projections(x, params)
        logits = np.einsum("bpk,bqk->bpq", theta, phi)
        a = np.exp(logits - logits.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        positions = [(0, 0), (4, 6), (2, 3)]
        maps = to_numpy(block.attention_map(x, positions))
        assert maps.shape == (B, 3, H, W)
        for i, (r, c) in enumerate(positions):
            self.assertAllClose(maps[:, i].reshape(B, -1), a[:, r * W + c], atol=1e-6, rtol=1e-5)

    @pytest.mark.parametrize("attention", ["softmax", "performer"])
    def test_attention_map_reproduces_the_block_output(self, attention):
        # out[p] = x[p] + gamma * sum_q A[p, q] g(x)[q], with the maps as A:
        # in performer mode these are the FAVOR+ weights the block uses.
        x = _input()
        block = NonLocalBlock(key_dim=K, attention=attention, num_random_features=32, seed=3)
        block(x)
        params = _set_random_weights(block, qk_std=0.4)
        _, _, _, g = _np_projections(x, params)
        positions = [(r, c) for r in range(H) for c in range(W)]
        maps = to_numpy(block.attention_map(x, positions)).reshape(B, H * W, H * W)
        self.assertAllClose(maps.sum(axis=-1), np.ones((B, H * W)), atol=1e-5)
        expected = x.reshape(B, H * W, C) + 0.8 * np.einsum("bpq,bqc->bpc", maps, g)
        self.assertAllClose(to_numpy(block(x)).reshape(B, H * W, C), expected, atol=1e-4, rtol=1e-4)

    def test_attention_map_rejects_positions_outside(self):
        x = _input()
        block = NonLocalBlock(key_dim=K)
        block(x)
        with pytest.raises(ValueError, match=r"query_positions.*\[0, 5\) x \[0, 7\).*\(5, 0\)"):
            block.attention_map(x, [(5, 0)])
        with pytest.raises(ValueError, match="at least one position"):
            block.attention_map(x, [])

    @pytest.mark.parametrize("attention", ["softmax", "performer"])
    def test_attention_map_builds_an_unbuilt_block(self, attention):
        # A block that was never called is built from the input's shape, as
        # calling it would: same weights (paths included), same maps.
        x = _input()
        positions = [(0, 0), (4, 6), (2, 3)]
        fresh = NonLocalBlock(key_dim=K, attention=attention, num_random_features=16, seed=3)
        fresh_maps = to_numpy(fresh.attention_map(x, positions))
        assert fresh.built
        called = NonLocalBlock(key_dim=K, attention=attention, num_random_features=16, seed=3)
        called(x)
        assert [w.path.split("/", 1)[1] for w in fresh.weights] == [w.path.split("/", 1)[1] for w in called.weights]
        called.set_weights(fresh.get_weights())
        self.assertAllClose(fresh_maps, to_numpy(called.attention_map(x, positions)), atol=1e-6)
        # Real, non-uniform maps, and the block still calls (no second build).
        assert fresh_maps.shape == (B, 3, H, W) and np.ptp(fresh_maps) > 1e-3
        self.assertAllClose(to_numpy(fresh(x)), x)
        assert len(fresh.weights) == len(called.weights)

    def test_performer_approaches_softmax(self):
        # Same weights in both modes; FAVOR+'s error falls roughly as m^-1/2.
        x = _input((B, 8, 8, C))
        exact_block = NonLocalBlock(key_dim=K)
        exact_block(x)
        params = _set_random_weights(exact_block, qk_std=0.15)
        exact = _np_non_local(x, params) - x
        self.assertAllClose(to_numpy(exact_block(x)) - x, exact, atol=1e-5, rtol=1e-4)
        errors = {}
        for m in (16, 128, 1024):
            # Training calls of a redrawing block: a fresh draw each time.
            performer = NonLocalBlock(
                key_dim=K, attention="performer", num_random_features=m, feature_redraw="training", seed=m
            )
            performer(x)
            performer.set_weights(exact_block.get_weights())
            errors[m] = np.mean(
                [_relative_error(to_numpy(performer(x, training=True)) - x, exact) for _ in range(8)]
            )
        # Measured with these seeds: 0.09-0.15, 0.046-0.050, 0.015-0.020
        # across TensorFlow, JAX and torch.
        assert errors[16] > errors[128] > errors[1024], errors
        assert errors[1024] < errors[16] / 3, errors
        assert errors[1024] < 0.04, errors

    def test_performer_never_forms_the_attention_matrix(self):
        size = 64 * 64
        x = _input((1, 64, 64, 8))
        performer = NonLocalBlock(key_dim=K, attention="performer", num_random_features=64, seed=0)
        performer(x)
        params = _set_random_weights(performer, qk_std=0.15)
        # Linear in HW: nothing near the HW^2 = 16.8M elements of the matrix.
        assert largest_intermediate_size(performer, x) < size * size // 16
        # The probe finds the (HW x HW) matrix of the exact block.
        exact = NonLocalBlock(key_dim=K)
        exact(x)
        exact.set_weights(performer.get_weights())
        assert largest_intermediate_size(exact, x) >= size * size
        # And the large map gives a sensible answer.
        output = to_numpy(performer(x))
        self.assertAllFinite(output)
        reference = _np_non_local(x, params) - x
        assert _relative_error(output - x, reference) < 0.2

    def test_feature_redraw(self):
        x = _input()
        fixed = NonLocalBlock(key_dim=K, attention="performer", num_random_features=8, seed=3)
        redraw = NonLocalBlock(
            key_dim=K, attention="performer", num_random_features=8, feature_redraw="training", seed=3
        )
        fixed(x)
        redraw(x)
        _set_random_weights(fixed, qk_std=0.3)
        redraw.set_weights(fixed.get_weights())
        reference = to_numpy(fixed(x))
        # "fixed" uses the same features in training; "training" redraws.
        self.assertAllClose(fixed(x, training=True), reference)
        first, second = to_numpy(redraw(x, training=True)), to_numpy(redraw(x, training=True))
        assert np.max(np.abs(first - second)) > 1e-4
        assert np.max(np.abs(first - reference)) > 1e-4
        # At inference both use the draw from the integer seed.
        self.assertAllClose(redraw(x, training=False), reference)
        assert fixed.seed_generator is None and redraw.seed_generator is not None

    def test_numpy_integers_are_stored_as_python_ints(self):
        # Before: NumPy `key_dim` and `num_random_features` were refused, and a
        # NumPy seed (refused too) would have left the config unserialisable.
        kwargs = {"key_dim": K, "num_random_features": 8, "seed": 3}
        numpy_kwargs = {k: np.int64(v) for k, v in kwargs.items()}
        block = NonLocalBlock(attention="performer", feature_redraw="training", **numpy_kwargs)
        config = block.get_config()
        assert [type(config[k]) for k in kwargs] == [int, int, int]
        json.dumps(keras.saving.serialize_keras_object(block))
        twin = NonLocalBlock(attention="performer", feature_redraw="training", **kwargs)
        x = _input()
        block(x)
        twin(x)
        _set_random_weights(block, qk_std=0.3)
        twin.set_weights(block.get_weights())
        for training in (False, True):  # the fixed features, then a redraw
            self.assertAllClose(block(x, training=training), twin(x, training=training), atol=0, rtol=0)

    def test_unseeded_block_resolves_its_seed_in_the_config(self):
        block = NonLocalBlock(attention="performer")
        assert isinstance(block.seed, int)
        assert NonLocalBlock.from_config(block.get_config()).seed == block.seed

    def test_dynamic_spatial_shape(self):
        block = NonLocalBlock(key_dim=K)
        inputs = keras.Input((None, None, C))
        model = keras.Model(inputs, block(inputs))
        params = _set_random_weights(block, qk_std=0.6)
        for shape in ((B, 3, 4, C), (1, 6, 2, C)):
            x = _input(shape)
            self.assertAllClose(model.predict(x, verbose=0), _np_non_local(x, params), atol=1e-5, rtol=1e-5)

    def test_mixed_precision_close_to_float32(self):
        x = _input()
        reference = NonLocalBlock(key_dim=K)
        reference(x)
        params = _set_random_weights(reference, qk_std=0.6)
        expected = _np_non_local(x, params)
        for policy, tol in (("mixed_float16", 1e-2), ("mixed_bfloat16", 6e-2)):
            block = NonLocalBlock(key_dim=K, dtype=policy)
            block(x)
            block.set_weights(reference.get_weights())
            output = block(x)
            assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
            self.assertAllClose(output, expected, atol=tol, rtol=tol, msg=policy)

    def test_mixed_float16_logits_beyond_float16_range(self):
        # Protects the float32 cast of the projections: in float16 the logits
        # theta . phi (here 9e4 and 1.6e5 > 65504) overflow and softmax gives NaN.
        rng = np.random.default_rng(5)
        q, _ = np.linalg.qr(rng.normal(size=(K, K)))
        x = np.zeros((2, 2, 2, C), "float32")
        x[..., K:] = rng.normal(size=(2, 2, 2, C - K))
        # Position p of image b is s_b e_p on the first K channels: theta and
        # phi are s_b q^T e_p, so the logits are s_b^2 on the diagonal and 0
        # elsewhere; A is the identity even after float16 rounding.
        x[..., :K] = np.array([300.0, 400.0])[:, None, None, None] * np.eye(K).reshape(2, 2, K)
        kernel = np.concatenate([q, np.zeros((C - K, K))]).astype("float32")[None, None]
        reference = NonLocalBlock(key_dim=K)
        reference(x)
        params = _set_random_weights(reference, qk_std=0.5)
        for name in ("theta", "phi"):
            getattr(reference, name).kernel.assign(kernel)
            getattr(reference, name).bias.assign(np.zeros(K, "float32"))
            params[f"{name}/kernel"], params[f"{name}/bias"] = kernel.astype(np.float64), np.zeros(K)
        expected = to_numpy(reference(x))
        _, _, _, g = _np_projections(x, params)
        self.assertAllClose(expected, x + 0.8 * g.reshape(x.shape), atol=1e-3, rtol=1e-5)
        block = NonLocalBlock(key_dim=K, dtype="mixed_float16")
        block(x)
        block.set_weights(reference.get_weights())
        output = block(x)
        assert keras.backend.standardize_dtype(output.dtype) == "float16"
        self.assertAllFinite(output)
        # Float16 outputs of magnitude ~500 are rounded to ~0.25.
        self.assertAllClose(output, expected, atol=2e-3 * np.abs(expected).max(), rtol=0)
        # Float32 images, as `__call__` takes them (before: TensorFlow refused to add float16 and float32).
        maps = block.attention_map(x, [(0, 0), (1, 1)])
        assert keras.backend.standardize_dtype(maps.dtype) == "float32"
        self.assertAllClose(maps, np.eye(K).reshape(1, K, 2, 2)[:, [0, 3]].repeat(2, axis=0), atol=1e-6)

    def test_layer_battery_softmax(self):
        self.run_layer_test(
            NonLocalBlock,
            init_kwargs={"key_dim": K, "kernel_regularizer": "l2"},
            input_data=_input(),
            expected_output_shape=(B, H, W, C),
            expected_num_trainable_weights=7,
        )

    def test_layer_battery_performer(self):
        self.run_layer_test(
            NonLocalBlock,
            init_kwargs={
                "key_dim": K,
                "attention": "performer",
                "num_random_features": 16,
                "gamma_initializer": "ones",
            },
            input_data=_input(),
            expected_output_shape=(B, H, W, C),
            expected_num_trainable_weights=7,
        )

    def test_layer_battery_performer_redraw(self):
        # Redrawn features are random: no eager-vs-XLA comparison.
        self.run_layer_test(
            NonLocalBlock,
            init_kwargs={
                "key_dim": K,
                "attention": "performer",
                "num_random_features": 8,
                "feature_redraw": "training",
            },
            input_data=_input(),
            expected_output_shape=(B, H, W, C),
            run_jit_check=False,
            run_precision_checks=False,
        )

    @pytest.mark.parametrize("attention", ["softmax", "performer"])
    def test_gradients_are_finite(self, attention):
        x = _input()
        block = NonLocalBlock(key_dim=K, attention=attention, num_random_features=16, seed=0)
        block(x)
        _set_random_weights(block, qk_std=0.6)
        grad_x, grad_w = gradients(block, lambda y: ops.sum(ops.square(y)), {"inputs": x})
        for g in [grad_x["inputs"]] + grad_w:
            assert g is not None and np.all(np.isfinite(g))
            assert np.any(g != 0)

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"key_dim": 0}, "key_dim=0"),
            ({"key_dim": 2.0}, "key_dim=2.0"),
            ({"attention": "linear"}, "attention='linear'"),
            ({"num_random_features": -3}, "num_random_features=-3"),
            ({"feature_redraw": "always"}, "feature_redraw='always'"),
            ({"use_bias": 1}, "use_bias=1"),
            ({"seed": -1}, "seed=-1"),
            ({"seed": "0"}, "seed='0'"),
        ],
    )
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            NonLocalBlock(**kwargs)

    @pytest.mark.parametrize("seed", [False, True, 0.0, 3.0, -1, 2**31 - 1, 2**31, 2**32])
    @pytest.mark.parametrize("feature_redraw", ["fixed", "training"])
    def test_bad_seed(self, seed, feature_redraw):
        # `seed + 1` seeds the redraws, so the largest seed is 2**31 - 2.
        with pytest.raises(ValueError, match=rf"`seed` must be an integer in \[0, 2147483646\].*seed={seed!r}$"):
            NonLocalBlock(attention="performer", feature_redraw=feature_redraw, seed=seed)

    def test_largest_seed_works_with_redraws(self):
        block = NonLocalBlock(
            key_dim=K, attention="performer", num_random_features=8, feature_redraw="training", seed=2**31 - 2
        )
        x = _input()
        assert np.all(np.isfinite(to_numpy(block(x, training=True))))
        with pytest.raises(ValueError, match="seed=2147483647"):
            NonLocalBlock(attention="performer", feature_redraw="training", seed=2**31 - 1)

    def test_bad_input_shape(self):
        with pytest.raises(ValueError, match=r"rank 4.*shape \(2, 5, 6\)"):
            NonLocalBlock()(np.zeros((2, 5, 6), "float32"))
        with pytest.raises(ValueError, match=r"known channels.*shape \(None, 5, 6, None\)"):
            NonLocalBlock()(keras.KerasTensor((None, 5, 6, None)))
        # A built block: before, the backend's reshape error, or (rank 5) a silent run.
        block = NonLocalBlock(key_dim=K)
        block(_input())
        with pytest.raises(ValueError, match=rf"expected axis -1 of input shape to have value {C}"):
            block(_input((B, H, W, C + 1)))
        with pytest.raises(ValueError, match=r"expected ndim=4, found ndim=5"):
            block(_input((B, 2, H, W, C)))

    def test_docstring_example_runs(self):
        results = doctest.testmod(non_local_block)
        assert results.attempted > 0 and results.failed == 0
