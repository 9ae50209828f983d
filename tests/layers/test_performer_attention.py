"""PerformerAttention against MultiHeadAttention, NumPy FAVOR+ and key dropping."""

import doctest
import re

import keras
import numpy as np
import pytest

from keras_avae.layers import PerformerAttention
from keras_avae.layers import performer_attention as performer_module
from keras_avae.ops import orthogonal_random_features
from tests.ops.test_favor import first_order_mse
from tests.ops.test_favor import np_features
from tests.ops.test_favor import np_kernel_attention
from tests.test_case import TestCase
from tests.test_case import to_numpy


def sequences(seed, batch=2, length=6, dim=8, std=1.0):
    return (std * np.random.default_rng(seed).normal(size=(batch, length, dim))).astype("float32")


def built_pair(num_random_features=16, seed=0, x=None, use_gate=False, **kwargs):
    """A MultiHeadAttention and a PerformerAttention (with `kwargs`) with the same weights."""
    x = sequences(0) if x is None else x
    keras.utils.set_random_seed(0)
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, use_gate=use_gate)
    mha(x, x)
    performer = PerformerAttention(
        num_heads=2, key_dim=4, num_random_features=num_random_features, seed=seed, use_gate=use_gate, **kwargs
    )
    performer(x, x)
    performer.set_weights(mha.get_weights())
    return mha, performer


def np_projections(mha, query, value):
    """MultiHeadAttention's projections, in NumPy, as (B, L, N, d)."""

    def dense(layer, x):
        return np.einsum("bld,dnh->blnh", x, to_numpy(layer.kernel)) + to_numpy(layer.bias)

    return dense(mha.query_dense, query), dense(mha.key_dense, value), dense(mha.value_dense, value)


