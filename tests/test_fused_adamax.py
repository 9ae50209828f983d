"""FusedAdamax: Keras' Adamax update, as TensorFlow's fused kernel on TensorFlow."""

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


def test_make_optimizer_uses_it_on_tensorflow_only():
    inner = training.make_optimizer(training.resolve_recipe("mnist-attentive-small"), 10).inner_optimizer
    assert isinstance(inner, keras.optimizers.Adamax)
    # On PyTorch Keras swaps `keras.optimizers.Adamax` for its multi-tensor
    # version, which a subclass would not get.
    assert isinstance(inner, training.FusedAdamax) == (BACKEND == "tensorflow")


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
