"""batched_normalized_kernels: the kernels and gradients of each WeightNormConv2D, computed together."""

import contextlib

import keras
import numpy as np
import pytest

from keras_avae.layers.batched_weight_norm import batched_normalized_kernels
from keras_avae.layers.batched_weight_norm import shared_kernel
from keras_avae.layers.weight_norm_conv2d import WeightNormConv2D
from tests.test_case import BACKEND
from tests.test_case import to_numpy


def _layers(seed=0):
    """Five layers, three of one kernel shape: two groups of stacked kernels and a lone one."""
    rng = np.random.default_rng(seed)
    specs = [(4, 3, 3), (4, 3, 3), (5, 1, 3), (4, 3, 3), (2, 3, 5)]
    layers = []
    for filters, size, channels in specs:
        layer = WeightNormConv2D(filters, size)
        layer.build((1, 6, 6, channels))
        layer.set_weights(
            [
                rng.normal(size=(size, size, channels, filters)).astype("float32"),
                rng.normal(size=(filters,)).astype("float32"),
                rng.normal(size=(filters,)).astype("float32"),
            ]
        )
        layers.append(layer)
    return layers


def _expected_kernel(layer):
    v = to_numpy(layer.kernel)
    return v / np.sqrt(np.sum(v**2, axis=(0, 1, 2))) * np.exp(to_numpy(layer.log_g))


def test_inside_each_layer_convolves_with_its_own_normalised_kernel():
    layers = _layers()
    x = np.random.default_rng(1).normal(size=(2, 6, 6, 3)).astype("float32")
    alone = [to_numpy(layer(x)) for layer in layers[:4]]
    with batched_normalized_kernels(layers):
        for layer in layers:
            np.testing.assert_allclose(to_numpy(layer.normalized_kernel()), _expected_kernel(layer), rtol=1e-5, atol=1e-6)
            assert (shared_kernel(layer) is not None) == (BACKEND == "torch")
        together = [to_numpy(layer(x)) for layer in layers[:4]]
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Nothing is left behind for later calls.
    assert all(shared_kernel(layer) is None for layer in layers)


@pytest.mark.skipif(BACKEND != "torch", reason="the batched kernels exist on torch only")
def test_gradients_match_the_per_layer_ones_and_unused_kernels_get_none():
    import torch

    layers = _layers(2)
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.normal(size=(2, 6, 6, 3)).astype("float32"))
    used = layers[:3]  # layers[3] shares its shape with used ones, layers[4] is alone

    def gradients(context):
        weights = [w.value for layer in layers for w in (layer.kernel, layer.log_g)]
        with context:
            loss = sum(torch.sum(layer(x) * (i + 1.0)) for i, layer in enumerate(used))
        return torch.autograd.grad(loss, weights, allow_unused=True)

    together = gradients(batched_normalized_kernels(layers))
    alone = gradients(contextlib.nullcontext())
    for a, b in zip(together, alone):
        if b is None:
            assert a is None
        else:
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    assert all(g is None for g in together[6:])  # layers[3] and layers[4]: not used


@pytest.mark.skipif(BACKEND != "torch", reason="the batched kernels exist on torch only")
def test_doubles_and_nesting_leave_the_per_layer_kernels():
    layers = _layers()
    with batched_normalized_kernels(layers):
        inner = layers[0]
        kernel = shared_kernel(inner)
        with batched_normalized_kernels(layers):  # already inside: the outer kernels stay
            assert shared_kernel(inner) is kernel
    double = WeightNormConv2D(2, 1, dtype="float64")
    double.build((1, 4, 4, 2))
    with batched_normalized_kernels([double]):
        assert shared_kernel(double) is None


@pytest.mark.skipif(BACKEND != "torch", reason="the batched kernels exist on torch only")
def test_a_model_trains_the_same_with_and_without_them(monkeypatch):
    from keras_avae.models import hierarchical_vae
    from tests.models.test_hierarchical_vae import TINY
    from tests.models.test_hierarchical_vae import reset_seed
    from tests.models.test_hierarchical_vae import shapes_batch

    model = hierarchical_vae.HierarchicalVAE(**dict(TINY, l2=1e-3))
    model.build()
    x = keras.ops.convert_to_tensor(shapes_batch(4))
    start = model.get_weights()

    def loss_and_gradients():
        model.set_weights(start)
        reset_seed(model)
        model.zero_grad()
        loss = model.compute_loss(x=x, y_pred=model(x, training=True))
        loss.backward()
        return to_numpy(loss), [to_numpy(v.value.grad) for v in model.trainable_weights]

    together = loss_and_gradients()
    monkeypatch.setattr(hierarchical_vae, "batched_normalized_kernels", lambda layers: contextlib.nullcontext())
    alone = loss_and_gradients()
    np.testing.assert_allclose(together[0], alone[0], rtol=1e-6)
    for variable, a, b in zip(model.trainable_weights, together[1], alone[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=variable.path)
