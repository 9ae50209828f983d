import doctest
import math

import keras
import numpy as np
import pytest
from keras import ops

from keras_avae.layers import DepthwiseAttend
from keras_avae.layers import depthwise_attend
from tests.test_case import TestCase
from tests.test_case import gradients
from tests.test_case import largest_intermediate_size
from tests.test_case import to_numpy

B, H, W, Q, C = 2, 3, 4, 5, 6


def _inputs(num_contexts, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    query = (scale * rng.normal(size=(B, H, W, Q))).astype("float32")
    keys = [(scale * rng.normal(size=(B, H, W, Q))).astype("float32") for _ in range(num_contexts)]
    values = [rng.normal(loc=0.5, size=(B, H, W, C)).astype("float32") for _ in range(num_contexts)]
    return query, keys, values


# NumPy reference of eq. 3-6, float64.
def _np_layer_norm(x, gamma, beta, epsilon):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def _np_gelu(x):
    # The tanh approximation of GELU (as tfa.activations.gelu in the reference).
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _np_normalize(x, norm, epsilon):
    if norm is None:
        return x
    gamma, beta = norm
    return x + _np_gelu(_np_layer_norm(x, gamma, beta, epsilon))


def _np_attend(query, keys, values, scale, value_norm=None, output_norm=None, epsilon=1e-5):
    query = np.asarray(query, np.float64)
    logits = np.stack([np.sum(query * np.asarray(k, np.float64), axis=-1) for k in keys], axis=-1)
    logits = scale * logits
    alpha = np.exp(logits - logits.max(axis=-1, keepdims=True))
    alpha /= alpha.sum(axis=-1, keepdims=True)
    contexts = [_np_normalize(np.asarray(v, np.float64), value_norm, epsilon) for v in values]
    out = sum(alpha[..., m : m + 1] * c for m, c in enumerate(contexts))
    return _np_normalize(out, output_norm, epsilon), alpha


def _set_nontrivial_weights(layer, seed=1):
    """Scale and LayerNorm weights away from their initial 1 / 0."""
    rng = np.random.default_rng(seed)
    norms = {}
    if layer.learnable_scale:
        layer.scale.assign(0.7)
    for name in ("value_norm", "output_norm"):
        norm = getattr(layer, name)
        if norm is None:
            norms[name] = None
            continue
        gamma = rng.uniform(0.5, 1.5, size=(C,)).astype("float32")
        beta = rng.normal(scale=0.3, size=(C,)).astype("float32")
        norm.gamma.assign(gamma)
        norm.beta.assign(beta)
        norms[name] = (gamma.astype(np.float64), beta.astype(np.float64))
    return norms


class TestDepthwiseAttend(TestCase):
    @pytest.mark.parametrize(
        "normalize_values,normalize_output",
        [(True, True), (False, False), (True, False), (False, True)],
    )
    def test_matches_numpy_reference(self, normalize_values, normalize_output):
        query, keys, values = _inputs(4)
        layer = DepthwiseAttend(normalize_values=normalize_values, normalize_output=normalize_output)
        layer(query, keys, values)
        norms = _set_nontrivial_weights(layer)
        output, scores = layer(query, keys, values, return_attention_scores=True)
        expected, alpha = _np_attend(query, keys, values, 0.7, norms["value_norm"], norms["output_norm"])
        self.assertAllClose(output, expected, atol=1e-5, rtol=1e-5)
        self.assertAllClose(scores, alpha, atol=1e-6, rtol=1e-5)

    def test_scale_options(self):
        query, keys, values = _inputs(3, scale=2.0)
        # Fixed 1/sqrt(Q): no weights at all without normalisation.
        fixed = DepthwiseAttend(
            learnable_scale=False, initial_scale=None, normalize_values=False, normalize_output=False
        )
        output = fixed(query, keys, values)
        assert len(fixed.weights) == 0
        expected, _ = _np_attend(query, keys, values, 1.0 / math.sqrt(Q))
        self.assertAllClose(output, expected, atol=1e-5, rtol=1e-5)
        # Eq. 4 as printed: fixed scale 1.
        plain = DepthwiseAttend(learnable_scale=False, normalize_values=False, normalize_output=False)
        expected, _ = _np_attend(query, keys, values, 1.0)
        self.assertAllClose(plain(query, keys, values), expected, atol=1e-5, rtol=1e-5)
        # Learnable, starting from 1/sqrt(Q).
        learnable = DepthwiseAttend(initial_scale=None, normalize_values=False, normalize_output=False)
        learnable(query, keys, values)
        assert len(learnable.trainable_weights) == 1
        np.testing.assert_allclose(float(to_numpy(learnable.scale)), 1.0 / math.sqrt(Q), rtol=1e-6)

    def test_list_stacked_and_mixed_inputs_agree(self):
        query, keys, values = _inputs(3)
        layer = DepthwiseAttend()
        from_lists = layer(query, keys, values)
        _set_nontrivial_weights(layer)
        from_lists = layer(query, keys, values)
        stacked_keys, stacked_values = np.stack(keys, axis=1), np.stack(values, axis=1)
        self.assertAllClose(layer(query, stacked_keys, stacked_values), from_lists, atol=1e-5, rtol=1e-5)
        self.assertAllClose(layer(query, stacked_keys, values), from_lists, atol=1e-5, rtol=1e-5)
        self.assertAllClose(layer(query, tuple(keys), stacked_values), from_lists, atol=1e-5, rtol=1e-5)

    def test_number_of_contexts_can_change_between_calls(self):
        layer = DepthwiseAttend()
        query, keys, values = _inputs(2)
        layer(query, keys, values)
        norms = _set_nontrivial_weights(layer)
        num_weights = len(layer.weights)
        for n in (2, 5, 1):
            query, keys, values = _inputs(n, seed=n)
            expected, _ = _np_attend(query, keys, values, 0.7, norms["value_norm"], norms["output_norm"])
            self.assertAllClose(layer(query, keys, values), expected, atol=1e-5, rtol=1e-5)
            self.assertAllClose(
                layer(query, np.stack(keys, 1), np.stack(values, 1)), expected, atol=1e-5, rtol=1e-5
            )
        assert len(layer.weights) == num_weights

    def test_weights_are_a_convex_combination(self):
        query, keys, _ = _inputs(4, scale=2.0)
        layer = DepthwiseAttend(normalize_values=False, normalize_output=False)
        # Identical contexts: any weights that sum to 1 give the context back.
        context = np.random.default_rng(3).normal(size=(B, H, W, C)).astype("float32")
        output, scores = layer(query, keys, [context] * 4, return_attention_scores=True)
        self.assertAllClose(output, context, atol=1e-5, rtol=1e-5)
        scores = to_numpy(scores)
        assert np.all(scores > 0)
        np.testing.assert_allclose(scores.sum(axis=-1), 1.0, atol=1e-6)
        # Each output pixel lies between the contexts' min and max there.
        _, _, values = _inputs(4, seed=4)
        output = to_numpy(layer(query, keys, values))
        assert np.all(output <= np.max(values, axis=0) + 1e-5)
        assert np.all(output >= np.min(values, axis=0) - 1e-5)

    def test_large_logits_give_hard_attention(self):
        # Logits ~1e4: an unstabilised exp would overflow even in float32.
        query, keys, values = _inputs(3, scale=30.0)
        layer = DepthwiseAttend(normalize_values=False, normalize_output=False)
        output, scores = layer(query, keys, values, return_attention_scores=True)
        self.assertAllFinite(output)
        logits = np.stack([np.sum(query * k, -1) for k in keys], -1)
        winner = np.argmax(logits, axis=-1)
        expected = np.take_along_axis(np.stack(values, -2), winner[..., None, None], axis=-2)[..., 0, :]
        self.assertAllClose(output, expected, atol=1e-4, rtol=1e-4)

    def test_mixed_precision_close_to_float32(self):
        query, keys, values = _inputs(3)
        reference = DepthwiseAttend()
        reference(query, keys, values)
        norms = _set_nontrivial_weights(reference)
        expected, _ = _np_attend(query, keys, values, 0.7, norms["value_norm"], norms["output_norm"])
        for policy, tol in (("mixed_float16", 1e-2), ("mixed_bfloat16", 6e-2)):
            layer = DepthwiseAttend(dtype=policy)
            layer(query, keys, values)
            layer.set_weights(reference.get_weights())
            output = layer(query, keys, values)
            assert keras.backend.standardize_dtype(output.dtype) == policy.split("_")[1]
            self.assertAllClose(output, expected, atol=tol, rtol=tol, msg=policy)

    def test_float16_logits_do_not_overflow(self):
        # |q * k| = 90000 in one channel exceeds float16's 65504: before, that
        # product was inf in float16 and the softmax gave NaN.
        query = np.zeros((1, 1, 1, 2), "float32")
        query[..., 0] = 300.0
        keys = [query.copy(), np.zeros_like(query)]
        values = [np.ones((1, 1, 1, 3), "float32"), np.zeros((1, 1, 1, 3), "float32")]
        layer = DepthwiseAttend(normalize_values=False, normalize_output=False, dtype="mixed_float16")
        output, scores = layer(query, keys, values, return_attention_scores=True)
        self.assertAllClose(scores, [[[[1.0, 0.0]]]])
        self.assertAllClose(output, np.ones((1, 1, 1, 3)))

    def test_list_inputs_never_stack_the_contexts(self):
        # With C >> N the largest tensor of the list path is one context; a
        # stacked (B, N, H, W, C) copy would be N times larger.
        n, channels = 6, 64
        rng = np.random.default_rng(0)
        query = rng.normal(size=(B, H, W, Q)).astype("float32")
        keys = [rng.normal(size=(B, H, W, Q)).astype("float32") for _ in range(n)]
        values = [rng.normal(size=(B, H, W, channels)).astype("float32") for _ in range(n)]
        layer = DepthwiseAttend(normalize_values=False)
        layer(query, keys, values)
        one_context = B * H * W * channels
        assert largest_intermediate_size(layer, query, keys, values) == one_context
        # The probe does see a stacked copy when there is one.
        assert largest_intermediate_size(lambda *a: ops.stack(a[2], axis=1), query, keys, values) == n * one_context

    def test_layer_battery_list_inputs(self):
        query, keys, values = _inputs(3)
        self.run_layer_test(
            DepthwiseAttend,
            init_kwargs={"initial_scale": 0.5},
            input_data={"query": query, "keys": keys, "values": values},
            expected_output_shape=(B, H, W, C),
            expected_num_trainable_weights=5,
        )

    def test_layer_battery_stacked_inputs(self):
        query, keys, values = _inputs(2)
        self.run_layer_test(
            DepthwiseAttend,
            init_kwargs={"learnable_scale": False, "initial_scale": None, "normalize_output": False},
            input_data={"query": query, "keys": np.stack(keys, 1), "values": np.stack(values, 1)},
            expected_output_shape=(B, H, W, C),
            expected_num_trainable_weights=2,
        )

    def test_symbolic_call_with_attention_scores(self):
        query = keras.KerasTensor((None, H, W, Q))
        keys = [keras.KerasTensor((None, H, W, Q)) for _ in range(3)]
        values = keras.KerasTensor((None, 3, H, W, C))
        output, scores = DepthwiseAttend()(query, keys, values, return_attention_scores=True)
        assert output.shape == (None, H, W, C)
        assert scores.shape == (None, H, W, 3)

    def test_subclass_call_gives_its_own_symbolic_output(self):
        # Before: the symbolic call had the base class's output shape,
        # whatever the subclass's `call` returned.
        class EveryOtherRow(DepthwiseAttend):
            def call(self, query, keys, values, return_attention_scores=False):
                return super().call(query, keys, values)[:, ::2]

        query = keras.Input((H, W, Q))
        keys = [keras.Input((H, W, Q)) for _ in range(2)]
        values = [keras.Input((H, W, C)) for _ in range(2)]
        layer = EveryOtherRow()
        output = layer(query, keys, values)
        assert output.shape == (None, (H + 1) // 2, W, C)
        model = keras.Model([query, keys, values], output)
        data_query, data_keys, data_values = _inputs(2)
        expected = layer(data_query, data_keys, data_values)
        self.assertAllClose(model([data_query, data_keys, data_values]), expected, atol=1e-6)

    def test_gradients_are_finite(self):
        query, keys, values = _inputs(3, scale=3.0)
        layer = DepthwiseAttend()
        layer(query, keys, values)
        _set_nontrivial_weights(layer)
        grad_x, grad_w = gradients(
            layer,
            lambda y: ops.sum(ops.square(y)),
            {"query": query, "keys": keys, "values": values},
        )
        for g in keras.tree.flatten(grad_x) + grad_w:
            assert g is not None
            assert np.all(np.isfinite(g))
        # The scale, both LayerNorms and the keys all receive signal.
        assert all(np.any(g != 0) for g in grad_w)
        assert all(np.any(g != 0) for g in grad_x["keys"])

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"learnable_scale": 1}, "learnable_scale=1"),
            ({"normalize_values": "yes"}, "normalize_values='yes'"),
            ({"normalize_output": None}, "normalize_output=None"),
            ({"initial_scale": 0.0}, "initial_scale=0.0"),
            ({"initial_scale": -1}, "initial_scale=-1"),
            ({"initial_scale": float("nan")}, "initial_scale=nan"),
            ({"epsilon": 0}, "epsilon=0"),
        ],
    )
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            DepthwiseAttend(**kwargs)

    def test_bad_input_shapes(self):
        layer = DepthwiseAttend()
        query, keys, values = _inputs(3)
        wrong_q = [np.zeros((B, H, W, Q + 1), "float32")] * 3
        with pytest.raises(ValueError, match=r"as many channels as `query`.*keys_shape=\[\(2, 3, 4, 6\)"):
            layer(query, wrong_q, values)
        with pytest.raises(ValueError, match=r"at least one context.*keys with shape \[\]"):
            layer(query, [], [])
        with pytest.raises(ValueError, match=r"at least one context.*keys with shape \(2, 0, 3, 4, 5\)"):
            layer(query, np.zeros((B, 0, H, W, Q), "float32"), np.zeros((B, 0, H, W, C), "float32"))
        with pytest.raises(ValueError, match="same number of contexts.*3 keys.*2 values"):
            layer(query, keys, values[:2])
        with pytest.raises(ValueError, match=r"`query` must have rank 4.*shape \(2, 3, 4\)"):
            layer(query[..., 0], keys, values)
        with pytest.raises(ValueError, match=r"`keys` must be a rank-5 tensor.*shape \(2, 3, 4, 5\)"):
            layer(query, keys[0], values)
        with pytest.raises(ValueError, match=r"spatial shape of `query`.*values_shape"):
            layer(query, keys, [v[:, :2] for v in values])
        with pytest.raises(ValueError, match=r"same channels.*\(2, 3, 4, 7\)"):
            layer(query, keys, values[:2] + [np.zeros((B, H, W, C + 1), "float32")])
        # The layer built on none of the bad calls above and still works.
        assert layer(query, keys, values).shape == (B, H, W, C)

    def test_a_built_layer_names_wrong_channels(self):
        # Before: the LayerNorm's reshape error from the backend, or (query) a
        # silent run with a scale computed for other query channels.
        layer = DepthwiseAttend(initial_scale=None)
        query, keys, values = _inputs(2)
        layer(query, keys, values)
        wider = np.zeros((B, H, W, C + 1), "float32")
        with pytest.raises(ValueError, match=rf"`values` must have {C} channels, as when the layer was built"):
            layer(query, keys, [wider, wider])
        with pytest.raises(ValueError, match=rf"`values` must have {C} channels.*values_shape=\(2, 2, 3, 4, 7\)"):
            layer(query, np.stack(keys, 1), np.stack([wider, wider], 1))
        narrow = [np.zeros((B, H, W, Q - 1), "float32")] * 3
        with pytest.raises(ValueError, match=rf"`query` must have {Q} channels, as when the layer was built"):
            layer(narrow[0], narrow[1:], values)
        with pytest.raises(ValueError, match=rf"`values` must have {C} channels"):
            layer(keras.Input((H, W, Q)), [keras.Input((H, W, Q))], [keras.Input((H, W, C + 1))])

    def test_docstring_example_runs(self):
        results = doctest.testmod(depthwise_attend, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert results.attempted > 0 and results.failed == 0
