"""FusedAdamax: Keras' Adamax update, as TensorFlow's fused kernel on TensorFlow and flat buffers on PyTorch."""

import keras
import numpy as np
import pytest

from keras_avae import training

BACKEND = keras.backend.backend()


def small_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            # No bias before the batch norm: its gradient is rounding noise.
            keras.layers.Conv2D(3, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


def trained_state(optimizer, steps=6):
    model = small_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = rng.normal(size=(8, 6, 6, 2)).astype("float32")
        y = rng.normal(size=(8, 1)).astype("float32")
        model.train_on_batch(x, y)
    return [keras.ops.convert_to_numpy(v) for v in model.trainable_variables + optimizer.variables]


def schedule():
    return training.WarmupCosineDecay(1e-2, 2, 4, initial_learning_rate=1e-3, min_learning_rate=1e-4)


def test_same_trajectory_as_keras_adamax():
    """Six steps on a warm-up + cosine schedule: weights, moments and norms as Keras' Adamax."""
    kwargs = dict(beta_1=0.8, beta_2=0.99, epsilon=1e-3)
    fused = trained_state(training.FusedAdamax(schedule(), **kwargs))
    reference = trained_state(keras.optimizers.Adamax(schedule(), **kwargs))
    assert len(fused) == len(reference) > 8
    for a, b in zip(fused, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # The comparison can fail: another beta_2 gives other weights.
    other = trained_state(keras.optimizers.Adamax(schedule(), beta_1=0.8, beta_2=0.5, epsilon=1e-3))
    assert max(np.max(np.abs(a - b)) for a, b in zip(fused, other)) > 1e-4


def test_same_variables_config_and_serialisation_as_adamax():
    """A checkpoint written with Keras' Adamax restores into FusedAdamax (same slots, same paths)."""
    variables = small_model().trainable_variables
    fused, reference = training.FusedAdamax(1e-3, name="adamax"), keras.optimizers.Adamax(1e-3, name="adamax")
    fused.build(variables)
    reference.build(variables)
    assert [(v.path, tuple(v.shape)) for v in fused.variables] == [(v.path, tuple(v.shape)) for v in reference.variables]
    assert fused.get_config() == reference.get_config()
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(fused))
    assert type(restored) is training.FusedAdamax and restored.get_config() == fused.get_config()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the fused kernel is TensorFlow's")
def test_one_fused_op_per_weight_in_the_traced_update():
    import tensorflow as tf

    def traced_ops(optimizer):
        variables = small_model().trainable_variables
        optimizer.build(variables)
        grads = [tf.ones_like(v) for v in variables]
        graph = tf.function(lambda: optimizer.apply(grads, variables)).get_concrete_function().graph
        return variables, [op.type for op in graph.get_operations()]

    variables, fused = traced_ops(training.FusedAdamax(1e-3))
    _, reference = traced_ops(keras.optimizers.Adamax(1e-3))
    assert fused.count("ResourceApplyAdaMax") == len(variables) == 5
    assert reference.count("ResourceApplyAdaMax") == 0
    assert fused.count("Pow") == 1  # beta_1 ** t once per step, not once per weight
    assert len(fused) < len(reference) / 2, (len(fused), len(reference))


def test_make_optimizer_uses_it_on_tensorflow_and_torch():
    inner = training.make_optimizer(training.resolve_recipe("mnist-attentive-small"), 10).inner_optimizer
    assert isinstance(inner, keras.optimizers.Adamax)
    # JAX compiles the whole step: Keras' own Adamax there.
    assert isinstance(inner, training.FusedAdamax) == (BACKEND in ("tensorflow", "torch"))


@pytest.mark.skipif(BACKEND != "torch", reason="the flat moment buffers are PyTorch's path")
def test_torch_slots_are_views_of_two_buffers_and_checkpoints_restore_into_them():
    import torch

    def built(cls):
        variables = small_model().trainable_variables
        optimizer = cls(1e-2, beta_1=0.8, beta_2=0.99, name="adamax")
        optimizer.build(variables)
        return optimizer, variables

    fused, variables = built(training.FusedAdamax)
    state = fused._flat_state
    assert state.ok and state.m.numel() == sum(int(np.prod(v.shape)) for v in variables)
    for slots, flat in ((fused._m, state.m), (fused._u, state.u)):
        start = flat.data_ptr()
        assert [s.value.data_ptr() for s in slots] == [start + 4 * o for o in np.cumsum([0] + state.sizes[:-1])]

    # A checkpoint's slots (here: random ones) land in the buffers, and the
    # next steps are Keras' Adamax from the same checkpoint.
    reference, reference_variables = built(keras.optimizers.Adamax)
    rng = np.random.default_rng(3)
    store = {}
    reference.save_own_variables(store)
    # Slots 0 and 1 are the iteration count and the learning rate.
    store = {key: np.abs(rng.normal(size=np.shape(value))).astype("float32") if int(key) > 1 else value for key, value in store.items()}
    store["0"] = np.array(4, "int32")
    for optimizer in (fused, reference):
        optimizer.load_own_variables(store)
    np.testing.assert_array_equal(state.m.numpy(), np.concatenate([np.ravel(s.value.numpy()) for s in fused._m]))
    for _ in range(3):
        grads = [torch.tensor(rng.normal(size=v.shape).astype("float32")) for v in variables]
        fused.apply(grads, variables)
        reference.apply([g.clone() for g in grads], reference_variables)
    for a, b in zip(variables + fused.variables, reference_variables + reference.variables):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), rtol=1e-6, atol=1e-8)

    # Updating a subset of the weights takes Keras' multi-tensor path.
    grads = [torch.ones(v.shape) for v in variables[:2]]
    fused.apply(grads, variables[:2])
    reference.apply(grads, reference_variables[:2])
    for a, b in zip(variables + fused.variables, reference_variables + reference.variables):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), rtol=1e-6, atol=1e-8)


