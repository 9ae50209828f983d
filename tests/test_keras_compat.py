"""The private Keras APIs of `keras_avae.keras_compat` still exist and work as it assumes.

Each test names the Keras internal it relies on, so a Keras release that
changes one fails here, by name.
"""

import contextlib
import inspect

import keras
import numpy as np
import pytest

from keras_avae import keras_compat

BACKEND = keras.backend.backend()


def tiny_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_the_installed_keras_is_the_tested_one():
    assert keras.__version__ == keras_compat.TESTED_KERAS_VERSION, (
        f"keras {keras.__version__} is installed; keras_compat was checked with "
        f"{keras_compat.TESTED_KERAS_VERSION}: run this file and update the version"
    )


def test_register_tree_node_class_makes_keras_tree_see_the_leaves():
    @keras_compat.register_tree_node_class
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

        def tree_flatten(self):
            return (self.a, self.b), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

        # The protocol of the torch backend's tree implementation.
        def torchtree_flatten(self):
            return [self.a, self.b], None

        @classmethod
        def torchtree_unflatten(cls, children, aux):
            return cls(*children)

        def torchtree_flatten_with_keys(self):
            from torch.utils import _pytree

            return [(_pytree.SequenceKey(i), v) for i, v in enumerate((self.a, self.b))], None

    leaves = keras.tree.flatten(Pair(1, [2, 3]))
    assert leaves == [1, 2, 3]
    doubled = keras.tree.map_structure(lambda x: 2 * x, Pair(1, 2))
    assert isinstance(doubled, Pair) and (doubled.a, doubled.b) == (2, 4)


def test_set_initial_epoch_moves_the_start_of_fit():
    class StartAtTwo(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            keras_compat.set_initial_epoch(self.model, 2)

    epochs = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    model = tiny_model()
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, epochs=4, verbose=0, callbacks=[StartAtTwo(), Record()])
    assert epochs == [2, 3]
    # Keras' own BackupAndRestore uses the same attribute.
    assert "_initial_epoch" in inspect.getsource(keras.callbacks.BackupAndRestore)
    keras_compat.set_initial_epoch(model, None)
    epochs.clear()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[Record()])
    assert epochs == [0, 1]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_multi_worker_log_reduction_patches_the_function_keras_calls():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica
    assert callable(tf_trainer._collective_all_reduce_multi_worker)
    # Keras calls it by its module-level name, so replacing that name takes effect.
    assert inspect.getsource(tf_trainer).count("= reduce_per_replica(") >= 2
    with keras_compat.multi_worker_scalar_log_reduction():
        assert tf_trainer.reduce_per_replica is not original
    assert tf_trainer.reduce_per_replica is original


def test_no_automatic_dependency_tracking_is_what_loss_scale_optimizer_uses():
    source = inspect.getsource(keras.optimizers.LossScaleOptimizer.build)
    assert "no_automatic_dependency_tracking" in source
    from keras_avae.training import NonFiniteGuard

    guard = NonFiniteGuard(keras.optimizers.SGD(0.1))
    variables = [keras.Variable(np.zeros(2, "float32"))]
    guard.build(variables)
    # The inner optimizer's variables appear once, through `variables`.
    assert len(guard.variables) == len({id(v) for v in guard.variables})


def test_nested_layers_reaches_every_depth_and_only_layers():
    class Cell(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.norm = keras.layers.BatchNormalization()
            self.convs = [keras.layers.Dense(2), keras.layers.Dense(3)]

        def call(self, x):
            return self.convs[1](self.convs[0](self.norm(x)))

    class Outer(keras.Model):
        def __init__(self):
            super().__init__()
            self.cells = [Cell(name="a"), Cell(name="b")]

        def call(self, x):
            return self.cells[1](self.cells[0](x))

    model = Outer()
    model(np.zeros((2, 4), "float32"))
    cells = model.cells
    found = keras_compat.nested_layers(model)
    expected = [layer for cell in cells for layer in (cell, cell.norm, *cell.convs)]
    assert sorted(map(id, found)) == sorted(map(id, expected))
    assert model not in found


class _Recorder(keras.layers.Layer):
    """Adds its weight; remembers whether `call` ran and with which `training`."""

    def build(self, input_shape):
        self.offset = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x, training=None):
        self.seen_training = training
        return x + self.offset


def _bookkeeping_skipped(layer, *args, **kwargs):
    return keras_compat._skips_call_bookkeeping(layer, args, kwargs)


def test_call_sublayer_gives_what_calling_the_layer_gives():
    layer = _Recorder()
    x = keras.ops.convert_to_tensor(np.arange(6, dtype="float32").reshape(2, 3))
    layer.build(x.shape)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras_compat.call_sublayer(layer, x, training=True)),
        keras.ops.convert_to_numpy(layer(x, training=True)),
    )
    assert layer.seen_training is True
    if BACKEND == "torch":  # the others always go through __call__
        assert _bookkeeping_skipped(layer, x, training=True)


