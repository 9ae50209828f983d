"""Every private Keras API keras-avae uses, in one place.

Keras 3 has no public way to do the few things below, so keras-avae reaches
into Keras here and nowhere else. `tests/test_keras_compat.py` checks each
of them against the installed Keras (that the attribute exists and is used
by Keras the way these helpers assume), so a Keras release that changes one
fails there, by name, rather than somewhere inside training. Measured to
work with `TESTED_KERAS_VERSION`.

- `register_tree_node_class`: a class Keras' tree utilities (and JAX's, on
  JAX) flatten (the distributions a layer returns carry their parameters as
  leaves).
- `no_automatic_dependency_tracking`: the decorator an optimizer wrapper's
  `build` needs (`NonFiniteGuard`), as Keras' `LossScaleOptimizer` has it.
- `set_initial_epoch`: the epoch `fit` starts from, set by a callback (what
  `keras.callbacks.BackupAndRestore` does, through `model._initial_epoch`).
- `multi_worker_scalar_log_reduction`: a fix of Keras' reduction of the
  per-step logs under `MultiWorkerMirroredStrategy` (TensorFlow).
- `nested_layers`: every layer inside a layer or model, at any depth
  (`Model.layers` lists the direct children only).
- `in_stateless_scope`: whether variable writes must go through `assign`.
- `call_sublayer`: a built sublayer's `call` without `Layer.__call__`'s
  bookkeeping on PyTorch, where nothing of it applies.
- `portable_compile_config`: a `.keras` file's compile config, freed of
  what Keras recorded of the backend that saved it.
"""

import contextlib

import keras

# Keras exposes no public way to declare a tree node.
from keras.src.tree import register_tree_node_class as _register_keras_tree_node_class

# Whether variables are being read and written through a `StatelessScope`
# (then an assignment must go through `Variable.assign`).
from keras.src.backend.common.stateless_scope import in_stateless_scope  # noqa: F401

# The decorator Keras' own optimizer wrappers (LossScaleOptimizer) put on
# `build`, so that building the inner optimizer does not track it twice.
from keras.src.utils.tracking import no_automatic_dependency_tracking  # noqa: F401

TESTED_KERAS_VERSION = "3.15.1"


def register_tree_node_class(cls):
    """Declares `cls` (with `tree_flatten`/`tree_unflatten`) a node of Keras' trees, and on JAX of JAX's.

    Keras' trees are its own (optree's "keras" namespace); JAX's traces
    (`jax.jit`, and `jax.eval_shape` for the symbolic call of a layer
    subclass) take only JAX pytrees.

    Example (the class of `DiscretizedLogisticMixture`'s outputs is one):

    >>> from keras_avae.distributions import DiscretizedLogisticMixtureDistribution
    >>> dist = DiscretizedLogisticMixtureDistribution(np.zeros((1, 2, 2, 10), "float32"))
    >>> [tuple(leaf.shape) for leaf in keras.tree.flatten(dist)]
    [(1, 2, 2, 10)]
    """
    cls = _register_keras_tree_node_class(cls)
    if keras.backend.backend() == "jax":
        import jax

        jax.tree_util.register_pytree_node_class(cls)
    return cls


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


def portable_compile_config(config):
    """A saved compile config that compiles on this backend, whichever saved it.

    Keras records two things of the saving backend in a `.keras` file: the
    optimizer's class by its module, which on PyTorch is a PyTorch-only
    class (`keras.src.backend.torch.optimizers.torch_adamax`: loaded on
    TensorFlow or JAX, `fit` failed with "expected Tensor ... but got
    ResourceVariable"), and `jit_compile` as resolved there (`"auto"` is
    True on JAX, which on PyTorch meant a `torch.compile` that failed).
    Another backend's optimizer module becomes the public
    `keras.optimizers` (the same class name there is this backend's), and
    `jit_compile` goes back to `"auto"`, this backend's default.

    Example:

    >>> portable_compile_config({"optimizer": "adamax", "jit_compile": True})
    {'optimizer': 'adamax', 'jit_compile': 'auto'}
    """
    if not isinstance(config, dict):
        return config
    config = _public_optimizer_modules(config)
    if "jit_compile" in config:
        config["jit_compile"] = "auto"
    return config