def _weights_after_steps(optimizer, layers, batches):
    """The trainable weights of `Sequential(layers)` (seeded) after one MSE `train_on_batch` per batch."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(layers())
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    for x, y in batches:
        model.train_on_batch(x, y)
    return [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]


def test_sparse_gradients_of_an_embedding():
    """An embedding's gradient (IndexedSlices on TensorFlow): the same update as Keras' Adamax."""

    def layers():
        return [keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.Dense(1)]

    batches = [(np.array([[1, 2, 2], [5, 1, 0]]) + step, np.ones((2, 3, 1), "float32")) for step in range(3)]
    fused = _weights_after_steps(training.FusedAdamax(1e-2), layers, batches)
    reference = _weights_after_steps(keras.optimizers.Adamax(1e-2), layers, batches)
    for a, b in zip(fused, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the cast is on the fused kernel's path (JAX has no float64 by default)")
def test_float64_weights():
    """Weights of another dtype than the step's float32 scalars: the same update as Keras' Adamax."""

    def layers():
        return [keras.Input((3,)), keras.layers.Dense(2, dtype="float64")]

    rng = np.random.default_rng(2)
    batches = [(rng.normal(size=(4, 3)), rng.normal(size=(4, 2))) for _ in range(3)]
    fused = _weights_after_steps(training.FusedAdamax(1e-2), layers, batches)
    reference = _weights_after_steps(keras.optimizers.Adamax(1e-2), layers, batches)
    assert fused[0].dtype == np.float64
    for a, b in zip(fused, reference):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bfloat16_weights():
    """TensorFlow's fused kernel has no bfloat16 version (the step failed): Keras' update there."""

    def layers():
        return [keras.Input((3,)), keras.layers.Dense(2, dtype="bfloat16")]

    rng = np.random.default_rng(3)
    batches = [(rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(4, 2)).astype("float32")) for _ in range(3)]
    fused = _weights_after_steps(training.FusedAdamax(1e-2), layers, batches)
    reference = _weights_after_steps(keras.optimizers.Adamax(1e-2), layers, batches)
    for a, b in zip(fused, reference):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