@pytest.mark.skipif(BACKEND != "torch", reason="only torch skips Layer.__call__")
def test_call_sublayer_keeps_layer_call_where_its_bookkeeping_matters():
    import torch

    layer = _Recorder()
    x = keras.ops.ones((2, 3))
    assert not _bookkeeping_skipped(layer, x)  # not built: __call__ builds it
    layer.build(x.shape)
    assert _bookkeeping_skipped(layer, x, training=False)
    # `training` missing or None is resolved from the call context by __call__.
    assert not _bookkeeping_skipped(layer, x, training=None)
    assert not _bookkeeping_skipped(layer, x)
    # Inputs __call__ would convert: another dtype, or not a tensor.
    assert not _bookkeeping_skipped(layer, keras.ops.ones((2, 3), dtype="float64"), training=True)
    assert not _bookkeeping_skipped(layer, np.ones((2, 3), "float32"), training=True)
    assert not _bookkeeping_skipped(layer, [x, np.ones((2, 3), "float32")], training=True)
    assert _bookkeeping_skipped(layer, [x, (x, None)], training=True)
    # A Keras mask, an activity regularizer, a torch hook.
    masked = keras.ops.ones((2, 3))
    keras.src.backend.set_keras_mask(masked, keras.ops.ones((2,), dtype="bool"))
    assert not _bookkeeping_skipped(layer, masked, training=True)
    regularized = _Recorder(activity_regularizer="l2")
    regularized.build(x.shape)
    assert not _bookkeeping_skipped(regularized, x, training=True)
    calls = []
    handle = layer.register_forward_hook(lambda *args: calls.append(1))
    assert not _bookkeeping_skipped(layer, x, training=True)
    keras_compat.call_sublayer(layer, x, training=True)
    assert calls == [1]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: calls.append(2))
    try:
        assert not _bookkeeping_skipped(layer, x, training=True)
    finally:
        handle.remove()
    # Mixed precision: inputs __call__ would cast (not with autocast=False).
    mixed = _Recorder(dtype="mixed_bfloat16")
    mixed.build(x.shape)
    assert _bookkeeping_skipped(mixed, keras.ops.cast(x, "bfloat16"), training=True)
    assert not _bookkeeping_skipped(mixed, x, training=True)
    assert not _bookkeeping_skipped(mixed, keras.ops.cast(x, "bfloat16"), extra=x, training=True)
    uncast = _Recorder(dtype="mixed_bfloat16", autocast=False)
    uncast.build(x.shape)
    assert _bookkeeping_skipped(uncast, x, training=True)


@pytest.mark.skipif(BACKEND != "torch", reason="only torch skips Layer.__call__")
def test_call_sublayer_enters_the_autocast_scope_layer_call_enters():
    # A float32 layer reads its float32 weights; a mixed layer reads them
    # cast to bfloat16, inside or outside another layer's scope, unless it
    # opts out of autocasting.
    class ReadsOffset(_Recorder):
        def call(self, x, training=None):
            return keras.ops.convert_to_tensor(self.offset).dtype

    x = keras.ops.ones((2, 3))
    for policy, autocast in (("float32", True), ("mixed_bfloat16", True), ("mixed_bfloat16", False)):
        layer = ReadsOffset(dtype=policy, autocast=autocast)
        layer.build(x.shape)
        inputs = keras.ops.cast(x, layer.compute_dtype)
        for outer in (None, "bfloat16", "float16"):
            scope = keras.src.backend.AutocastScope(outer) if outer else contextlib.nullcontext()
            with scope:
                assert keras_compat._skips_call_bookkeeping(layer, (inputs,), {"training": True})
                got = keras_compat.call_sublayer(layer, inputs, training=True)
                assert got == layer(inputs, training=True), (policy, autocast, outer)


# The optimizer class each backend's Keras records for `"adamax"` (PyTorch's
# is its own), and the `jit_compile` that JAX's `"auto"` resolves to.
FOREIGN_COMPILE = {
    "tensorflow": {"module": "keras.src.backend.torch.optimizers.torch_adamax", "jit_compile": True},
    "jax": {"module": "keras.src.backend.torch.optimizers.torch_adamax", "jit_compile": False},
    "torch": {"module": "keras.optimizers", "jit_compile": True},
}


def test_a_model_file_saved_by_another_backend_trains_here(tmp_path):
    # Before: loaded on TensorFlow or JAX, a file saved on PyTorch rebuilt
    # PyTorch's Adamax ("expected Tensor ... but got ResourceVariable" in
    # `fit`); on PyTorch, a file saved on JAX ran `torch.compile`, which failed.
    import json
    import zipfile

    from keras_avae.models.hierarchical_vae import HierarchicalVAE
    from tests.models.test_hierarchical_vae import TINY

    x = (np.random.default_rng(0).random((8, *TINY["image_shape"])) > 0.5).astype("float32")
    model = HierarchicalVAE(**dict(TINY, num_layers=1))
    model.compile(optimizer=keras.optimizers.Adamax(1e-3))
    model.build()
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(5)  # a trained model's state, without training it here
    model.save(tmp_path / "here.keras")
    with zipfile.ZipFile(tmp_path / "here.keras") as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(files["config.json"])
    foreign = FOREIGN_COMPILE[keras.backend.backend()]
    config["compile_config"]["optimizer"]["module"] = foreign["module"]
    config["compile_config"]["jit_compile"] = foreign["jit_compile"]
    files["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(tmp_path / "foreign.keras", "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)

    loaded = keras.saving.load_model(tmp_path / "foreign.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.Adamax)  # this backend's class
    assert int(loaded.optimizer.iterations) == 5
    # Compiled as this backend compiles by default: XLA on JAX, never torch.compile.
    assert loaded.jit_compile == (keras.backend.backend() == "jax")
    loss = loaded.fit(x, epochs=1, batch_size=8, verbose=0).history["loss"][0]
    assert np.isfinite(loss) and int(loaded.optimizer.iterations) == 6
