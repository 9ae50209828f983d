"""`inference_pass`: one compiled function per shape on JAX, no autograd graph on PyTorch."""

import keras
import numpy as np
import pytest

from keras_avae.inference_passes import inference_pass

BACKEND = keras.backend.backend()


def dense_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones")])


@pytest.mark.parametrize("xla_on_tensorflow", [False, True])
def test_a_pass_computes_what_its_function_computes_and_a_compiled_one_traces_once_per_shape(xla_on_tensorflow):
    model = dense_model()
    traced = []

    def double(x):
        traced.append(x.shape)
        return 2 * model(x)

    double_pass = inference_pass(model, "double", double, xla_on_tensorflow=xla_on_tensorflow)
    for x in (np.ones((1, 3), "float32"), np.full((1, 3), 2.0, "float32"), np.ones((4, 3), "float32")):
        out = np.asarray(keras.ops.convert_to_numpy(double_pass(x)))
        np.testing.assert_allclose(out, 2 * x.sum(axis=1, keepdims=True).repeat(2, axis=1), rtol=1e-6)
    # Compiled (JAX; TensorFlow with XLA): traced for each new shape only.
    # Eager (PyTorch; TensorFlow without): run each call.
    compiled = BACKEND == "jax" or (BACKEND == "tensorflow" and xla_on_tensorflow)
    assert len(traced) == (2 if compiled else 3), traced
    # The pass is kept on the model under its name, except TensorFlow's
    # eager passes, which are the functions themselves.
    negate = lambda x: -model(x)  # noqa: E731
    again = inference_pass(model, "double", negate, xla_on_tensorflow=xla_on_tensorflow)
    assert again is (negate if BACKEND == "tensorflow" and not xla_on_tensorflow else double_pass)


def test_a_static_argument_is_a_python_value_inside_the_pass():
    model = dense_model()
    scaled = inference_pass(model, "scaled", lambda x, how: model(x) * (3.0 if how == "triple" else 1.0), (1,))
    x = np.ones((1, 3), "float32")
    triple = np.asarray(keras.ops.convert_to_numpy(scaled(x, "triple")))
    same = np.asarray(keras.ops.convert_to_numpy(scaled(x, "same")))
    np.testing.assert_allclose(triple, 3 * same)


def test_seed_states_advance_as_in_eager_calls():
    model = dense_model()
    model.seed_generator = keras.random.SeedGenerator(3)
    noisy = lambda x: model(x) + keras.random.normal((1, 2), seed=model.seed_generator)  # noqa: E731
    compiled = inference_pass(model, "noisy", noisy)
    x = np.zeros((1, 3), "float32")
    state = keras.ops.convert_to_numpy(model.seed_generator.state).copy()
    first, second = (np.asarray(keras.ops.convert_to_numpy(compiled(x))) for _ in range(2))
    model.seed_generator.state.assign(state)
    eager_first, eager_second = (np.asarray(keras.ops.convert_to_numpy(noisy(x))) for _ in range(2))
    np.testing.assert_allclose(first, eager_first, atol=1e-6)
    np.testing.assert_allclose(second, eager_second, atol=1e-6)
    assert not np.allclose(first, second)


@pytest.mark.skipif(BACKEND != "torch", reason="only PyTorch records gradients outside a training step")
def test_torch_passes_record_no_autograd_graph():
    import torch

    model = dense_model()
    out = inference_pass(model, "plain", lambda x: model(x))(np.ones((1, 3), "float32"))
    assert not out.requires_grad and out.grad_fn is None
    assert torch.is_grad_enabled()


def test_a_compiled_pass_builds_an_unbuilt_model_first():
    """Before, on TensorFlow: `log_likelihood` of a model not yet built (its XLA pass the first thing to
    run it) failed with "We failed to lift variable creations out of this tf.function"."""
    from keras_avae.evaluation import _reseed
    from keras_avae.models import HierarchicalVAE
    from tests.models.test_hierarchical_vae import TINY
    from tests.models.test_hierarchical_vae import shapes_batch

    model = HierarchicalVAE(**TINY)
    x = shapes_batch(3)
    assert not model.built
    first = model.log_likelihood(x, num_samples=4)
    assert model.built and first.shape == (3,) and np.all(np.isfinite(first)) and np.all(first < 0)
    # The same weights and seed state in a model built beforehand: the same numbers.
    twin = HierarchicalVAE(**TINY)
    twin.build()
    twin.set_weights(model.get_weights())
    for m in (model, twin):
        _reseed(m, seed=3, batch_index=0)
    np.testing.assert_allclose(model.log_likelihood(x, num_samples=4), twin.log_likelihood(x, num_samples=4), rtol=1e-5)
