"""Every private Keras API keras-avae uses, in one place.

Keras 3 has no public way to do the few things below, so keras-avae reaches
into Keras here and nowhere else. `tests/test_keras_compat.py` checks each
of them against the installed Keras (that the attribute exists and is used
by Keras the way these helpers assume), so a Keras release that changes one
fails there, by name, rather than somewhere inside training. Measured to
work with `TESTED_KERAS_VERSION`.

- `register_tree_node_class`: a class Keras' tree utilities flatten (the
  distributions a layer returns carry their parameters as leaves).
- `no_automatic_dependency_tracking`: the decorator an optimizer wrapper's
  `build` needs (`NonFiniteGuard`), as Keras' `LossScaleOptimizer` has it.
- `set_initial_epoch`: the epoch `fit` starts from, set by a callback (what
  `keras.callbacks.BackupAndRestore` does, through `model._initial_epoch`).
- `multi_worker_scalar_log_reduction`: a fix of Keras' reduction of the
  per-step logs under `MultiWorkerMirroredStrategy` (TensorFlow).
- `nested_layers`: every layer inside a layer or model, at any depth
  (`Model.layers` lists the direct children only).
"""

import contextlib

import keras

# Keras exposes no public way to declare a tree node.
from keras.src.tree import register_tree_node_class  # noqa: F401

# The decorator Keras' own optimizer wrappers (LossScaleOptimizer) put on
# `build`, so that building the inner optimizer does not track it twice.
from keras.src.utils.tracking import no_automatic_dependency_tracking  # noqa: F401

TESTED_KERAS_VERSION = "3.15.1"


def set_initial_epoch(model, epoch):
    """Makes the next `model.fit` start at `epoch` (or, with `None`, at its `initial_epoch`).

    `fit` reads `model._initial_epoch` after `on_train_begin`, so a callback
    that restores a checkpoint there can move the start, as
    `keras.callbacks.BackupAndRestore` does.

    Example:

    >>> model = keras.Sequential([keras.layers.Dense(1)])
    >>> set_initial_epoch(model, 3)
    >>> model._initial_epoch
    3
    """
    model._initial_epoch = epoch


def nested_layers(layer):
    """Every layer tracked inside `layer`, at any depth, `layer` itself excluded.

    Example:

    >>> inner = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(1)])
    >>> model = keras.Sequential([inner, keras.layers.Dense(1)])
    >>> len(nested_layers(model))
    4
    """
    return list(layer._flatten_layers(include_self=False, recursive=True))


@contextlib.contextmanager
def multi_worker_scalar_log_reduction():
    """Reduces scalar per-step logs with `axis=None` under `MultiWorkerMirroredStrategy`.

    Keras 3.15 reduces the per-step logs of a multi-worker `fit` with
    `strategy.reduce("MEAN", value, axis=0)`, which fails on every scalar
    metric ("Invalid reduction dimension 0 for input with 0 dimensions";
    tensorflow/tensorflow#72388), so `fit` cannot run at all. Inside this
    context (the step function is traced then) each value is reduced with
    `axis=None`, the mean over replicas that was meant. TensorFlow backend.

    Example:

    >>> with multi_worker_scalar_log_reduction():  # doctest: +SKIP
    ...     model.fit(dataset)
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction == "auto" and tf_trainer._collective_all_reduce_multi_worker(strategy):
            return keras.tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    tf_trainer.reduce_per_replica = reduce_per_replica
    try:
        yield
    finally:
        tf_trainer.reduce_per_replica = original
