"""ResidualCell and LayerNormGelu: the layer harness, and values against NumPy."""

import json
import re

import keras
import numpy as np
import pytest

from keras_avae.layers import ResidualCell
from keras_avae.layers.residual_cell import _nearest_upsample
from keras_avae.models import LayerNormGelu
from tests.test_case import TestCase
from tests.test_case import gradients
from tests.test_case import to_numpy


def images(seed, shape=(2, 6, 6, 4)):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def randomise(layer, seed):
    """Random values for every weight (moving variances positive), so no term is trivially 0 or 1."""
    rng = np.random.default_rng(seed)
    for weight in layer.weights:
        shape = tuple(weight.shape)
        if "moving_variance" in weight.path:
            weight.assign(rng.uniform(0.5, 1.5, shape).astype("float32"))
        else:
            weight.assign((0.3 * rng.normal(size=shape)).astype("float32"))


def np_conv(x, kernel, stride=1, padding="same"):
    """Cross-correlation `(B, H, W, C) x (k, k, C, F)` with Keras' 'same'/'valid' padding."""
    k = kernel.shape[0]
    _, h, w, _ = x.shape
    if padding == "same":
        out_h, out_w = -(-h // stride), -(-w // stride)
        pad_h, pad_w = max((out_h - 1) * stride + k - h, 0), max((out_w - 1) * stride + k - w, 0)
        x = np.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
    else:
        out_h, out_w = (h - k) // stride + 1, (w - k) // stride + 1
    out = np.zeros((x.shape[0], out_h, out_w, kernel.shape[-1]))
    for i in range(k):
        for j in range(k):
            patch = x[:, i : i + stride * out_h : stride, j : j + stride * out_w : stride]
            out += patch @ kernel[i, j]
    return out


def np_weight_norm_conv(layer, x, stride=1, padding="same"):
    v, log_g = to_numpy(layer.kernel), to_numpy(layer.log_g)
    kernel = v * np.exp(log_g) / np.sqrt(np.sum(v * v, axis=(0, 1, 2)) + 1e-12)
    out = np_conv(x, kernel, stride, padding)
    return out if layer.bias is None else out + to_numpy(layer.bias)


def np_batch_norm(layer, x):
    gamma, beta = to_numpy(layer.gamma), to_numpy(layer.beta)
    mean, variance = to_numpy(layer.moving_mean), to_numpy(layer.moving_variance)
    return gamma * (x - mean) / np.sqrt(variance + layer.epsilon) + beta


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_bilinear_x2_align_corners(x):
    """Corner-aligned bilinear x2 upsampling, pixel by pixel."""
    b, h, w, c = x.shape
    out = np.zeros((b, 2 * h, 2 * w, c))
    for i in range(2 * h):
        for j in range(2 * w):
            y, z = i * (h - 1) / (2 * h - 1), j * (w - 1) / (2 * w - 1)
            y0, z0 = int(np.floor(y)), int(np.floor(z))
            y1, z1 = min(y0 + 1, h - 1), min(z0 + 1, w - 1)
            fy, fz = y - y0, z - z0
            out[:, i, j] = (
                (1 - fy) * (1 - fz) * x[:, y0, z0]
                + (1 - fy) * fz * x[:, y0, z1]
                + fy * (1 - fz) * x[:, y1, z0]
                + fy * fz * x[:, y1, z1]
            )
    return out


def np_residual_cell(cell, x):
    """The cell in inference mode, from its weights and the NVAE equations."""
    h = np.repeat(np.repeat(x, 2, axis=1), 2, axis=2) if cell.scale == "up" else x
    for i, (norm, conv) in enumerate(zip(cell.node_norms, cell.node_convs)):
        stride = 2 if (cell.scale == "down" and i == 0) else 1
        h = np_weight_norm_conv(conv, np_silu(np_batch_norm(norm, h)), stride)
    if cell.scale == "same":
        shortcut = x
    elif cell.scale == "down":
        u = np_silu(x)
        shifted = [u, u[:, 1:, 1:], u[:, :, 1:], u[:, 1:, :]]
        parts = [np_weight_norm_conv(conv, s, 2, "valid") for conv, s in zip(cell.reduce_convs, shifted)]
        rows, cols = parts[0].shape[1:3]
        parts = [np.pad(p, ((0, 0), (0, rows - p.shape[1]), (0, cols - p.shape[2]), (0, 0))) for p in parts]
        shortcut = np.concatenate(parts, axis=-1)
    else:
        shortcut = np_weight_norm_conv(cell.shortcut_conv, np_bilinear_x2_align_corners(x))
    return cell.residual_scale * h + shortcut


class TestResidualCell(TestCase):
    @pytest.mark.parametrize(
        "init_kwargs, expected_shape, num_weights",
        [
            ({"scale": "same"}, (2, 6, 6, 4), 10),
            ({"scale": "down"}, (2, 3, 3, 8), 22),
            ({"scale": "up"}, (2, 12, 12, 2), 12),
            ({"scale": "same", "nonlocal_key_dim": 2, "nonlocal_attention": "performer", "seed": 1}, (2, 6, 6, 4), 24),
        ],
    )
    def test_layer_behaviours(self, init_kwargs, expected_shape, num_weights):
        self.run_layer_test(
            ResidualCell,
            init_kwargs,
            images(0),
            expected_output_shape=expected_shape,
            expected_num_trainable_weights=num_weights,
            expected_num_non_trainable_weights=4,  # the two batch norms' moving statistics
        )

    @pytest.mark.parametrize(
        "scale, shape",
        # Even sizes: the reduce as one 2x2 convolution; odd: the padded phases.
        # One pixel high or wide: the shifted phases are empty (zeros in the
        # shortcut); before, torch's conv2d refused them.
        [
            ("same", (2, 6, 6, 4)),
            ("down", (2, 6, 6, 4)),
            ("down", (2, 5, 5, 4)),
            ("down", (2, 1, 5, 4)),
            ("down", (2, 4, 1, 4)),
            ("down", (2, 1, 1, 4)),
            ("up", (2, 6, 6, 4)),
        ],
    )
    def test_matches_numpy_in_inference(self, scale, shape):
        x = images(1, shape)
        cell = ResidualCell(scale, residual_scale=0.7)
        cell(x)
        randomise(cell, seed=2)
        expected = np_residual_cell(cell, x.astype("float64"))
        self.assertAllClose(cell(x, training=False), expected, atol=2e-4, rtol=2e-4)

    def test_one_pixel_down_cell_gives_every_reduce_conv_a_gradient(self):
        # The empty phases' convolutions get a zero gradient, not none (before:
        # torch refused them, TensorFlow returned the wrong channels).
        x = images(10, (2, 1, 1, 4))
        cell = ResidualCell("down")
        cell(x)
        _, grads = gradients(cell, lambda y: keras.ops.sum(y * y), {"inputs": x})
        named = {w.path.split("/", 1)[1]: g for w, g in zip(cell.trainable_weights, grads)}
        for i in (1, 2, 3):
            self.assertAllClose(named[f"reduce{i}_conv/kernel"], np.zeros((1, 1, 4, 2)), atol=0, rtol=0)
        assert np.any(named["reduce0_conv/kernel"] != 0)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="scale='sideways'"):
            ResidualCell("sideways")
        with pytest.raises(ValueError, match="nonlocal_key_dim=0"):
            ResidualCell(nonlocal_key_dim=0)
        with pytest.raises(ValueError, match="channels.*even"):
            ResidualCell("up")(images(0, (1, 4, 4, 3)))

    @pytest.mark.parametrize(
        "kwargs",
        # Before: accepted, then failing at call (naming `attention` or `seed`),
        # giving NaN (bn_epsilon), or switching synchronised batch norm on ("no").
        [
            {"nonlocal_key_dim": 2, "seed": -1},
            {"nonlocal_key_dim": 2, "nonlocal_attention": "bogus"},
            {"nonlocal_key_dim": True},
            {"nonlocal_num_random_features": 0},
            {"synchronized_batch_norm": "no"},
            {"residual_scale": "0.1"},
            {"residual_scale": float("nan")},
            {"bn_epsilon": -1.0},
            {"bn_momentum": 2.0},
        ],
    )
    def test_bad_arguments_are_named_at_construction(self, kwargs):
        (name, value), = [item for item in kwargs.items() if item[0] != "nonlocal_key_dim"] or kwargs.items()
        with pytest.raises(ValueError, match=rf"`{name}` must .*Received: {name}={value!r}"):
            ResidualCell(**kwargs)

    @pytest.mark.parametrize("scale", ["same", "down", "up"])
    def test_unknown_height_and_width(self, scale):
        # Before: "down" and "up" failed to build on (None, None, C) inputs, and
        # an "up" cell kept the resize matrices of the size it was built at.
        cell = ResidualCell(scale)
        symbolic = cell(keras.Input((None, None, 4)))
        assert tuple(symbolic.shape) == cell.compute_output_shape((None, None, None, 4))
        x = images(9, (2, 4, 6, 4))
        randomise(cell, seed=3)
        twin = ResidualCell(scale)
        twin(x)
        twin.set_weights(cell.get_weights())
        self.assertAllClose(cell(x, training=False), twin(x, training=False), atol=1e-6, rtol=1e-6)
        expected = np_residual_cell(cell, x.astype("float64"))
        self.assertAllClose(cell(x, training=False), expected, atol=2e-4, rtol=2e-4)

    def test_unseeded_non_local_cell_keeps_its_features_through_its_config(self):
        # Before: `seed=None` stayed in the config, so a reloaded cell's blocks drew new features.
        x = images(5)
        cell = ResidualCell(nonlocal_key_dim=2, nonlocal_attention="performer", nonlocal_num_random_features=8)
        assert isinstance(cell.get_config()["seed"], int)
        cell(x)
        randomise(cell, seed=4)
        reloaded = ResidualCell.from_config(cell.get_config())
        reloaded(x)
        reloaded.set_weights(cell.get_weights())
        self.assertAllClose(cell(x, training=False), reloaded(x, training=False), atol=1e-6, rtol=1e-6)

    def test_numpy_seed_and_key_dim_are_stored_as_python_ints(self):
        # Before: refused; accepted as they were, they would have left the config unserialisable.
        kwargs = {"nonlocal_attention": "performer", "nonlocal_num_random_features": 8}
        cell = ResidualCell(nonlocal_key_dim=np.int64(2), seed=np.int64(3), **kwargs)
        config = cell.get_config()
        assert type(config["seed"]) is int and type(config["nonlocal_key_dim"]) is int
        json.dumps(keras.saving.serialize_keras_object(cell))
        twin = ResidualCell(nonlocal_key_dim=2, seed=3, **kwargs)
        x = images(11)
        cell(x)
        twin(x)
        randomise(cell, seed=5)
        twin.set_weights(cell.get_weights())
        self.assertAllClose(cell(x, training=False), twin(x, training=False), atol=0, rtol=0)

    def test_nearest_upsample_and_its_gradient_match_numpy(self):
        # Each pixel repeated 2x2; its gradient the sum over each 2x2 block
        # (torch uses its own interpolation kernel, the others a broadcast).
        x = images(3, (2, 3, 5, 4))
        r = images(4, (2, 6, 10, 4))

        class Upsample(keras.layers.Layer):
            def call(self, inputs):
                return _nearest_upsample(inputs)

        layer = Upsample()
        self.assertAllClose(to_numpy(layer(x)), np.repeat(np.repeat(x, 2, axis=1), 2, axis=2), atol=0, rtol=0)
        grads, _ = gradients(layer, lambda y: keras.ops.sum(keras.ops.multiply(y, r)), {"inputs": x})
        expected = r.reshape(2, 3, 2, 5, 2, 4).sum(axis=(2, 4))
        self.assertAllClose(grads["inputs"], expected, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("attention", ["softmax", "performer"])
    def test_up_cell_trains_as_if_it_upsampled_first(self, attention):
        # The cell runs its first batch norm, non-local block and Swish before
        # the upsampling; the paper's order (upsample first) must give the
        # same output and the same moving statistics in training.
        x = images(6)
        kwargs = {"nonlocal_key_dim": 2, "nonlocal_attention": attention, "seed": 1, "residual_scale": 0.7}
        cell, paper_order = ResidualCell("up", **kwargs), ResidualCell("up", **kwargs)
        cell(x)
        paper_order(x)
        randomise(cell, seed=7)
        paper_order.set_weights(cell.get_weights())

        h = keras.ops.convert_to_tensor(np.repeat(np.repeat(x, 2, axis=1), 2, axis=2))
        for norm, block, conv in zip(paper_order.node_norms, paper_order.node_nonlocals, paper_order.node_convs):
            h = conv(keras.ops.silu(block(norm(h, training=True), training=True)))
        expected = 0.7 * h + paper_order._shortcut(x, training=True)

        self.assertAllClose(cell(x, training=True), expected, atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(cell.non_trainable_weights, paper_order.non_trainable_weights):
            self.assertAllClose(ours, theirs, atol=1e-6, rtol=1e-6)


class TestLayerNormGelu(TestCase):
    def test_layer_behaviours(self):
        self.run_layer_test(
            LayerNormGelu,
            {"epsilon": 1e-3},
            images(3),
            expected_output_shape=(2, 6, 6, 4),
            expected_num_trainable_weights=2,
            expected_num_non_trainable_weights=0,
        )

    def test_matches_numpy(self):
        x = images(4)
        layer = LayerNormGelu()
        layer(x)
        randomise(layer, seed=5)
        gamma, beta = to_numpy(layer.norm.gamma), to_numpy(layer.norm.beta)
        x64 = x.astype("float64")
        mean, variance = x64.mean(axis=-1, keepdims=True), x64.var(axis=-1, keepdims=True)
        normed = gamma * (x64 - mean) / np.sqrt(variance + 1e-5) + beta
        gelu = 0.5 * normed * (1 + np.tanh(np.sqrt(2 / np.pi) * (normed + 0.044715 * normed**3)))
        self.assertAllClose(layer(x), x64 + gelu, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("epsilon", [-1.0, 0.0, float("nan"), float("inf"), "1e-5", None, True])
    def test_bad_epsilon_is_named_at_construction(self, epsilon):
        # Before: accepted; a negative or NaN epsilon gave NaN outputs silently
        # (here every position whose channel variance is below 1), a string a
        # TypeError from inside LayerNormalization at the first call.
        with pytest.raises(ValueError, match=re.escape(f"Received: epsilon={epsilon!r}")):
            LayerNormGelu(epsilon=epsilon)

    def test_numpy_epsilon_is_stored_as_a_python_float(self):
        layer = LayerNormGelu(epsilon=np.float64(1e-3))
        assert type(layer.get_config()["epsilon"]) is float
        json.dumps(keras.saving.serialize_keras_object(layer))
        x = images(4)
        layer(x)
        expected = LayerNormGelu(epsilon=1e-3)
        expected(x)
        self.assertAllClose(layer(x), expected(x), atol=0, rtol=0)
