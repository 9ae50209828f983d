"""WeightNormConv2D: the kernel it convolves with, against a NumPy formula."""

import json

import keras
import numpy as np
import pytest

from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D
from tests.test_case import TestCase
from tests.test_case import gradients
from tests.test_case import to_numpy


class TestWeightNormConv2D(TestCase):
    def test_layer_basics(self):
        self.run_layer_test(
            WeightNormConv2D,
            init_kwargs={"filters": 3, "kernel_size": 3, "strides": 2},
            input_data=np.random.default_rng(0).normal(size=(2, 6, 6, 2)).astype("float32"),
            expected_output_shape=(2, 3, 3, 3),
            expected_num_trainable_weights=3,
        )

    def test_use_bias_must_be_a_bool(self):
        # Before: "no" was truthy and created a bias.
        with pytest.raises(ValueError, match=r"`use_bias` must be a bool. Received: use_bias='no'"):
            WeightNormConv2D(4, 3, use_bias="no")

    def test_numpy_integers_are_stored_as_python_ints(self):
        # Before: refused, with messages that read "Received: filters=2".
        layer = WeightNormConv2D(np.int64(2), np.int32(3), strides=np.int64(2))
        config = layer.get_config()
        assert [type(config[k]) for k in ("filters", "kernel_size", "strides")] == [int, int, int]
        json.dumps(keras.saving.serialize_keras_object(layer))
        with pytest.raises(ValueError, match=r"`filters` must be a positive int. Received: filters='2'$"):
            WeightNormConv2D("2", 3)

    def test_a_built_layer_names_a_wrong_input(self):
        # Before: each backend's own error from inside the convolution.
        layer = WeightNormConv2D(4, 3)
        layer(np.zeros((1, 4, 4, 3), "float32"))
        with pytest.raises(ValueError, match=r"expected axis -1 of input shape to have value 3.*\(1, 4, 4, 5\)"):
            layer(np.zeros((1, 4, 4, 5), "float32"))
        with pytest.raises(ValueError, match=r"expected ndim=4, found ndim=3"):
            layer(np.zeros((4, 4, 3), "float32"))

    @pytest.mark.parametrize("padding", ["same", "valid"])
    def test_empty_images_give_empty_outputs(self, padding):
        # Before: torch refused an image with no rows (or columns), TensorFlow
        # returned it unchanged, with the input's channels.
        layer = WeightNormConv2D(3, 1, strides=2, padding=padding)
        for shape in [(2, 0, 5, 4), (2, 5, 0, 4), (2, 0, 0, 4)]:
            assert tuple(layer(np.zeros(shape, "float32")).shape) == layer.compute_output_shape(shape)

    @pytest.mark.parametrize(
        "size,kernel_size,strides,padding",
        [
            (5, 3, 1, "valid"),
            (5, 3, 1, "same"),
            (6, 3, 2, "same"),
            (7, 3, 2, "same"),
            (8, 1, 2, "same"),
            (7, 1, 2, "same"),
            (7, 3, 2, "valid"),
            (6, 3, 2, "valid"),
            (7, 1, 2, "valid"),
        ],
    )
    def test_output_is_conv_with_the_normalised_kernel(self, size, kernel_size, strides, padding):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(2, size, size, 4)).astype("float32")
        layer = WeightNormConv2D(3, kernel_size, strides=strides, padding=padding)
        layer.build(x.shape)
        kernel = rng.normal(size=(kernel_size, kernel_size, 4, 3))
        log_g = rng.normal(size=(3,))
        bias = rng.normal(size=(3,))
        layer.set_weights([kernel.astype("float32"), log_g.astype("float32"), bias.astype("float32")])

        # w = v / ||v|| * exp(log_g), the norm per output channel (float64).
        w = kernel / np.sqrt(np.sum(kernel**2, axis=(0, 1, 2))) * np.exp(log_g)
        padded = x.astype("float64")
        if padding == "same":
            # TensorFlow's "same": out = ceil(in / stride), odd padding after.
            out = -(-size // strides)
            total = max((out - 1) * strides + kernel_size - size, 0)
            before = total // 2
            padded = np.pad(padded, ((0, 0), (before, total - before), (before, total - before), (0, 0)))
        else:
            out = (size - kernel_size) // strides + 1
        expected = np.zeros((2, out, out, 3))
        for i in range(out):
            for j in range(out):
                r, c = i * strides, j * strides
                patch = padded[:, r : r + kernel_size, c : c + kernel_size, :]
                expected[:, i, j, :] = np.einsum("bhwc,hwco->bo", patch, w) + bias
        output = layer(x)
        self.assertAllClose(to_numpy(output), expected, atol=1e-5, rtol=1e-5)
        # The declared shapes are the computed ones: compute_output_shape,
        # a symbolic call with known sizes, and a model with unknown H and W.
        assert layer.compute_output_shape(x.shape) == tuple(output.shape) == (2, out, out, 3)
        assert tuple(layer(keras.Input((size, size, 4))).shape) == (None, out, out, 3)
        inputs = keras.Input((None, None, 4))
        symbolic = layer(inputs)
        assert tuple(symbolic.shape) == (None, None, None, 3)
        predicted = keras.Model(inputs, symbolic).predict(x, verbose=0)
        self.assertAllClose(predicted, expected, atol=1e-5, rtol=1e-5)

    # (1, 1): one image and one output channel, where torch's convolution
    # takes its slow path (which failed on a permuted kernel view).
    @pytest.mark.parametrize("use_bias,batch,filters", [(True, 2, 3), (False, 2, 3), (True, 1, 1)])
    def test_gradients_match_a_plain_convolution_plus_bias(self, use_bias, batch, filters):
        # On torch the bias goes into the convolution: its gradient is still
        # the output gradient summed over batch and positions, and the other
        # gradients are those of `ops.conv` followed by an addition.
        rng = np.random.default_rng(1)
        x = rng.normal(size=(batch, 6, 6, 4)).astype("float32")
        r = rng.normal(size=(batch, 3, 3, filters)).astype("float32")
        layer = WeightNormConv2D(filters, 3, strides=2, use_bias=use_bias)
        layer.build(x.shape)
        if use_bias:
            layer.bias.assign(rng.normal(size=(filters,)).astype("float32"))

        class PlainConv(WeightNormConv2D):
            def call(self, inputs):
                outputs = keras.ops.conv(inputs, self.normalized_kernel(), strides=2, padding="same")
                return outputs + self.bias if use_bias else outputs

        plain = PlainConv(filters, 3, strides=2, use_bias=use_bias)
        plain.build(x.shape)
        plain.set_weights(layer.get_weights())
        loss = lambda y: keras.ops.sum(keras.ops.multiply(y, r))  # noqa: E731
        grad_x, grad_w = gradients(layer, loss, {"inputs": x})
        # Keras' own torch convolution fails on one image with one output
        # channel (the same torch slow path), so the reference sees the image
        # twice, the copy with a zero loss weight: the same gradients.
        x_ref, r_ref = np.concatenate([x, x]), np.concatenate([r, np.zeros_like(r)])
        loss_ref = lambda y: keras.ops.sum(keras.ops.multiply(y, r_ref))  # noqa: E731
        plain_x, plain_w = gradients(plain, loss_ref, {"inputs": x_ref})
        plain_y = keras.ops.convert_to_numpy(plain(x_ref))[:batch]
        self.assertAllClose(keras.ops.convert_to_numpy(layer(x)), plain_y, atol=1e-5, rtol=1e-5)
        self.assertAllClose(grad_x["inputs"], plain_x["inputs"][:batch], atol=1e-5, rtol=1e-5)
        for got, want in zip(grad_w, plain_w):
            self.assertAllClose(got, want, atol=1e-4, rtol=1e-5)
        if use_bias:
            self.assertAllClose(grad_w[2], r.sum(axis=(0, 1, 2)), atol=1e-5, rtol=1e-5)

    def test_log_g_starts_at_the_kernel_norm(self):
        layer = WeightNormConv2D(3, 1)
        layer.build((1, 4, 4, 2))
        kernel = keras.ops.convert_to_numpy(layer.kernel).astype("float64")
        expected = np.log(np.sqrt(np.sum(kernel**2, axis=(0, 1, 2))))
        self.assertAllClose(to_numpy(layer.log_g), expected, atol=1e-6, rtol=1e-6)

    def test_kernel_gradients_match_the_closed_form(self):
        # d/dv and d/dlog_g of sum(W * R), W = v s, s = exp(log_g) / ||v||:
        # dv = s R - v s (R.v) / ||v||^2 and dlog_g = s (R.v), per channel,
        # in float64 NumPy (torch computes them by hand, the others by autodiff).
        rng = np.random.default_rng(2)
        kernel = rng.normal(size=(3, 3, 4, 5))
        log_g = rng.normal(size=(5,))
        r = rng.normal(size=kernel.shape)

        class KernelProbe(WeightNormConv2D):
            def call(self, inputs):
                return keras.ops.sum(self.normalized_kernel() * inputs)

        layer = KernelProbe(5, 3, use_bias=False)
        layer.build((1, 6, 6, 4))
        layer.input_spec = None  # its `call` takes a kernel-shaped tensor, not images
        layer.set_weights([kernel.astype("float32"), log_g.astype("float32")])
        _, (grad_kernel, grad_log_g) = gradients(layer, lambda y: y, {"inputs": r.astype("float32")})

        norm = np.sqrt(np.sum(kernel**2, axis=(0, 1, 2)))
        scale = np.exp(log_g) / norm
        projection = np.sum(r * kernel, axis=(0, 1, 2))
        self.assertAllClose(grad_log_g, scale * projection, atol=1e-5, rtol=1e-4)
        self.assertAllClose(grad_kernel, scale * r - kernel * scale * projection / norm**2, atol=1e-5, rtol=1e-4)
