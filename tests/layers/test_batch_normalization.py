import keras
import numpy as np
import pytest

from keras_avae.layers.batch_normalization import BatchNormalization
from tests.test_case import BACKEND
from tests.test_case import TestCase
from tests.test_case import gradients
from tests.test_case import to_numpy


class _Training(keras.layers.Layer):
    """Calls the wrapped batch-norm layer in training mode."""

    def __init__(self, norm, **kwargs):
        super().__init__(**kwargs)
        self.norm = norm

    def build(self, input_shape):
        pass  # the wrapped layer is built already

    def call(self, inputs):
        return self.norm(inputs, training=True)


def _pair(channels=3, seed=0, **kwargs):
    """A fused layer and Keras' own with the same random gamma, beta and moving statistics."""
    rng = np.random.default_rng(seed)
    fused, plain = BatchNormalization(**kwargs), keras.layers.BatchNormalization(**kwargs)
    for layer in (fused, plain):
        layer.build((None, 4, 4, channels))
    weights = [rng.normal(size=w.shape).astype("float32") for w in plain.weights]
    weights[-1] = np.abs(weights[-1]) + 0.5  # the moving variance
    plain.set_weights(weights)
    fused.set_weights(weights)
    return fused, plain


def _numpy_batch_norm(x, gamma, beta, mean, variance, epsilon):
    return (x - mean) / np.sqrt(variance + epsilon) * gamma + beta