class TestPerformerAttention(TestCase):
    @pytest.mark.parametrize(
        "init_kwargs, input_data, call_kwargs, expected_shape, num_weights",
        [
            (
                {"num_heads": 2, "key_dim": 4, "num_random_features": 16, "use_gate": True, "seed": 1},
                {"query": sequences(0), "value": sequences(1)},
                {"use_causal_mask": True},
                (2, 6, 8),
                10,
            ),
            (
                # No seed: the one resolved at construction must survive saving.
                {
                    "num_heads": 2,
                    "key_dim": 4,
                    "value_dim": 3,
                    "output_shape": 5,
                    "kernel": "relu",
                    "dropout": 0.2,
                    "feature_redraw": "training",
                    "orthogonal_scaling": "sqrt",
                },
                {"query": sequences(0), "value": sequences(1, length=7), "key": sequences(2, length=7, dim=3)},
                {},
                (2, 6, 5),
                8,
            ),
        ],
    )
    def test_layer_behaviours(self, init_kwargs, input_data, call_kwargs, expected_shape, num_weights):
        self.run_layer_test(
            PerformerAttention,
            init_kwargs,
            input_data,
            call_kwargs=call_kwargs,
            expected_output_shape=expected_shape,
            expected_num_trainable_weights=num_weights,
        )

    @pytest.mark.parametrize("use_gate", [False, True])
    def test_weights_are_multi_head_attentions(self, use_gate):
        mha, performer = built_pair(use_gate=use_gate)
        assert len(performer.weights) == len(mha.weights) == (10 if use_gate else 8)
        for p, m in zip(performer.trainable_weights, mha.trainable_weights):
            assert p.path.split("/")[1:] == m.path.split("/")[1:]
            assert tuple(p.shape) == tuple(m.shape)
        # The documented swap: MultiHeadAttention's config, then its weights.
        x = sequences(0)
        swapped = PerformerAttention.from_config({**mha.get_config(), "num_random_features": 16, "seed": 0})
        swapped.build(x.shape, x.shape)
        swapped.set_weights(mha.get_weights())
        self.assertAllClose(swapped(x, x), performer(x, x), atol=1e-6)

    @pytest.mark.parametrize("kernel", ["softmax", "relu"])
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("scaling", ["chi", "sqrt"])
    def test_matches_numpy_favor_on_the_projections(self, kernel, causal, scaling):
        # Exact plumbing check: MultiHeadAttention's projections (NumPy), the
        # layer's features (the `seed` draw, with its `orthogonal_scaling`),
        # the quadratic-time NumPy FAVOR+ formula, the output projection; a
        # padding mask on top.
        x = sequences(3)
        mha, performer = built_pair(seed=5, kernel=kernel, x=x, orthogonal_scaling=scaling)
        mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
        actual = performer(x, x, value_mask=mask, use_causal_mask=causal)
        q, k, v = np_projections(mha, x, x)
        w = to_numpy(orthogonal_random_features(16, 4, seed=5, scaling=scaling))
        if scaling == "sqrt":  # every row of norm sqrt(key_dim): not the "chi" draw
            np.testing.assert_allclose(np.linalg.norm(w, axis=-1), 2.0, rtol=1e-6)
        q_features = np_features(q, w, kernel, True)
        k_features = np.zeros(q_features.shape)
        for b in range(2):
            k_features[b, mask[b]] = np_features(k[b][mask[b]][None], w, kernel, False)[0]
        heads = np_kernel_attention(q_features, k_features, v, causal=causal, key_mask=mask)
        expected = np.einsum("btnh,nhe->bte", heads, to_numpy(mha.output_dense.kernel))
        expected += to_numpy(mha.output_dense.bias)
        self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-4)

    @pytest.mark.parametrize("causal", [False, True])
    def test_converges_to_multi_head_attention(self, causal):
        # `performer.set_weights(mha.get_weights())`, then the RMS error over
        # 8 seeds falls with m and stays below 1.5x its first-order iid
        # prediction (tests/ops/test_favor.py::first_order_mse, summed over
        # heads) times the output projection's spectral norm, which bounds how
        # much the projection can amplify the heads' error.
        x = sequences(4, std=0.5)
        mha, _ = built_pair(x=x)
        exact = to_numpy(mha(x, x, use_causal_mask=causal))
        q, k, v = np_projections(mha, x, x)
        w_out = to_numpy(mha.output_dense.kernel)
        gain = np.linalg.norm(w_out.reshape(-1, w_out.shape[-1]), ord=2)
        errors = []
        for m in (16, 64, 256, 1024):
            per_seed = []
            for seed in range(8):
                performer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=m, seed=seed)
                performer(x, x)
                performer.set_weights(mha.get_weights())
                out = to_numpy(performer(x, x, use_causal_mask=causal))
                per_seed.append(np.linalg.norm(out - exact, axis=-1))
            rms = np.sqrt(np.mean(np.square(per_seed)))
            predicted = gain * np.sqrt(np.mean(first_order_mse(q, k, v, m, causal=causal).sum(axis=1)))
            assert rms < 1.5 * predicted, (m, rms, predicted)
            errors.append(rms)
        assert all(a > b for a, b in zip(errors, errors[1:])), errors
        # m^-1/2 predicts a factor 8 from 16 to 1024 features; at m=16 the
        # error saturates, so ask for 3 (measured: 4.8 to 7.2 for 8 weight
        # initialisations on PyTorch).
        assert errors[-1] < errors[0] / 3, errors

    def test_padding_masks_equal_dropping_keys(self):
        query, value = sequences(5), sequences(6, length=7)
        performer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=0)
        mask = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 0, 1, 1]], bool)
        garbage = value.copy()
        garbage[~mask] = 1e3  # masked keys' values must not matter at all
        expected = np.concatenate(
            [to_numpy(performer(query[b : b + 1], value[b : b + 1, mask[b]])) for b in range(2)]
        )
        # Masks that differ but intersect in `mask`: only keys valid in all of them count.
        value_only = np.array([[0, 0, 0, 0, 0, 1, 0], [0, 1, 0, 0, 0, 0, 0]], bool)
        key_only = np.array([[0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0, 0]], bool)
        for kwargs in (
            {"value_mask": mask},
            {"key": garbage, "key_mask": mask, "value_mask": mask},
            {"key": garbage, "key_mask": mask | key_only, "value_mask": mask | value_only},
            {"value_mask": mask | value_only, "attention_mask": (mask | key_only)[:, None, :]},
            {"key_mask": mask | key_only, "value_mask": mask | value_only, "attention_mask": mask[:, None, :]},
            {"attention_mask": mask[:, None, :]},  # MultiHeadAttention's (B, T, S) with T = 1
            {"attention_mask": mask[:, None, None, :].astype("int32")},  # (B, heads, T, S), heads = 1
        ):
            actual = performer(query, garbage, **kwargs)
            self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-5, msg=str(list(kwargs)))

    def test_keras_mask_propagation(self):
        tokens = np.array([[3, 1, 4, 1, 0, 0], [5, 9, 2, 6, 5, 0]])
        embedding = keras.layers.Embedding(10, 8, mask_zero=True)
        performer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=0)
        inputs = keras.Input((6,), dtype="int32")
        embedded = embedding(inputs)
        model = keras.Model(inputs, performer(embedded, embedded))
        actual = model(tokens)
        x = to_numpy(embedding(tokens))
        # The embedding's mask reaches the layer as its query and value masks.
        valid = tokens != 0
        expected = performer(x.astype("float32"), x.astype("float32"), query_mask=valid, value_mask=valid)
        self.assertAllClose(actual, expected, atol=1e-6)
        # The query's mask is propagated to the output.
        np.testing.assert_array_equal(to_numpy(actual._keras_mask), tokens != 0)

    def test_unsupported_masks_and_scores_raise(self):
        x = sequences(0)
        performer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=0)
        query_dependent = r"depends on the query position.*Received: attention_mask.shape="
        for shape in ((2, 6, 6), (6, 6), (1, 6, 6), (2, 1, 6, 6)):
            with pytest.raises(ValueError, match=query_dependent + re.escape(str(shape))):
                performer(x, x, attention_mask=np.ones(shape, bool))
        # MultiHeadAttention reads a 2-D mask as (T, S). With as many batch
        # elements as queries, a causal (T, T) mask used to pass for a
        # (B, S) padding mask and gave another result without an error.
        square = sequences(0, batch=6)
        with pytest.raises(ValueError, match=query_dependent + re.escape("(6, 6)")):
            performer(square, square, attention_mask=np.tril(np.ones((6, 6), bool)))
        with pytest.raises(ValueError, match=r"heads must have size 1. Received: attention_mask.shape=\(2, 2, 1, 6\)"):
            performer(x, x, attention_mask=np.ones((2, 2, 1, 6), bool))
        with pytest.raises(ValueError, match="return_attention_scores=True"):
            performer(x, x, return_attention_scores=True)
        symbolic = keras.Input((6, 8))
        with pytest.raises(ValueError, match=query_dependent):
            performer(symbolic, symbolic, attention_mask=keras.Input((6, 6), dtype="bool"))
        with pytest.raises(ValueError, match="causal=True"):
            performer(x, sequences(1, length=7), use_causal_mask=True)

    @pytest.mark.parametrize("dropout", [0.0, 0.1])
    def test_masks_give_multi_head_attention_results(self, dropout):
        """Query and key masks as MultiHeadAttention applies them, checked where both must agree exactly.

        A masked query, and a query without any valid key, get uniform
        weights over all keys from MultiHeadAttention's default path, and
        zeros from its path with attention dropout (its softmax zeroes fully
        masked rows there); the other rows are the layer's own key-padded
        FAVOR+ result.
        """
        tokens = np.array([[3, 1, 4, 0, 0, 0], [5, 9, 2, 6, 5, 3]])
        values = np.array([[2, 7, 1, 8, 0], [0, 0, 0, 0, 0]])  # the second has no valid key
        query = keras.layers.Embedding(10, 8, mask_zero=True)(tokens)
        value = keras.layers.Embedding(10, 8, mask_zero=True)(values)
        plain = [to_numpy(t).astype("float32") for t in (query, value)]
        mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=dropout)
        mha(plain[0], plain[1])
        performer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, dropout=dropout, seed=0)
        performer(plain[0], plain[1])
        performer.set_weights(mha.get_weights())
        out = to_numpy(performer(query, value))
        exact = to_numpy(mha(query, value))  # after: MultiHeadAttention removes its inputs' masks
        query_valid, value_valid = tokens != 0, values != 0
        empty = ~query_valid | ~value_valid.any(axis=1, keepdims=True)
        np.testing.assert_allclose(out[empty], exact[empty], atol=1e-6)
        padded = to_numpy(performer(plain[0], plain[1], value_mask=value_valid))
        np.testing.assert_allclose(out[~empty], padded[~empty], atol=1e-6)
        # Causal: the first query of the first sequence sees only key 0, padding here.
        causal_mask = np.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
        causal = to_numpy(performer(plain[0], plain[0], value_mask=causal_mask, use_causal_mask=True))
        exact = to_numpy(mha(plain[0], plain[0], value_mask=causal_mask, use_causal_mask=True))
        np.testing.assert_allclose(causal[0, 0], exact[0, 0], atol=1e-6)
        if dropout:
            np.testing.assert_allclose(causal[0, 0], to_numpy(performer.output_dense.bias), atol=1e-6)

    @pytest.mark.parametrize("axes", [(1, 2), 2])
    def test_rows_without_keys_over_image_axes_give_multi_head_attention_results(self, axes):
        """On 4-D inputs MultiHeadAttention takes its explicit softmax path even without dropout: zeros."""
        images = sequences(16, batch=2 * 3 * 4).reshape(2, 3, 4, 6, 8)[..., 0, :]  # (2, 3, 4, 8)
        valid = np.ones((2, 3, 4), bool)
        valid[0] = False  # image 0 has no valid key at all
        valid[1, 1] = False  # image 1: its row 1 has none (which matters with one attention axis)
        mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=axes, bias_initializer="ones")
        performer = PerformerAttention(
            num_heads=2, key_dim=4, num_random_features=16, seed=0, attention_axes=axes, bias_initializer="ones"
        )
        mha(images, images)
        performer(images, images)
        performer.set_weights(mha.get_weights())
        # MultiHeadAttention's key-padding layout: size-1 query axes before the key axes.
        key_padding = valid[:, None, None] if axes == (1, 2) else valid[:, :, None, :]
        exact = to_numpy(mha(images, images, attention_mask=key_padding))
        out = to_numpy(performer(images, images, value_mask=valid))
        empty = np.zeros((2, 3, 4), bool)
        empty[0] = True
        if axes == 2:
            empty[1, 1] = True
        np.testing.assert_allclose(out[empty], exact[empty], atol=1e-6)
        np.testing.assert_allclose(out[empty], np.ones_like(out[empty]), atol=1e-6)  # only the output bias

    @pytest.mark.parametrize("causal", [False, True])
    def test_attention_axes_flatten_into_one_sequence(self, causal):
        """Multi-axis attention equals the same layer on the flattened positions, exactly."""
        images = sequences(15, batch=2 * 3 * 4).reshape(2, 3, 4, 6, 8)[..., 0, :]  # (2, 3, 4, 8)
        flat = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=2)
        expected = to_numpy(flat(images.reshape(2, 12, 8), images.reshape(2, 12, 8), use_causal_mask=causal))
        for axes in ((1, 2), (-3, -2)):
            layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=2, attention_axes=axes)
            layer(images, images)
            layer.set_weights(flat.get_weights())
            actual = layer(images, images, use_causal_mask=causal)
            self.assertAllClose(actual, expected.reshape(2, 3, 4, 8), atol=1e-6, msg=str(axes))
            # The weights have MultiHeadAttention's layout for these inputs too.
            mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=axes)
            mha(images, images)
            assert [tuple(w.shape) for w in mha.weights] == [tuple(w.shape) for w in layer.weights]
        # One attention axis, the other one a batch axis: each row on its own.
        rows = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=2, attention_axes=2)
        rows(images, images)
        rows.set_weights(flat.get_weights())
        per_row = flat(images.reshape(6, 4, 8), images.reshape(6, 4, 8), use_causal_mask=causal)
        self.assertAllClose(rows(images, images, use_causal_mask=causal), to_numpy(per_row).reshape(2, 3, 4, 8))
        # Key padding over both axes, in MultiHeadAttention's (B, 1, 1, H, W) layout and as value_mask.
        valid = np.ones((2, 3, 4), bool)
        valid[0, 2, 1:] = False
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=2, attention_axes=(1, 2))
        layer(images, images)
        layer.set_weights(flat.get_weights())
        masked = flat(images.reshape(2, 12, 8), images.reshape(2, 12, 8), value_mask=valid.reshape(2, 12))
        for kwargs in ({"value_mask": valid}, {"attention_mask": valid[:, None, None]}):
            self.assertAllClose(layer(images, images, **kwargs), to_numpy(masked).reshape(2, 3, 4, 8), atol=1e-6)
        with pytest.raises(ValueError, match="depends on the query position"):
            layer(images, images, attention_mask=np.ones((2, 3, 1, 3, 4), bool))

    @pytest.mark.parametrize(
        "query_shape, value_shape, key_shape, output_shape",
        [
            ((7, 4, 2, 3, 8), (7, 1, 1, 5, 8), (7, 1, 1, 5, 2), None),
            ((7, 4, 2, 3, 8), (7, 4, 2, 3, 7), None, (3, 2)),
            ((7, 4, 8), (7, 2, 8), (7, 2, 3), 5),
        ],
    )
    def test_compute_output_shape(self, query_shape, value_shape, key_shape, output_shape):
        layer = PerformerAttention(num_heads=2, key_dim=2, output_shape=output_shape, num_random_features=8)
        key = None if key_shape is None else np.ones(key_shape, "float32")
        output = layer(np.ones(query_shape, "float32"), np.ones(value_shape, "float32"), key)
        assert tuple(output.shape) == layer.compute_output_shape(query_shape, value_shape, key_shape)
        symbolic = layer(keras.Input(batch_shape=query_shape), keras.Input(batch_shape=value_shape))
        if key_shape is None:
            assert tuple(symbolic.shape) == tuple(output.shape)

    def test_shape_and_axes_errors(self):
        layer = PerformerAttention(num_heads=2, key_dim=2)
        with pytest.raises(ValueError, match="must be equal"):
            layer(np.ones((2, 4, 8)), np.ones((2, 2, 8)), np.ones((2, 3, 8)))
        with pytest.raises(ValueError, match=r"attention_axes=\(3,\), query_shape=\(2, 4, 8\)"):
            PerformerAttention(num_heads=2, key_dim=2, attention_axes=3).build((2, 4, 8), (2, 4, 8))

    def test_seed_generators_only_for_what_is_random(self):
        def seed_states(layer):
            return [v for v in layer.non_trainable_variables if "seed_generator_state" in v.path]

        x = sequences(0)
        for kwargs, count in (
            ({}, 0),
            ({"dropout": 0.1}, 1),
            ({"feature_redraw": "training"}, 1),
            ({"dropout": 0.1, "feature_redraw": "training"}, 2),
        ):
            layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=8, **kwargs)
            layer(x, x)
            assert len(seed_states(layer)) == count, kwargs
            assert len(layer.non_trainable_weights) == 0, kwargs

    def test_feature_redraws_and_dropout_draw_from_separate_streams(self):
        # Protects the `seed + 1` of the redraw generator: seeded like the
        # dropout layer, features and dropout masks would come from one stream.
        x = sequences(17)
        mha, layer = built_pair(seed=5, x=x, dropout=0.5, feature_redraw="training")
        dropout_generator = layer._dropout_layer.seed_generator
        assert not np.array_equal(to_numpy(layer.features_seed_generator.state), to_numpy(dropout_generator.state))
        # The first training call: features from `seed + 1`, the key/value
        # dropout mask from `seed`, each as a fresh generator draws them.
        actual = layer(x, x, training=True)
        q, k, v = np_projections(mha, x, x)
        w = to_numpy(orthogonal_random_features(16, 4, seed=keras.random.SeedGenerator(5 + 1)))
        v = keras.ops.convert_to_tensor(v, "float32")
        dropped = to_numpy(
            keras.random.dropout(v, 0.5, noise_shape=(None, None, None, 1), seed=keras.random.SeedGenerator(5))
        )
        assert 0 < np.mean(dropped == 0) < 1
        heads = np_kernel_attention(np_features(q, w, "softmax", True), np_features(k, w, "softmax", False), dropped)
        expected = np.einsum("btnh,nhe->bte", heads, to_numpy(mha.output_dense.kernel))
        expected += to_numpy(mha.output_dense.bias)
        self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-4)

    def test_flash_attention_is_refused_and_does_not_block_dropout(self):
        with pytest.raises(ValueError, match="flash_attention=True"):
            PerformerAttention(num_heads=2, key_dim=4, flash_attention=True)
        previous = keras.config.is_flash_attention_enabled()
        keras.config.enable_flash_attention()
        try:  # MultiHeadAttention then refuses dropout; FAVOR+ has no flash kernel to protect
            layer = PerformerAttention(num_heads=2, key_dim=4, dropout=0.1, seed=0)
        finally:
            if not previous:
                keras.config.disable_flash_attention()
        x = sequences(0)
        assert tuple(layer(x, x, training=True).shape) == (2, 6, 8)

    @pytest.mark.skipif(keras.backend.backend() == "numpy", reason="needs a trainable backend")
    def test_lora_fine_tuning(self, tmp_path):
        x = {"query": sequences(1, length=2, dim=2), "key": sequences(2, length=2, dim=2)}
        x["value"] = sequences(3, length=2, dim=2)
        y = sequences(4, length=2, dim=2)

        def model(lora):
            inputs = {name: keras.Input((2, 2), name=name) for name in ("query", "key", "value")}
            layer = PerformerAttention(num_heads=3, key_dim=8, use_bias=False, use_gate=True, seed=4)
            outputs = layer(inputs["query"], inputs["value"], inputs["key"])
            if lora:
                for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
                    dense.enable_lora(2)
            return keras.Model(inputs, outputs), layer

        tuned, layer = model(lora=True)
        assert len(layer.trainable_variables) == 8 and len(layer.non_trainable_variables) == 3
        frozen = to_numpy(layer.non_trainable_variables)
        tuned.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        tuned.fit(x, y, epochs=2, verbose=0)
        for before, after in zip(frozen, to_numpy(layer.non_trainable_variables)):
            np.testing.assert_array_equal(after, before)  # only the low-rank factors train
        assert np.abs(to_numpy(layer.query_dense.lora_kernel_b)).max() > 0
        predicted = tuned.predict(x, verbose=0)
        tuned.save(tmp_path / "lora.keras")
        self.assertAllClose(keras.saving.load_model(tmp_path / "lora.keras").predict(x, verbose=0), predicted)
        tuned.save_weights(tmp_path / "lora.weights.h5")
        plain, _ = model(lora=False)
        plain.load_weights(tmp_path / "lora.weights.h5")  # the low-rank update is merged into the kernels
        self.assertAllClose(plain.predict(x, verbose=0), predicted, atol=1e-5)

    def test_subclass_overrides_one_step(self):
        seen = {}

        class Recording(PerformerAttention):
            def _compute_favor_attention(self, query, key, value, key_mask=None, use_causal_mask=False, training=None):
                seen.update(
                    shapes=[tuple(t.shape) for t in (query, key, value)],
                    key_mask=None if key_mask is None else tuple(key_mask.shape),
                    causal=use_causal_mask,
                )
                return 0.0 * super()._compute_favor_attention(query, key, value, key_mask, use_causal_mask, training)

        images = sequences(5, batch=2 * 3 * 4).reshape(2, 3, 4, 6, 8)[..., 0, :]
        layer = Recording(num_heads=2, key_dim=4, value_dim=3, attention_axes=(1, 2), num_random_features=8)
        out = layer(images, images, value_mask=np.ones((2, 3, 4), bool), use_causal_mask=True)
        assert seen == {"shapes": [(2, 12, 2, 4), (2, 12, 2, 4), (2, 12, 2, 3)], "key_mask": (2, 12), "causal": True}
        bias = to_numpy(layer.output_dense.bias)
        self.assertAllClose(out, np.broadcast_to(bias, (2, 3, 4, 8)))  # the override's zeros reached the output

    def test_subclass_call_gives_its_own_symbolic_output(self):
        # Before: the symbolic call had MultiHeadAttention's spec (the query's
        # shape), (None, 6, 8), whatever the subclass's `call` returned.
        class FirstChannels(PerformerAttention):
            def call(self, query, value, key=None, value_mask=None, use_causal_mask=False):
                output = super().call(query, value, key, value_mask=value_mask, use_causal_mask=use_causal_mask)
                return output[..., :3]

        query, mask = keras.Input((6, 8)), keras.Input((6,), dtype="bool")
        layer = FirstChannels(num_heads=2, key_dim=4, num_random_features=8, seed=0)
        output = layer(query, query, value_mask=mask, use_causal_mask=True)
        assert output.shape == (None, 6, 3)
        model = keras.Model([query, mask], output)
        x, valid = sequences(3), np.array([[True] * 6, [True, False] * 3])
        expected = layer(x, x, value_mask=valid, use_causal_mask=True)
        self.assertAllClose(model([x, valid]), expected, atol=1e-6)

    @pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
    def test_long_causal_sequences_in_mixed_precision(self, policy):
        # Causal FAVOR+ sums prefix sums of exponentials over the sequence;
        # in float16 they overflow after a few thousand positions in other
        # implementations. Here the features and sums stay in float32.
        x = sequences(16, batch=1, length=4096, dim=16)
        reference = PerformerAttention(num_heads=2, key_dim=8, num_random_features=32, seed=0)
        expected = to_numpy(reference(x, x, use_causal_mask=True))
        mixed = PerformerAttention(num_heads=2, key_dim=8, num_random_features=32, seed=0, dtype=policy)
        mixed(x, x)
        mixed.set_weights(reference.get_weights())
        actual = mixed(x, x, use_causal_mask=True)
        assert keras.backend.standardize_dtype(actual.dtype) == policy.split("_")[1]
        actual = to_numpy(actual)
        assert np.all(np.isfinite(actual))
        error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
        assert error < (0.01 if policy == "mixed_float16" else 0.05), error

    def test_feature_redraw(self):
        x = sequences(7)
        _, redraw = built_pair(seed=3, feature_redraw="training")
        fixed = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=3)
        fixed(x, x)
        fixed.set_weights(redraw.get_weights())
        first, second = redraw(x, x, training=True), redraw(x, x, training=True)
        assert np.abs(to_numpy(first) - to_numpy(second)).max() > 1e-3
        inference = to_numpy(redraw(x, x))
        self.assertAllClose(redraw(x, x, training=False), inference, atol=0, rtol=0)
        self.assertAllClose(fixed(x, x), inference, atol=1e-6)
        self.assertAllClose(fixed(x, x, training=True), inference, atol=1e-6)

    def test_feature_redraw_in_compiled_fit(self):
        # The seed generator's state must advance inside a compiled train
        # step: with a zero learning rate only the features change the loss.
        x = sequences(7)
        inputs = keras.Input((6, 8))
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, feature_redraw="training")
        model = keras.Model(inputs, layer(inputs, inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=keras.backend.backend() != "torch")
        losses = [float(model.train_on_batch(x, np.zeros_like(x))) for _ in range(3)]
        assert len(set(losses)) == 3, losses

    def test_seed(self):
        x = sequences(8)
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16)
        assert isinstance(layer.get_config()["seed"], int)
        out = layer(x, x)
        revived = PerformerAttention.from_config(layer.get_config())
        revived(x, x)
        revived.set_weights(layer.get_weights())
        self.assertAllClose(revived(x, x), out, atol=1e-6)
        other = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=layer.seed + 1)
        other(x, x)
        other.set_weights(layer.get_weights())
        assert np.abs(to_numpy(other(x, x)) - to_numpy(out)).max() > 1e-4
        keras.utils.set_random_seed(11)
        seed = PerformerAttention(num_heads=2, key_dim=4).seed
        keras.utils.set_random_seed(11)
        assert PerformerAttention(num_heads=2, key_dim=4).seed == seed

    def test_dropout_drops_whole_keys_and_is_unbiased(self):
        # One head, one key: each (batch element, head) keeps the key's value
        # scaled by 1/(1 - rate) or drops it; the normaliser stays, so the
        # head's output is 2 v or 0 and the layer's output one of two rows.
        query, value = sequences(9, batch=64, length=3), sequences(10, batch=64, length=1)
        value[:] = value[:1]
        query[:] = query[:1]
        layer = PerformerAttention(num_heads=1, key_dim=4, num_random_features=16, dropout=0.5, seed=0)
        inference = to_numpy(layer(query, value))
        training = to_numpy(layer(query, value, training=True))
        bias = to_numpy(layer.output_dense.bias)
        kept = 2 * inference[0] - bias
        is_kept = np.all(np.isclose(training, kept, atol=1e-5), axis=(1, 2))
        is_dropped = np.all(np.isclose(training, bias, atol=1e-5), axis=(1, 2))
        assert np.all(is_kept | is_dropped) and is_kept.any() and is_dropped.any()
        # Unbiased: over 256 copies with 2 heads and 5 keys, the mean of the
        # training outputs is within 5 standard errors of the inference output
        # in every entry (two-sided 5.7e-7 each, 16 entries).
        query, value = sequences(11, batch=256, length=2), sequences(12, batch=256, length=5)
        query[:], value[:] = query[:1], value[:1]
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, dropout=0.3, seed=0)
        inference = to_numpy(layer(query, value))[0]
        training = to_numpy(layer(query, value, training=True))
        stderr = training.std(axis=0, ddof=1) / np.sqrt(256)
        assert np.all(np.abs(training.mean(axis=0) - inference) < 5 * stderr + 1e-6)
        assert np.all(stderr > 0)

    @pytest.mark.parametrize("kernel, causal", [("softmax", False), ("softmax", True), ("relu", False)])
    def test_fit_with_large_inputs_stays_finite(self, kernel, causal):
        # Inputs of std 100 give logits of order 1e4; one SGD step must give
        # finite losses and weights (a NaN gradient would poison both).
        x = sequences(13, std=100.0)
        inputs = keras.Input((6, 8))
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, kernel=kernel, seed=0)
        model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=causal))
        model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
        history = model.fit(x, np.zeros_like(x), epochs=2, batch_size=2, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        for w in layer.weights:
            assert np.all(np.isfinite(to_numpy(w))), w.path

    def test_dynamic_sequence_length(self):
        inputs = keras.Input((None, 8))
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=0)
        model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
        for length in (5, 300):
            x = sequences(14, length=length)
            self.assertAllClose(model.predict(x, verbose=0), layer(x, x, use_causal_mask=True), atol=1e-5)

    @pytest.mark.parametrize("length", [6, 130])  # one chunk; three chunks with padding
    def test_causal_output_keeps_static_length_under_unknown_batch(self, length):
        # Traced with an unknown batch, TensorFlow inferred the chunked
        # reshapes' length as None, so a Dense after Flatten could not build.
        class Classifier(keras.Model):
            def __init__(self):
                super().__init__()
                self.attention = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=0)
                self.flatten = keras.layers.Flatten()
                self.head = keras.layers.Dense(1)

            def call(self, x):
                return self.head(self.flatten(self.attention(x, x, use_causal_mask=True)))

        x = sequences(15, batch=4, length=length)
        model = Classifier()
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(x, np.zeros((4, 1), "float32"), batch_size=2, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])
        assert tuple(model.head.kernel.shape) == (length * 8, 1)
        self.assertAllClose(model.predict(x, verbose=0), model(x), atol=1e-5)

    def test_key_padding_attention_mask_as_model_input(self):
        # A (B, 1, S) mask with an unknown batch was reshaped to a shape
        # holding None, which TensorFlow refused.
        x = sequences(16)
        mask = np.array([[[1, 1, 1, 1, 0, 0]], [[1, 1, 1, 1, 1, 1]]], bool)
        inputs, mask_input = keras.Input((6, 8)), keras.Input((1, 6), dtype="bool")
        layer = PerformerAttention(num_heads=2, key_dim=4, num_random_features=16, seed=0)
        model = keras.Model([inputs, mask_input], layer(inputs, inputs, attention_mask=mask_input))
        expected = layer(x, x, value_mask=mask[:, 0])
        self.assertAllClose(model.predict([x, mask], verbose=0), expected, atol=1e-5)
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit([x, mask], np.zeros_like(x), epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])

    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({"num_random_features": 0}, "num_random_features=0"),
            ({"kernel": "cosine"}, "kernel='cosine'"),
            ({"feature_redraw": "always"}, "feature_redraw='always'"),
            ({"orthogonal_scaling": "unit"}, "orthogonal_scaling='unit'"),
            ({"eps": -1.0}, "eps=-1.0"),
            ({"dropout": 1.0}, "dropout=1.0"),
            ({"attention_axes": "time"}, "attention_axes=time"),
            ({"sliding_window": 3}, "sliding_window=3"),
            ({"flash_attention": True}, "flash_attention=True"),
            ({"seed": "0"}, "seed='0'"),
            ({"num_heads": 0}, "num_heads=0"),
        ],
    )
    def test_bad_arguments(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            PerformerAttention(**{"num_heads": 2, "key_dim": 4, **kwargs})


    @pytest.mark.parametrize("seed", [-1, True, 0.0, "0", 2**31 - 1, 2**31, 2**32])
    @pytest.mark.parametrize("feature_redraw", ["fixed", "training"])
    def test_bad_seed(self, seed, feature_redraw):
        # `seed + 1` seeds the redraws, so the largest seed is 2**31 - 2.
        with pytest.raises(ValueError, match=rf"`seed` must be an integer in \[0, 2147483646\].*seed={seed!r}$"):
            PerformerAttention(num_heads=2, key_dim=4, feature_redraw=feature_redraw, seed=seed)

    def test_largest_seed_works_with_redraws_and_dropout(self):
        layer = PerformerAttention(
            num_heads=2, key_dim=4, num_random_features=8, feature_redraw="training", dropout=0.1, seed=2**31 - 2
        )
        x = sequences(0)
        assert np.all(np.isfinite(to_numpy(layer(x, x, training=True))))
        with pytest.raises(ValueError, match="seed=2147483647"):
            PerformerAttention(num_heads=2, key_dim=4, feature_redraw="training", seed=2**31 - 1)

    @pytest.mark.parametrize(
        "eps",
        # 1e39 and 1e300 are finite Python floats but inf in float32 (they gave NaN attention).
        [float("inf"), float("nan"), -1.0, -float("inf"), 10**400, 1e39, 1e300, 1.5],
        ids=["inf", "nan", "-1", "-inf", "huge_int", "1e39", "1e300", "1.5"],
    )
    def test_bad_eps(self, eps):
        message = rf"`eps` must be a non-negative float of at most 1\. Received: eps={re.escape(repr(eps))}$"
        with pytest.raises(ValueError, match=message):
            PerformerAttention(num_heads=2, key_dim=4, eps=eps)

    def test_numpy_numbers_are_taken_as_python_numbers(self):
        # Before: refused with messages that printed a valid-looking value ("num_random_features=8").
        layer = PerformerAttention(
            num_heads=2, key_dim=4, num_random_features=np.int64(8), eps=np.float32(1e-6), dropout=np.float32(0.1)
        )
        config = layer.get_config()
        assert type(config["num_random_features"]) is int and config["num_random_features"] == 8
        assert type(config["eps"]) is float and type(config["dropout"]) is float


def test_docstring_examples():
    results = doctest.testmod(performer_module, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0 and results.failed == 0, results