def _public_optimizer_modules(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_public_optimizer_modules(v) for v in value)
    if not isinstance(value, dict):
        return value
    value = {key: _public_optimizer_modules(v) for key, v in value.items()}
    module = value.get("module")
    own = f"keras.src.backend.{keras.backend.backend()}."
    if isinstance(module, str) and module.startswith("keras.src.backend.") and not module.startswith(own):
        if ".optimizers." in module and "class_name" in value:
            value["module"] = "keras.optimizers"
    return value


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


def call_sublayer(layer, *args, **kwargs):
    """`layer(*args, **kwargs)` for a built layer called inside another layer's `call`.

    On PyTorch, eager Keras pays `Layer.__call__`'s bookkeeping on every call
    (input conversion, call-spec binding, the call context, mask and tree
    walks): 40-140 us per call measured on the 2-core CPU, about a hundred
    calls per `mnist-baseline-small` step. Where none of it can change the
    result, this calls `layer.call` directly, in the autocast scope
    `__call__` would enter: PyTorch backend, `layer` built, every positional
    argument (or item of nested lists and tuples) `None` or a tensor, no
    tensor argument that `__call__` would cast to the layer's input dtype or
    that carries a Keras mask, no NumPy array argument, `training` given
    and not `None` where `call` takes it (so that no call context has to
    resolve it), no activity
    regularizer, no rematerialisation and no torch module hooks. Otherwise,
    and on the other backends (whose compiled steps trace `__call__` once),
    it is `layer(*args, **kwargs)`.

    Example:

    >>> dense = keras.layers.Dense(2)
    >>> dense.build((None, 3))
    >>> tuple(call_sublayer(dense, keras.ops.ones((1, 3))).shape)
    (1, 2)
    """
    if keras.backend.backend() != "torch" or not _skips_call_bookkeeping(layer, args, kwargs):
        return layer(*args, **kwargs)
    scope = _autocast_scope(layer)
    if scope is None:
        return layer.call(*args, **kwargs)
    with scope:
        return layer.call(*args, **kwargs)


def _skips_call_bookkeeping(layer, args, kwargs):
    """Whether `Layer.__call__` would pass `args` and `kwargs` to `layer.call` unchanged (torch)."""
    import torch
    from keras.src.backend.common.remat import get_current_remat_mode
    from torch.nn.modules import module as torch_module

    if not layer.built or layer.activity_regularizer is not None:
        return False
    # A call-context argument (`training`) missing or `None` is resolved
    # from the outer calls by `__call__`.
    for name in layer._call_context_args:
        if name in layer.call_signature_parameters and kwargs.get(name) is None:
            return False
    converts = layer.autocast and layer._convert_input_args
    for positional, values in ((True, args), (False, kwargs.values())):
        for value in _leaves(values):
            if isinstance(value, torch.Tensor):
                if keras.src.backend.get_keras_mask(value) is not None:
                    return False
                dtype = keras.backend.standardize_dtype(value.dtype)
                if converts and keras.backend.is_float_dtype(dtype) and dtype != layer.input_dtype:
                    return False
            elif (positional and value is not None) or hasattr(value, "__array__"):
                return False
    if getattr(layer, "_remat_mode", None) is not None or get_current_remat_mode() is not None:
        return False
    hooks = (
        layer._forward_hooks,
        layer._forward_pre_hooks,
        layer._backward_hooks,
        layer._backward_pre_hooks,
        torch_module._global_forward_hooks,
        torch_module._global_forward_pre_hooks,
        torch_module._global_backward_hooks,
        torch_module._global_backward_pre_hooks,
    )
    return not any(hooks)


def _autocast_scope(layer):
    """The autocast scope `Layer.__call__` enters for `layer`, or `None` where it keeps the current one."""
    backend = keras.src.backend
    current = backend.get_autocast_scope()
    if current is not None:
        if not layer.autocast or not backend.is_float_dtype(layer.compute_dtype):
            return backend.AutocastScope(None)
        if current.dtype != layer.compute_dtype:
            return backend.AutocastScope(layer.compute_dtype)
        return None
    if layer.compute_dtype != layer.variable_dtype:
        return backend.AutocastScope(layer.compute_dtype)
    return None


def _leaves(structure):
    """The items of nested lists and tuples, depth first."""
    for item in structure:
        if isinstance(item, (list, tuple)):
            yield from _leaves(item)
        else:
            yield item