class TestBatchNormalization(TestCase):
    def test_layer_basics(self):
        x = np.random.default_rng(0).normal(size=(2, 5, 5, 3)).astype("float32")
        self.run_layer_test(
            BatchNormalization,
            init_kwargs={"momentum": 0.9, "epsilon": 1e-5},
            input_data=x,
            expected_output_shape=(2, 5, 5, 3),
            expected_num_trainable_weights=2,
            expected_num_non_trainable_weights=2,
        )

    @pytest.mark.parametrize("shape", [(8, 6, 5, 3), (1, 1, 1, 4), (3, 16, 16, 16)])
    def test_training_matches_numpy_and_keras(self, shape):
        fused, plain = _pair(channels=shape[-1], momentum=0.8, epsilon=1e-3)
        gamma, beta, moving_mean, moving_variance = [np.array(w, dtype=np.float64) for w in fused.get_weights()]
        x = np.random.default_rng(1).normal(2.0, 3.0, size=shape).astype("float32")
        mean, variance = x.astype(np.float64).mean((0, 1, 2)), x.astype(np.float64).var((0, 1, 2))
        expected = _numpy_batch_norm(x, gamma, beta, mean, variance, 1e-3)

        y = to_numpy(fused(x, training=True))
        self.assertAllClose(y, expected, atol=2e-5, rtol=1e-5)
        self.assertAllClose(y, plain(x, training=True), atol=2e-5, rtol=1e-5)
        # Keras' moving averages of the biased batch variance.
        self.assertAllClose(fused.moving_mean, 0.8 * moving_mean + 0.2 * mean, rtol=1e-5, atol=1e-6)
        self.assertAllClose(fused.moving_variance, 0.8 * moving_variance + 0.2 * variance, rtol=1e-5, atol=1e-6)
        self.assertAllClose(fused.moving_variance, plain.moving_variance, rtol=1e-5, atol=1e-6)
        self.assertAllFinite(fused.moving_variance)

    def test_inference_uses_the_moving_statistics(self):
        fused, plain = _pair(epsilon=1e-3)
        gamma, beta, moving_mean, moving_variance = [np.array(w, dtype=np.float64) for w in fused.get_weights()]
        x = np.random.default_rng(2).normal(size=(4, 5, 5, 3)).astype("float32")
        expected = _numpy_batch_norm(x, gamma, beta, moving_mean, moving_variance, 1e-3)
        self.assertAllClose(fused(x, training=False), expected, atol=1e-5, rtol=1e-5)
        self.assertAllClose(fused(x, training=False), plain(x, training=False), atol=1e-5, rtol=1e-5)
        self.assertAllClose(fused.moving_mean, moving_mean)

    def test_frozen_layer_does_not_update_in_training(self):
        fused, plain = _pair()
        fused.trainable = plain.trainable = False
        x = np.random.default_rng(3).normal(size=(4, 5, 5, 3)).astype("float32")
        before = to_numpy(fused.moving_mean)
        self.assertAllClose(fused(x, training=True), plain(x, training=True), atol=1e-5, rtol=1e-5)
        self.assertAllClose(fused.moving_mean, before)

    @pytest.mark.parametrize("frozen", [False, True])
    def test_gradients_match_keras(self, frozen):
        fused, plain = _pair(channels=4)
        fused.trainable = plain.trainable = not frozen  # frozen: the moving statistics, no weights to train
        x = np.random.default_rng(4).normal(1.0, 2.0, size=(3, 6, 5, 4)).astype("float32")
        target = keras.ops.convert_to_tensor(np.random.default_rng(5).normal(size=x.shape).astype("float32"))
        loss = lambda y: keras.ops.sum(y * target)  # noqa: E731  (a non-uniform upstream gradient)
        wrappers = [_Training(fused), _Training(plain)]
        for wrapper in wrappers:
            wrapper.build(x.shape)
        (fused_x, fused_w), (plain_x, plain_w) = [gradients(w, loss, {"inputs": x}) for w in wrappers]
        self.assertAllClose(fused_x["inputs"], plain_x["inputs"], atol=1e-4, rtol=1e-4)
        assert len(fused_w) == len(plain_w) == (0 if frozen else 2)
        for a, b in zip(fused_w, plain_w):
            self.assertAllClose(a, b, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("dtype", ["mixed_float16", "mixed_bfloat16"])
    def test_mixed_precision_normalises_in_float32(self, dtype):
        x = np.random.default_rng(6).normal(size=(4, 5, 5, 3)).astype("float32")
        fused = BatchNormalization(dtype=dtype)
        plain = keras.layers.BatchNormalization(dtype=dtype)
        compute = dtype.split("_")[1]
        y = fused(keras.ops.cast(x, compute), training=True)
        assert keras.backend.standardize_dtype(y.dtype) == compute
        self.assertAllClose(y, plain(keras.ops.cast(x, compute), training=True), atol=2e-2, rtol=2e-2)
        self.assertAllClose(fused.moving_variance, plain.moving_variance, atol=1e-3, rtol=1e-3)

    def test_settings_without_a_fused_kernel_run_keras_code(self):
        x = np.random.default_rng(7).normal(size=(6, 4)).astype("float32")
        fused, plain = BatchNormalization(), keras.layers.BatchNormalization()
        self.assertAllClose(fused(x, training=True), plain(x, training=True), atol=1e-5)
        image = np.random.default_rng(8).normal(size=(2, 3, 4, 5)).astype("float32")
        fused, plain = BatchNormalization(axis=1), keras.layers.BatchNormalization(axis=1)
        self.assertAllClose(fused(image, training=True), plain(image, training=True), atol=1e-5)
        self.assertAllClose(fused.moving_variance, plain.moving_variance, atol=1e-6)

    @pytest.mark.skipif(BACKEND not in ("tensorflow", "torch"), reason="JAX runs Keras' own ops (XLA fuses them)")
    def test_the_backend_kernel_runs(self, monkeypatch):
        calls = []
        if BACKEND == "tensorflow":
            import tensorflow as tf

            norm = BatchNormalization()
            norm.build((2, 4, 4, 3))

            @tf.function
            def step(x):
                return norm(x, training=True)

            graph = step.get_concrete_function(tf.TensorSpec((2, 4, 4, 3), "float32")).graph
            calls = [op for op in graph.get_operations() if op.type == "FusedBatchNormV3"]
        else:
            import torch

            native = torch.native_batch_norm

            def spy(*args):
                calls.append(args[0].shape)
                return native(*args)

            monkeypatch.setattr(torch, "native_batch_norm", spy)
            BatchNormalization()(np.ones((2, 4, 4, 3), "float32"), training=True)
        assert len(calls) == 1
