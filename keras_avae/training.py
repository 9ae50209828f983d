"""Training: schedules, the non-finite guard, strategies, checkpoints, `train`.

Everything the `keras-avae train` command does, as a library (DESIGN §5-6):

- `WarmupCosineDecay`: linear learning-rate warm-up from 1e-4, then cosine
  decay to a floor, optionally with one warm restart; per step.
- `make_optimizer(recipe, steps_per_epoch)`: Adamax (lr 1e-2, beta_1 0.9,
  beta_2 0.999, epsilon 1e-3) on that schedule, optional global gradient
  clipping, wrapped in `NonFiniteGuard`.
- `NonFiniteGuard`: an optimizer wrapper (the pattern of Keras'
  `LossScaleOptimizer`) that skips every step whose gradients are not all
  finite, leaving weights and optimizer state untouched, and counts the
  skipped steps in a checkpointed variable. `NonFiniteMonitor` undoes what
  the bad batch's forward pass wrote (batch-norm statistics, metric totals),
  logs the count and stops training after `max_nonfinite_steps`.
- `KLWarmup`: `beta = kl_min + (1 - kl_min) * epoch / warmup_epochs`, assigned
  to `model.kl_weight` at the start of every epoch.
- `make_strategy`: `tf.distribute` Mirrored / MultiWorkerMirrored / one
  device, and a split of the CPU into N logical devices (TensorFlow backend).
- `AtomicBackupAndRestore`: `keras.callbacks.BackupAndRestore` made safe
  against a kill at any moment and exact for mid-epoch checkpoints.
- `SampleGrid` and `save_image_grid`: a PNG of samples and reconstructions
  every epoch (a small NumPy PNG writer: PIL is not a dependency).
- `train(...)`: one call that builds, compiles, resumes and trains a zoo
  entry or a model, and writes `model.keras` and `model.weights.h5`.

Multi-device training goes through `tf.distribute` and so needs the
TensorFlow backend; on JAX and PyTorch `train` runs on one device (Keras'
own `keras.distribution` API can be set up by the caller on JAX).

Example:

>>> import numpy as np, tempfile
>>> from keras_avae import training
>>> x = (np.random.rand(16, 8, 8, 1) > 0.5).astype("float32")
>>> model = training.train("mnist-baseline", x, tempfile.mkdtemp(), epochs=1,
...     batch_size=8, config_overrides=dict(image_shape=[8, 8, 1], num_layers=2,
...     preprocess_filters=4, decoder_filters=4, num_scales=1, crop=0),
...     verbose=0)  # doctest: +SKIP
"""

import contextlib
import csv
import importlib.util
import inspect
import json
import math
import os
import pathlib
import struct
import time
import warnings
import zlib

import keras
import numpy as np
from keras import ops
from keras.src.utils import tracking  # noqa: the decorator Keras' own optimizer wrappers use

from keras_avae import zoo

BACKEND = keras.backend.backend()

# ---------------------------------------------------------------------- #
# The recipe
# ---------------------------------------------------------------------- #

#: DESIGN §5, used when `train` gets a model object rather than a zoo name.
REFERENCE_RECIPE = {
    "optimizer": "adamax",
    "learning_rate": 1e-2,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-3,
    "warmup_epochs": 5,
    "initial_learning_rate": 1e-4,
    "min_learning_rate": 1e-4,
    "epochs": 400,
    "restart_epochs": None,
    "kl_warmup_epochs": 16,
    "kl_min": 0.1,
    "batch_size_per_replica": 16,
    "global_clipnorm": None,
    "max_nonfinite_steps": 100,
}

# Keys a zoo entry may leave out take these values: "off", not the
# reference recipe (mnist-gumbel has no KL or learning-rate warm-up).
_NEUTRAL_RECIPE = {
    "optimizer": "adamax",
    "learning_rate": 1e-3,
    "warmup_epochs": 0,
    "initial_learning_rate": None,
    "min_learning_rate": None,
    "epochs": 1,
    "restart_epochs": None,
    "kl_warmup_epochs": 0,
    "kl_min": 1.0,
    "batch_size_per_replica": 16,
    "global_clipnorm": None,
    "max_nonfinite_steps": 100,
}

_OPTIMIZERS = ("adamax", "adam")


def resolve_recipe(name=None, **overrides):
    """The training recipe of zoo entry `name` (or DESIGN §5) with overrides.

    Args:
        name: a zoo entry name, or `None` for `REFERENCE_RECIPE`.
        **overrides: recipe values to change, e.g. `learning_rate=2e-3`.

    Returns:
        A dict with every key `make_optimizer` and `train` read.

    Raises:
        ValueError: for an override key the recipe does not have.

    Example:

    >>> resolve_recipe("mnist-baseline", epochs=3)["epochs"]
    3
    """
    if name is None:
        recipe = dict(REFERENCE_RECIPE)
    else:
        recipe = dict(_NEUTRAL_RECIPE)
        recipe.update(zoo.describe(name)["training"])
    unknown = sorted(set(overrides) - set(recipe))
    if unknown:
        raise ValueError(
            f"Unknown training recipe key(s) {unknown}. Valid keys: {', '.join(sorted(recipe))}. "
            f"Received: {overrides}"
        )
    recipe.update(overrides)
    return recipe


def split_overrides(name, overrides):
    """Routes `key=value` overrides (the CLI's `--set`) to config or recipe.

    Args:
        name: a zoo entry name.
        overrides: dict of overrides.

    Returns:
        `(config_overrides, recipe_overrides)`.

    Raises:
        ValueError: for a key that is neither.

    Example:

    >>> split_overrides("mnist-baseline", {"num_layers": 2, "epochs": 3})
    ({'num_layers': 2}, {'epochs': 3})
    """
    config_keys = set(zoo.describe(name)["config"]) | {"seed", "synchronized_batch_norm", "dtype"}
    recipe_keys = set(resolve_recipe(name))
    config, recipe = {}, {}
    for key, value in overrides.items():
        if key in config_keys:
            config[key] = value
        elif key in recipe_keys:
            recipe[key] = value
        else:
            raise ValueError(
                f"Unknown override {key!r} for zoo entry {name!r}. Model keys: "
                f"{', '.join(sorted(config_keys))}. Training keys: {', '.join(sorted(recipe_keys))}. "
                f"Received: {key}={value!r}"
            )
    return config, recipe


# ---------------------------------------------------------------------- #
# Learning-rate schedule
# ---------------------------------------------------------------------- #


@keras.saving.register_keras_serializable(package="keras_avae")
class WarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then cosine decay to a floor, with one optional restart.

    The schedule of DESIGN §5 (the reference's `CosineWarmup` /
    `CosineRestartWarmup`, evaluated per step instead of per epoch):

    - `step < warmup_steps`: `initial + (peak - initial) * step / warmup_steps`.
    - then cosine: `min + (peak - min) * (1 + cos(pi * t)) / 2`, `t` running
      from 0 to 1 over the cycle, and `min` afterwards.
    - without a restart the one cycle spans `decay_steps` steps after the
      warm-up; with `restart_step`, the first cycle ends at `restart_step`
      (the learning rate jumps back to `peak` there: SGDR's warm restart) and
      the second spans the remaining steps up to `warmup_steps + decay_steps`.

    Args:
        peak_learning_rate: the rate at the end of the warm-up (1e-2).
        warmup_steps: int >= 0, steps of linear warm-up.
        decay_steps: int >= 0, steps of cosine decay after the warm-up.
        initial_learning_rate: rate at step 0 (1e-4). Defaults to
            `min_learning_rate`.
        min_learning_rate: the floor (1e-4). Defaults to `peak_learning_rate`
            (a constant rate after the warm-up).
        restart_step: `None` or the (absolute) step of the warm restart,
            strictly inside the decay phase.
        name: string.

    Call arguments:
        step: the optimizer's iteration count (int or tensor).

    Returns:
        A float32 scalar.

    Example:

    >>> schedule = WarmupCosineDecay(1e-2, warmup_steps=10, decay_steps=90,
    ...     initial_learning_rate=1e-4, min_learning_rate=1e-4)
    >>> [round(float(schedule(s)), 5) for s in (0, 10, 55, 100, 200)]
    [0.0001, 0.01, 0.00505, 0.0001, 0.0001]
    """

    def __init__(
        self,
        peak_learning_rate,
        warmup_steps,
        decay_steps,
        initial_learning_rate=None,
        min_learning_rate=None,
        restart_step=None,
        name="warmup_cosine_decay",
    ):
        super().__init__()
        if min_learning_rate is None:
            min_learning_rate = peak_learning_rate
        if initial_learning_rate is None:
            initial_learning_rate = min_learning_rate
        for arg, value in (
            ("peak_learning_rate", peak_learning_rate),
            ("initial_learning_rate", initial_learning_rate),
            ("min_learning_rate", min_learning_rate),
        ):
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"`{arg}` must be a non-negative float. Received: {arg}={value!r}")
        for arg, value in (("warmup_steps", warmup_steps), ("decay_steps", decay_steps)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`{arg}` must be a non-negative int. Received: {arg}={value!r}")
        if min_learning_rate > peak_learning_rate:
            raise ValueError(
                "`min_learning_rate` must not exceed `peak_learning_rate`. "
                f"Received: min_learning_rate={min_learning_rate}, peak_learning_rate={peak_learning_rate}"
            )
        if restart_step is not None and not (warmup_steps < restart_step < warmup_steps + decay_steps):
            raise ValueError(
                "`restart_step` must lie strictly inside the decay phase "
                f"({warmup_steps}, {warmup_steps + decay_steps}). Received: restart_step={restart_step!r}"
            )
        self.peak_learning_rate = float(peak_learning_rate)
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.initial_learning_rate = float(initial_learning_rate)
        self.min_learning_rate = float(min_learning_rate)
        self.restart_step = None if restart_step is None else int(restart_step)
        self.name = name

    def __call__(self, step):
        step = ops.cast(step, "float32")
        peak, low, start = self.peak_learning_rate, self.min_learning_rate, self.initial_learning_rate
        warmup = float(self.warmup_steps)
        warm = start + (peak - start) * step / max(warmup, 1.0)
        t = step - warmup
        if self.restart_step is None:
            length = ops.convert_to_tensor(float(max(self.decay_steps, 1)))
        else:
            first = float(self.restart_step - self.warmup_steps)
            second = float(self.decay_steps) - first
            in_second = t >= first
            t = ops.where(in_second, t - first, t)
            length = ops.where(in_second, second, first)
        fraction = ops.clip(t / length, 0.0, 1.0)
        cosine = low + 0.5 * (peak - low) * (1.0 + ops.cos(math.pi * fraction))
        return ops.cast(ops.where(step < warmup, warm, cosine), "float32")

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "initial_learning_rate": self.initial_learning_rate,
            "min_learning_rate": self.min_learning_rate,
            "restart_step": self.restart_step,
            "name": self.name,
        }


def make_schedule(recipe, steps_per_epoch, epochs=None):
    """`WarmupCosineDecay` from a recipe (epochs converted to steps).

    The cosine runs from the end of the warm-up to the end of the run
    (`epochs`). `restart_epochs` is the epoch (counted from the start of
    training) at which the learning rate restarts; `None` for no restart. A
    run shorter than the warm-up (a smoke test) stays in the warm-up, and a
    restart outside the run is dropped.

    Example:

    >>> schedule = make_schedule(resolve_recipe(None, epochs=10), steps_per_epoch=100)
    >>> schedule.warmup_steps, schedule.decay_steps
    (500, 500)
    """
    steps_per_epoch = _positive_int("steps_per_epoch", steps_per_epoch)
    epochs = _positive_int("epochs", recipe["epochs"] if epochs is None else epochs)
    warmup_epochs = recipe.get("warmup_epochs") or 0
    if warmup_epochs < 0:
        raise ValueError(f"`warmup_epochs` must be non-negative. Received: warmup_epochs={warmup_epochs!r}")
    warmup_steps = int(round(warmup_epochs * steps_per_epoch))
    decay_steps = max(0, epochs * steps_per_epoch - warmup_steps)
    restart = recipe.get("restart_epochs")
    restart_step = None if restart is None else int(round(restart * steps_per_epoch))
    if restart_step is not None and not warmup_steps < restart_step < warmup_steps + decay_steps:
        restart_step = None
    return WarmupCosineDecay(
        peak_learning_rate=recipe["learning_rate"],
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        initial_learning_rate=recipe.get("initial_learning_rate"),
        min_learning_rate=recipe.get("min_learning_rate"),
        restart_step=restart_step,
    )


def make_optimizer(recipe, steps_per_epoch, epochs=None, guard=True):
    """The recipe's optimizer: Adamax (or Adam) on `make_schedule`'s schedule.

    Args:
        recipe: a dict from `resolve_recipe` (keys `optimizer`,
            `learning_rate`, `beta_1`, `beta_2`, `epsilon`, `warmup_epochs`,
            `initial_learning_rate`, `min_learning_rate`, `restart_epochs`,
            `epochs`, `global_clipnorm`).
        steps_per_epoch: int, optimizer steps per epoch.
        epochs: run length in epochs; defaults to `recipe["epochs"]`.
        guard: wrap the optimizer in `NonFiniteGuard` (default).

    Returns:
        A `NonFiniteGuard` around the optimizer (its `inner_optimizer`), or
        the optimizer itself with `guard=False`.

    Example:

    >>> optimizer = make_optimizer(resolve_recipe(None, epochs=10), 100)
    >>> type(optimizer.inner_optimizer).__name__, optimizer.inner_optimizer.epsilon
    ('Adamax', 0.001)
    """
    kind = recipe.get("optimizer", "adamax")
    if kind not in _OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {_OPTIMIZERS}. Received: optimizer={kind!r}")
    clipnorm = recipe.get("global_clipnorm")
    if clipnorm is not None and not clipnorm > 0:
        raise ValueError(f"`global_clipnorm` must be positive or None. Received: global_clipnorm={clipnorm!r}")
    kwargs = {k: recipe[k] for k in ("beta_1", "beta_2", "epsilon") if recipe.get(k) is not None}
    cls = keras.optimizers.Adamax if kind == "adamax" else keras.optimizers.Adam
    optimizer = cls(
        learning_rate=make_schedule(recipe, steps_per_epoch, epochs),
        global_clipnorm=clipnorm,
        name=kind,
        **kwargs,
    )
    return NonFiniteGuard(optimizer) if guard else optimizer


# ---------------------------------------------------------------------- #
# Non-finite guard
# ---------------------------------------------------------------------- #


@keras.saving.register_keras_serializable(package="keras_avae")
class NonFiniteGuard(keras.optimizers.Optimizer):
    """Skips optimizer steps whose gradients are not all finite, and counts them.

    NVAE-style models fail most often by a NaN or Inf loss (DESIGN §6). This
    wrapper checks `all(isfinite(g))` over every gradient before the inner
    optimizer runs: a bad step changes neither the weights nor the inner
    optimizer's state (moments, iteration count, hence the learning-rate
    step), and adds one to the non-trainable `nonfinite_steps` counter,
    which is saved and restored with the rest of the optimizer. A non-finite
    loss reaches the gradients too (automatic differentiation carries NaN
    and Inf back), so it is caught the same way. The forward pass has run
    by then, so state it updates (batch-norm moving statistics, metric
    totals) is put back by `NonFiniteMonitor`, which also reports the count
    and stops training after too many: use the two together (`train` does).

    It follows Keras' `LossScaleOptimizer` (which makes the same skip for
    float16 overflow): `ops.cond` around the inner `apply`, a stateless path
    for JAX, and under `tf.distribute` the decision is taken on the gradients
    of all replicas together (an all-reduce of the per-replica flags), so
    every replica skips or applies the same step.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to guard.
        name: string.

    Example:

    >>> guard = NonFiniteGuard(keras.optimizers.SGD(0.1))
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=guard, loss="mse")
    >>> _ = model.train_on_batch(np.full((2, 2), np.nan, "float32"), np.zeros((2, 1)))
    >>> int(guard.nonfinite_steps.numpy()), int(guard.iterations.numpy())
    (1, 0)
    """

    def __init__(self, inner_optimizer, name=None, **kwargs):
        if kwargs:
            raise ValueError(
                f"NonFiniteGuard takes no base optimizer arguments; set them on the inner optimizer. "
                f"Received: {sorted(kwargs)}"
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                f"`inner_optimizer` must be a keras.optimizers.Optimizer. Received: inner_optimizer={inner_optimizer!r}"
            )
        super().__init__(learning_rate=0.0, name=name or "nonfinite_guard")
        self.inner_optimizer = inner_optimizer

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self.nonfinite_steps = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="only_first_replica",
            name="nonfinite_steps",
        )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def _counter_index(self):
        return next(i for i, v in enumerate(self._variables) if v is self.nonfinite_steps)

    # --- JAX (stateless) ------------------------------------------------ #
    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise ValueError("NonFiniteGuard must be built before `stateless_apply`: call `build(variables)`.")
        n_own = len(self._variables)
        own, inner = list(optimizer_variables[:n_own]), list(optimizer_variables[n_own:])
        counter = self._counter_index()

        def apply_fn():
            new_trainable, new_inner = self.inner_optimizer.stateless_apply(inner, grads, trainable_variables)
            return list(new_trainable), own + list(new_inner)

        def skip_fn():
            skipped = list(own)
            skipped[counter] = ops.add(own[counter], ops.cast(1, own[counter].dtype))
            return list(trainable_variables), skipped + inner

        return ops.cond(self.check_finite(grads), apply_fn, skip_fn)

    # --- TensorFlow and PyTorch (stateful) ------------------------------ #
    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if BACKEND == "tensorflow":
            self._tf_apply(grads, trainable_variables)
        else:
            self._common_apply(grads, trainable_variables)

    def _skip(self):
        self.nonfinite_steps.assign_add(ops.cast(1, self.nonfinite_steps.dtype))

    def _common_apply(self, grads, trainable_variables=None, finite=None):
        if finite is None:
            finite = self.check_finite(grads)

        def apply_fn():
            self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)

        ops.cond(finite, apply_fn, self._skip)

    def _tf_apply(self, grads, trainable_variables=None):
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("NonFiniteGuard.apply() must be called in a replica context.")
        context = tf.distribute.get_replica_context()
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            finite = self.check_finite(grads)
            if context.num_replicas_in_sync > 1:
                bad = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), "float32"))
                finite = tf.equal(bad, 0.0)
            self._common_apply(grads, trainable_variables, finite=finite)
            return

        def cross_replica(distribution, grads, trainable_variables):
            # Gradients are all-reduced inside the inner optimizer, after
            # this check, so the replicas' flags are combined here.
            bad = distribution.extended.call_for_each_replica(
                lambda g: tf.cast(tf.logical_not(self.check_finite(g)), "float32"), args=(grads,)
            )
            finite = tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, bad, axis=None), 0.0)

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    lambda g, v: self.inner_optimizer.apply(g, trainable_variables=v),
                    args=(grads, trainable_variables),
                )

            # In cross-replica context: a cond in replica context may not
            # hold a branch that calls `merge_call` (the inner apply does).
            ops.cond(finite, apply_fn, self._skip)

        context.merge_call(cross_replica, args=(grads, trainable_variables))

    def check_finite(self, grads):
        flags = [ops.all(ops.isfinite(g)) for g in grads if g is not None]
        return ops.all(ops.convert_to_tensor(flags))

    # --- Delegation ------------------------------------------------------ #
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


class NonFiniteTrainingError(RuntimeError):
    """Raised by `train` when `NonFiniteMonitor` stopped the run.

    Example:

    >>> issubclass(NonFiniteTrainingError, RuntimeError)
    True
    """


def find_guard(optimizer):
    """The `NonFiniteGuard` in a chain of optimizer wrappers, or `None`.

    Example:

    >>> guard = NonFiniteGuard(keras.optimizers.SGD(0.1))
    >>> find_guard(guard) is guard, find_guard(keras.optimizers.SGD(0.1))
    (True, None)
    """
    while optimizer is not None:
        if isinstance(optimizer, NonFiniteGuard):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def _read_optimizer_variable(model, variable):
    """Current value of an optimizer variable, also in the middle of a JAX epoch.

    The JAX trainer keeps the state outside the variables (and purges them)
    between syncs; read it from there rather than forcing a sync.
    """
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True) and state.get("optimizer_variables"):
        index = next(i for i, v in enumerate(model.optimizer.variables) if v is variable)
        return np.asarray(state["optimizer_variables"][index])
    return np.asarray(ops.convert_to_numpy(variable))


class NonFiniteMonitor(keras.callbacks.Callback):
    """Completes `NonFiniteGuard`: undoes a skipped step's forward-pass updates, reports, stops.

    The guard keeps a bad step away from the weights and the optimizer, but
    the forward pass has already run: batch-norm moving statistics and the
    metric totals took the batch's NaN. Before every batch this callback
    keeps a copy of that state (float non-trainable model variables and the
    metric variables; not random-number seeds), and after a skipped batch
    puts it back, so a skipped step leaves no trace but the counter (the
    epoch's metrics then average the finite steps only). Copies are
    references on JAX and device-side reads elsewhere.

    Each skip is reported (epoch, batch, total). When the total exceeds
    `max_nonfinite_steps` training stops (`model.stop_training = True`)
    with a message saying so, kept in `stopped_message`. At the end of each
    epoch it adds `nonfinite_steps`, `learning_rate` and (ELBO models)
    `kl_weight` to the logs, so the CSV history and TensorBoard record them:
    put it before those callbacks, and after callbacks that assign
    variables at batch begin.

    Args:
        max_nonfinite_steps: int >= 0, skipped steps tolerated in the whole
            run (the counter is checkpointed, so a resumed run keeps counting).
        verbose: print each skip.

    Example:

    >>> monitor = NonFiniteMonitor(max_nonfinite_steps=10)
    """

    def __init__(self, max_nonfinite_steps=100, verbose=True):
        super().__init__()
        if not isinstance(max_nonfinite_steps, int) or isinstance(max_nonfinite_steps, bool) or max_nonfinite_steps < 0:
            raise ValueError(
                f"`max_nonfinite_steps` must be a non-negative int. Received: max_nonfinite_steps={max_nonfinite_steps!r}"
            )
        self.max_nonfinite_steps = max_nonfinite_steps
        self.verbose = verbose
        self.stopped_message = None
        self._guard = None
        self._count = 0
        self._epoch = 0
        self._snapshot = None

    def on_train_begin(self, logs=None):
        model = self.model
        self._guard = find_guard(model.optimizer)
        if self._guard is None:
            raise ValueError(
                "NonFiniteMonitor needs the model's optimizer to be (or wrap) a NonFiniteGuard. "
                f"Received: optimizer={model.optimizer!r}"
            )
        if not self._guard.built:
            self._guard.build(model.trainable_variables)
        self._count = int(_read_optimizer_variable(model, self._guard.nonfinite_steps))
        non_trainable = [
            (i, v)
            for i, v in enumerate(model.non_trainable_variables)
            if "float" in str(v.dtype) and "seed_generator_state" not in v.path
        ]
        metrics = list(enumerate(model.metrics_variables))
        self._variables = [v for _, v in non_trainable] + [v for _, v in metrics]
        self._jax_index = [("non_trainable_variables", i) for i, _ in non_trainable] + [
            ("metrics_variables", i) for i, _ in metrics
        ]

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _forward_state(self):
        state = getattr(self.model, "_jax_state", None)
        if state and not getattr(self.model, "_jax_state_synced", True):
            return [state[group][i] for group, i in self._jax_index]
        return [ops.copy(ops.convert_to_tensor(v)) for v in self._variables]

    def on_train_batch_begin(self, batch, logs=None):
        self._snapshot = self._forward_state()

    def on_train_batch_end(self, batch, logs=None):
        count = int(_read_optimizer_variable(self.model, self._guard.nonfinite_steps))
        if count > self._count:
            if self._snapshot is not None:
                if hasattr(self.model, "jax_state_sync"):
                    self.model.jax_state_sync()  # the next step re-reads the variables
                for variable, value in zip(self._variables, self._snapshot):
                    variable.assign(value)
            if self.verbose:
                print(
                    f"\nNonFiniteGuard: skipped a training step with a non-finite loss or gradient "
                    f"(epoch {self._epoch + 1}, batch {batch + 1}); {count} skipped so far "
                    f"(limit max_nonfinite_steps={self.max_nonfinite_steps})."
                )
        self._count = count
        if count > self.max_nonfinite_steps and self.stopped_message is None:
            self.stopped_message = (
                f"Training stopped: {count} steps had a non-finite loss or gradient, more than "
                f"max_nonfinite_steps={self.max_nonfinite_steps} (epoch {self._epoch + 1}, batch {batch + 1}). "
                "Skipped steps changed nothing, so the weights are those of the last finite step. "
                "Lower the learning rate, set global_clipnorm, or check the data for NaN/Inf."
            )
            print("\n" + self.stopped_message)
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs["nonfinite_steps"] = self._count
        optimizer = self.model.optimizer
        step = _read_optimizer_variable(self.model, optimizer.iterations)
        logs["learning_rate"] = float(_learning_rate_at(optimizer, step))
        if hasattr(self.model, "kl_weight"):
            logs["kl_weight"] = float(ops.convert_to_numpy(self.model.kl_weight))


def _learning_rate_at(optimizer, step):
    inner = optimizer
    while getattr(inner, "inner_optimizer", None) is not None:
        inner = inner.inner_optimizer
    rate = inner._learning_rate
    if callable(rate):
        return ops.convert_to_numpy(rate(step))
    return ops.convert_to_numpy(rate)


# ---------------------------------------------------------------------- #
# KL warm-up
# ---------------------------------------------------------------------- #


class KLWarmup(keras.callbacks.Callback):
    """Per-epoch KL warm-up: `beta = kl_min + (1 - kl_min) * epoch / warmup_epochs`.

    Assigned to `model.kl_weight` at the start of every epoch (epochs counted
    from 0, so the first epoch trains with `kl_min`; beta is 1 from epoch
    `warmup_epochs` on). The value is a function of the epoch alone, so a run
    resumed at the right epoch has the right coefficient (and the variable is
    checkpointed with the model anyway). The reference: 0.1 + 0.9 epoch / 16.

    Args:
        warmup_epochs: int >= 0; 0 disables the warm-up (beta = 1).
        kl_min: beta at epoch 0, in [0, 1].

    Example:

    >>> [KLWarmup(16, 0.1).beta(e) for e in (0, 8, 16, 20)]
    [0.1, 0.55, 1.0, 1.0]
    """

    def __init__(self, warmup_epochs=16, kl_min=0.1):
        super().__init__()
        if not isinstance(warmup_epochs, int) or isinstance(warmup_epochs, bool) or warmup_epochs < 0:
            raise ValueError(f"`warmup_epochs` must be a non-negative int. Received: warmup_epochs={warmup_epochs!r}")
        if not 0.0 <= kl_min <= 1.0:
            raise ValueError(f"`kl_min` must be in [0, 1]. Received: kl_min={kl_min!r}")
        self.warmup_epochs = warmup_epochs
        self.kl_min = float(kl_min)

    def beta(self, epoch):
        if self.warmup_epochs == 0:
            return 1.0
        return round(min(1.0, self.kl_min + (1.0 - self.kl_min) * epoch / self.warmup_epochs), 12)

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self.model, "kl_weight"):
            raise ValueError(f"KLWarmup needs a model with a `kl_weight` variable. Received: {type(self.model).__name__}")
        self.model.kl_weight.assign(self.beta(epoch))


# ---------------------------------------------------------------------- #
# Strategies
# ---------------------------------------------------------------------- #

STRATEGIES = ("auto", "mirrored", "multi-worker", "one-device")


def make_strategy(kind="auto", cpu_devices=None):
    """A `tf.distribute` strategy (TensorFlow backend).

    - `"auto"`: `MultiWorkerMirroredStrategy` when `TF_CONFIG` is set, else
      `MirroredStrategy` when more than one GPU is visible (or
      `cpu_devices > 1`), else the default (single-device) strategy.
    - `"mirrored"`: `MirroredStrategy` over all visible GPUs, or over the
      logical CPU devices when there is no GPU.
    - `"multi-worker"`: `MultiWorkerMirroredStrategy` from `TF_CONFIG`
      (every local GPU of each worker, or its CPU).
    - `"one-device"`: `OneDeviceStrategy` on the first GPU, else the CPU.

    Build and compile models inside `strategy.scope()` (`train` does).
    The global batch is the per-replica batch times
    `strategy.num_replicas_in_sync`.

    Args:
        kind: one of `STRATEGIES`.
        cpu_devices: `None` or int N >= 1: split the CPU into N logical
            devices, so that `MirroredStrategy` runs (and is tested) without
            GPUs. TensorFlow fixes its devices when it initialises (at the
            first op, tensor, variable or dataset), so call this first
            thing in the program; later it raises a `RuntimeError` unless the
            split is already in place.

    Returns:
        A `tf.distribute.Strategy`; on the JAX and PyTorch backends `None`
        for `"auto"` and `"one-device"`.

    Raises:
        ValueError: for an unknown `kind`, or a multi-device kind on a
            backend other than TensorFlow.
        RuntimeError: when the CPU split or the multi-worker strategy comes
            after TensorFlow initialised.

    Example:

    >>> strategy = make_strategy("one-device")  # doctest: +SKIP
    """
    if kind not in STRATEGIES:
        raise ValueError(f"`kind` must be one of {STRATEGIES}. Received: kind={kind!r}")
    if cpu_devices is not None and (not isinstance(cpu_devices, int) or isinstance(cpu_devices, bool) or cpu_devices < 1):
        raise ValueError(f"`cpu_devices` must be a positive int or None. Received: cpu_devices={cpu_devices!r}")
    if BACKEND != "tensorflow":
        if kind in ("mirrored", "multi-worker") or (cpu_devices or 1) > 1:
            raise ValueError(
                "tf.distribute strategies need the TensorFlow backend (KERAS_BACKEND=tensorflow); "
                f"on {BACKEND} use keras.distribution (e.g. DataParallel) instead. "
                f"Received: kind={kind!r}, cpu_devices={cpu_devices!r}"
            )
        return None
    import tensorflow as tf

    if kind == "multi-worker" and (cpu_devices or 1) > 1:
        raise ValueError(
            "MultiWorkerMirroredStrategy uses one CPU device per worker; start more workers instead. "
            f"Received: kind='multi-worker', cpu_devices={cpu_devices}"
        )
    if cpu_devices is not None:
        split_cpu(cpu_devices)
    gpus = tf.config.list_physical_devices("GPU")
    if kind == "auto":
        if os.environ.get("TF_CONFIG"):
            kind = "multi-worker"
        elif len(gpus) > 1 or (cpu_devices or 1) > 1:
            kind = "mirrored"
        else:
            return tf.distribute.get_strategy()
    if kind == "multi-worker":
        if not os.environ.get("TF_CONFIG"):
            warnings.warn("kind='multi-worker' without TF_CONFIG: a single worker is used.", stacklevel=2)
        try:
            return tf.distribute.MultiWorkerMirroredStrategy()
        except (RuntimeError, ValueError) as error:
            raise RuntimeError(
                "Could not create MultiWorkerMirroredStrategy; it must be created first thing in the "
                f"program, before any TensorFlow op runs, with a valid TF_CONFIG: {error}"
            ) from error
    if kind == "mirrored":
        if gpus:
            return tf.distribute.MirroredStrategy()
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return tf.distribute.MirroredStrategy(devices=cpus)
    device = "/gpu:0" if gpus else "/cpu:0"
    return tf.distribute.OneDeviceStrategy(device)


def split_cpu(num_devices):
    """Splits the first physical CPU into `num_devices` logical devices (TensorFlow).

    Must run before TensorFlow initialises; a repeated call with the number
    already in place is a no-op.

    Raises:
        RuntimeError: TensorFlow already initialised with another number.

    Example (first thing in a fresh program, so not run by the doctests,
    whose TensorFlow is already initialised; `tests/test_training.py` runs
    it in a subprocess):

    >>> split_cpu(2)  # doctest: +SKIP
    >>> strategy = make_strategy("mirrored")  # doctest: +SKIP
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError as error:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing == num_devices:
            return
        raise RuntimeError(
            f"Cannot split the CPU into {num_devices} logical devices: TensorFlow already initialised "
            f"with {existing}. Call make_strategy(cpu_devices=N) (or the CLI's --cpu-devices) before "
            f"anything creates a TensorFlow tensor, model or dataset. Received: cpu_devices={num_devices}"
        ) from error


def num_replicas(strategy=None):
    """Replicas in sync under `strategy` (1 without one, or off TensorFlow).

    Example:

    >>> num_replicas(None)
    1
    """
    if strategy is None or BACKEND != "tensorflow":
        return 1
    return strategy.num_replicas_in_sync


def is_chief(strategy=None):
    """Whether this process writes checkpoints, logs and images.

    Every process of a single-machine run; under `MultiWorkerMirroredStrategy`
    only the chief (task `chief`, else worker 0).

    Example:

    >>> is_chief(None)
    True
    """
    if strategy is None or BACKEND != "tensorflow":
        return True
    return bool(strategy.extended.should_checkpoint)


def _is_multi_worker(strategy):
    if strategy is None or BACKEND != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


@contextlib.contextmanager
def _multi_worker_log_reduction(strategy):
    """Works around Keras 3.15's multi-worker `fit` (tensorflow/tensorflow#72388).

    Keras reduces the per-step logs of a multi-worker run with
    `strategy.reduce("MEAN", value, axis=0)`, which fails on every scalar
    metric ("Invalid reduction dimension 0 for input with 0 dimensions"), so
    `fit` under `MultiWorkerMirroredStrategy` cannot run at all. While `fit`
    runs (the step function is traced then), this reduces each scalar with
    `axis=None`, the mean over replicas that was meant.
    """
    if not _is_multi_worker(strategy):
        yield
        return
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


def _model_strategy(model):
    if BACKEND != "tensorflow":
        return None
    return getattr(model, "distribute_strategy", None)


# ---------------------------------------------------------------------- #
# Atomic files
# ---------------------------------------------------------------------- #


def _fsync(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path, write, suffix):
    """Writes `path` by `write(tmp)` then a rename: readers see old or new, never half.

    `suffix` is the extension Keras insists on (the temporary name keeps it).
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name[: -len(suffix)]}{suffix}")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync(path.parent)


def _atomic_write_text(path, text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    _atomic_write(path, write, pathlib.Path(path).suffix)


# ---------------------------------------------------------------------- #
# Checkpoints
# ---------------------------------------------------------------------- #


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` that survives a kill at any moment and resumes exactly.

    Keras' callback writes `latest.weights.h5` in place and then a separate
    metadata file: a SIGKILL while the weights are written leaves a
    truncated file, and one between the two writes pairs new weights with an
    old epoch. Its step-level saves record the batch but resume at the start
    of the epoch, so the steps of that epoch are trained twice and the
    optimizer's iteration count (hence the learning-rate step) overshoots.
    Here:

    - each checkpoint is a new `ckpt-e<epoch>-s<step>.weights.h5` (model
      weights, the KL coefficient and every other model variable, and the
      optimizer state: moments, iteration count, skipped-step counter),
      written to a temporary name, fsynced and renamed; then
      `checkpoint.json` (epoch, step within the epoch, iteration count) is
      replaced atomically. That rename is the commit point: a kill anywhere
      leaves either the previous checkpoint or the new one, complete.
    - `restore()` loads the committed checkpoint and checks that the
      optimizer's iteration count matches (a silently skipped optimizer
      state is an error, not a warning).
    - it saves every `save_freq` steps (if an int) and at every epoch end;
      an epoch cut short (`stop_training`) is recorded as unfinished.
      `train` resumes a mid-epoch checkpoint with the remaining steps of that
      epoch; as a plain `fit` callback the unfinished epoch restarts from its
      beginning (as in Keras).
    - only the chief writes (`MultiWorkerMirroredStrategy`); every worker
      reads the chief's checkpoint, so `backup_dir` must be on a file system
      all workers see (as in Keras and tf.keras).
    - the last checkpoint is kept by default (`delete_checkpoint=False`):
      running a finished command again does nothing new, and a larger
      `epochs` continues the run.

    Args:
        backup_dir: directory of the checkpoints; nothing else may write there.
        save_freq: `"epoch"` or a positive int (steps between saves).
        delete_checkpoint: remove `backup_dir` at the end of training.
        steps_per_epoch: steps of a full epoch, to tell a finished epoch
            from an interrupted one (`train` sets it; else `fit`'s steps).

    Example:

    >>> backup = AtomicBackupAndRestore("/tmp/run/backup", save_freq=100)
    """

    POINTER = "checkpoint.json"

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=False, steps_per_epoch=None):
        if not (save_freq == "epoch" or (isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0)):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive int. Received: save_freq={save_freq!r}")
        super().__init__(str(backup_dir), save_freq=save_freq, delete_checkpoint=delete_checkpoint)
        self.backup_dir = pathlib.Path(backup_dir)
        self.steps_per_epoch = steps_per_epoch
        self.step_offset = 0
        self._restored = False
        self._epoch = 0
        self._epoch_offset = 0
        self._steps_done = 0
        self._since_save = 0

    # --- reading -------------------------------------------------------- #
    def read_state(self):
        """The committed checkpoint's metadata (a dict), or `None`."""
        pointer = self.backup_dir / self.POINTER
        if not pointer.exists():
            return None
        try:
            with open(pointer) as f:
                state = json.load(f)
        except (OSError, ValueError) as error:
            raise RuntimeError(f"Unreadable checkpoint pointer {pointer}: {error}") from error
        if not (self.backup_dir / state["weights"]).is_file():
            raise RuntimeError(f"Checkpoint {pointer} names {state['weights']}, which is missing from {self.backup_dir}.")
        return state

    def restore(self, model=None):
        """Loads the committed checkpoint into `model`; returns its metadata or `None`."""
        model = model or self.model
        self._restored = True
        state = self.read_state()
        if state is None:
            return None
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        path = self.backup_dir / state["weights"]
        try:
            model.load_weights(str(path))
        except Exception as error:  # h5py and Keras raise many kinds.
            raise RuntimeError(
                f"Could not restore checkpoint {path} (another model or recipe in this output "
                f"directory?): {error}"
            ) from error
        if model.optimizer is not None:
            iterations = int(ops.convert_to_numpy(model.optimizer.iterations))
            if iterations != state["iterations"]:
                raise RuntimeError(
                    f"Checkpoint {path} restored the weights but not the optimizer state "
                    f"(iterations {iterations}, expected {state['iterations']}): the optimizer "
                    "differs from the one that wrote it."
                )
        return state

    def on_train_begin(self, logs=None):
        if not self._restored:
            state = self.restore()
            if state is not None:
                self.model._initial_epoch = state["epoch"]
        self._since_save = 0

    # --- writing -------------------------------------------------------- #
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_offset = self.step_offset
        self._steps_done = self.step_offset
        self.step_offset = 0

    def on_train_batch_end(self, batch, logs=None):
        done = self._epoch_offset + batch + 1
        self._since_save += done - self._steps_done
        self._steps_done = done
        if self.save_freq != "epoch" and self._since_save >= self.save_freq:
            self._save(self._epoch, self._steps_done)

    def on_epoch_end(self, epoch, logs=None):
        full = self.steps_per_epoch or (self.params or {}).get("steps")
        if full is None:
            finished = not self.model.stop_training
        else:
            finished = self._steps_done >= full
        if finished:
            self._save(epoch + 1, 0)
        else:
            self._save(epoch, self._steps_done)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and is_chief(_model_strategy(self.model)) and self.backup_dir.exists():
            import shutil

            shutil.rmtree(self.backup_dir)

    def _save(self, epoch, step):
        self._since_save = 0
        if not is_chief(_model_strategy(self.model)):
            return
        model = self.model
        if hasattr(model, "jax_state_sync"):
            model.jax_state_sync()
        self.backup_dir.mkdir(parents=True, exist_ok=True)
        name = f"ckpt-e{epoch:06d}-s{step:08d}.weights.h5"
        _atomic_write(self.backup_dir / name, lambda tmp: model.save_weights(str(tmp)), ".weights.h5")
        state = {
            "format": 1,
            "weights": name,
            "epoch": epoch,
            "step": step,
            "iterations": int(ops.convert_to_numpy(model.optimizer.iterations)) if model.optimizer else 0,
            "steps_per_epoch": self.steps_per_epoch,
            "saved_at": time.time(),
        }
        _atomic_write_text(self.backup_dir / self.POINTER, json.dumps(state, indent=1))
        for stale in self.backup_dir.glob("*.weights.h5"):
            if stale.name != name:
                stale.unlink(missing_ok=True)

    # Keras' private hooks, kept consistent for anyone calling them.
    def _save_model(self):
        self._save(self._epoch, self._steps_done)

    def _load_model(self):
        self.restore()


# ---------------------------------------------------------------------- #
# PNG grids
# ---------------------------------------------------------------------- #


def encode_png(image):
    """PNG bytes of a uint8 image `(H, W)`, `(H, W, 1)` or `(H, W, 3)` (zlib + struct).

    Example:

    >>> encode_png(np.zeros((2, 3), "uint8"))[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"`image` must be uint8. Received: image.dtype={image.dtype}")
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    if image.ndim == 2:
        color = 0
    elif image.ndim == 3 and image.shape[-1] == 3:
        color = 2
    else:
        raise ValueError(f"`image` must be (H, W), (H, W, 1) or (H, W, 3). Received: image.shape={image.shape}")
    height, width = image.shape[:2]
    rows = np.ascontiguousarray(image).reshape(height, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def image_grid(rows, padding=1, value_range=(0.0, 1.0)):
    """Tiles rows of images `[(N, H, W, C), ...]` into one uint8 image.

    Values are mapped from `value_range` to 0-255 and clipped.

    Example:

    >>> image_grid([np.zeros((2, 4, 4, 1))], padding=1).shape  # 1 row of 2
    (6, 11, 1)
    """
    rows = [np.asarray(ops.convert_to_numpy(r), dtype="float32") for r in rows]
    low, high = value_range
    columns = max(len(r) for r in rows)
    _, h, w, c = rows[0].shape
    grid = np.full((len(rows) * (h + padding) + padding, columns * (w + padding) + padding, c), 255, "uint8")
    for i, row in enumerate(rows):
        scaled = np.clip((row - low) / (high - low), 0.0, 1.0)
        scaled = np.nan_to_num(scaled, nan=0.0)
        for j, image in enumerate(scaled):
            top, left = padding + i * (h + padding), padding + j * (w + padding)
            grid[top : top + h, left : left + w] = np.round(image * 255.0).astype("uint8")
    return grid


def save_image_grid(path, rows, padding=1, value_range=(0.0, 1.0)):
    """Writes `image_grid(rows)` as a PNG file (atomically).

    Args:
        path: the `.png` file.
        rows: list of image batches `(N, H, W, C)`, C = 1 or 3, one grid row each.
        padding: white pixels between images.
        value_range: `(low, high)` of the pixel values.

    Example:

    >>> save_image_grid("/tmp/grid.png", [np.random.rand(4, 8, 8, 1)])  # doctest: +SKIP
    """
    data = encode_png(image_grid(rows, padding=padding, value_range=value_range))

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    _atomic_write(path, write, ".png")


def _seed_states(model):
    return [v for v in model.non_trainable_variables if "seed_generator_state" in v.path]


class SampleGrid(keras.callbacks.Callback):
    """Writes `epoch_NNNN.png` every epoch: samples, and images with their reconstructions.

    Row 1: `model.sample(num_samples)` (the mean of p(x|z) at the given
    temperature); with `images`, row 2 the images and row 3
    `model.reconstruct(images)`. Random-number states are restored
    afterwards, so the grid does not change the training run. Epochs are
    numbered from 1 as in Keras' progress bar. Only the chief writes.

    Args:
        directory: where the PNGs go.
        images: `None` or a batch of images to reconstruct.
        num_samples: samples per grid.
        temperature: prior temperature for `HierarchicalVAE.sample`.
        every: write every `every` epochs.

    Example:

    >>> grid = SampleGrid("/tmp/run/samples", num_samples=8)
    """

    def __init__(self, directory, images=None, num_samples=8, temperature=1.0, every=1):
        super().__init__()
        self.directory = pathlib.Path(directory)
        self.images = None if images is None else np.asarray(images)
        self.num_samples = num_samples
        self.temperature = temperature
        self.every = every

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every or not is_chief(_model_strategy(self.model)):
            return
        model = self.model
        states = _seed_states(model)
        saved = [np.array(ops.convert_to_numpy(v)) for v in states]
        try:
            if self.temperature != 1.0:
                rows = [model.sample(self.num_samples, temperature=self.temperature)]
            else:
                rows = [model.sample(self.num_samples)]
            if self.images is not None:
                rows += [self.images, model.reconstruct(self.images)]
        finally:
            for v, value in zip(states, saved):
                v.assign(value)
        self.directory.mkdir(parents=True, exist_ok=True)
        value_range = getattr(model, "pixel_range", (0.0, 1.0))
        save_image_grid(self.directory / f"epoch_{epoch + 1:04d}.png", rows, value_range=value_range)


class _ResumableGumbelSchedule(keras.callbacks.Callback):
    """`GumbelTemperatureSchedule` whose step count starts at the optimizer's on resume."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def set_model(self, model):
        super().set_model(model)
        self.schedule.set_model(model)

    def on_train_begin(self, logs=None):
        self.schedule._step = int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_begin(self, batch, logs=None):
        self.schedule.on_train_batch_begin(batch, logs)


# ---------------------------------------------------------------------- #
# train()
# ---------------------------------------------------------------------- #


def _positive_int(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
    return int(value)


def _first_images(data, n):
    """Up to `n` images from a dataset, an array, or an `(x, ...)` tuple."""
    if data is None:
        return None
    if isinstance(data, (tuple, list)):
        data = data[0]
    if isinstance(data, np.ndarray) or hasattr(data, "__array__") and not hasattr(data, "take"):
        return np.asarray(data[:n])
    if hasattr(data, "take"):  # tf.data.Dataset
        batch = next(iter(data.take(1)))
        if isinstance(batch, (tuple, list)):
            batch = batch[0]
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        return np.asarray(batch)[:n]
    return None


def _infer_steps_per_epoch(dataset, steps_per_epoch, batch_size):
    if steps_per_epoch is not None:
        return _positive_int("steps_per_epoch", steps_per_epoch)
    if isinstance(dataset, np.ndarray):
        return max(1, math.ceil(len(dataset) / batch_size))
    if hasattr(dataset, "cardinality"):
        cardinality = int(dataset.cardinality())
        if cardinality > 0:
            return cardinality
    raise ValueError(
        "`steps_per_epoch` is needed for a dataset of unknown or infinite length "
        f"(the learning-rate schedule and checkpoints count steps). Received: steps_per_epoch=None"
    )


def _build_model(model, strategy, config_overrides, recorded_feature_seed=None):
    """A built model from a zoo name, a model, or a zero-argument factory."""
    replicas = num_replicas(strategy)
    if isinstance(model, str):
        entry = zoo.describe(model)
        overrides = dict(config_overrides or {})
        sync = overrides.pop("synchronized_batch_norm", None)
        config = zoo.config(model, **overrides)
        if "nonlocal_feature_seed" in config and config["nonlocal_feature_seed"] is None:
            # Every worker, and every resume, must draw the same random
            # features: a seed resolved at random in each process would not.
            if recorded_feature_seed is not None:
                config["nonlocal_feature_seed"] = recorded_feature_seed
            else:
                config["nonlocal_feature_seed"] = config.get("seed") or 0
        family = zoo._FAMILIES[entry["family"]]
        accepts_sync = "synchronized_batch_norm" in inspect.signature(family.__init__).parameters
        if sync is None:
            # DESIGN §6: batch-norm statistics over the global batch. Only
            # `tf.distribute` replicas keep separate statistics.
            sync = accepts_sync and BACKEND == "tensorflow" and replicas > 1
        if sync and not accepts_sync:
            raise ValueError(
                f"Zoo entry {model!r} ({family.__name__}) has no batch norm to synchronise. "
                "Received: synchronized_batch_norm=True"
            )
        if accepts_sync:
            config["synchronized_batch_norm"] = bool(sync)
        built = family(**config)
        built.build()
        return built
    if config_overrides:
        raise ValueError(
            "`config_overrides` apply to zoo names only; configure a model object yourself. "
            f"Received: config_overrides={config_overrides}"
        )
    if not isinstance(model, keras.Model) and callable(model):
        model = model()
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"`model` must be a zoo name, a keras.Model or a function returning one. Received: model={model!r}"
        )
    if not model.built:
        model.build()
    if replicas > 1:
        import tensorflow as tf

        variable = model.weights[0].value
        if not isinstance(variable, tf.distribute.DistributedValues):
            raise ValueError(
                "A model trained under a multi-replica strategy must be created inside "
                "`strategy.scope()`; pass a zoo name or a function that builds the model instead."
            )
    return model


def _truncate_history(path, epoch):
    """Keeps the CSV rows of epochs before `epoch` (those the checkpoint holds)."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    header, body = rows[0], rows[1:]
    column = header.index("epoch") if "epoch" in header else None
    kept = [r for r in body if column is None or (len(r) > column and r[column] and int(float(r[column])) < epoch)]
    if len(kept) == len(body):
        return

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows([header] + kept)

    _atomic_write(path, write, ".csv")


def compile_mode(model):
    """How a compiled model's training step runs, in words (for logs and cards).

    Keras's `jit_compile="auto"` uses XLA on TensorFlow only when an
    accelerator is visible and no `tf.distribute` strategy is in use: on a
    CPU, XLA's convolutions are 2-3x slower than oneDNN's graph kernels.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(loss="mse", jit_compile=False)
    >>> compile_mode(model).startswith(keras.backend.backend())
    True
    """
    devices = "GPU" if _gpu_visible() else "CPU"
    if BACKEND == "jax":
        return f"jax, jax.jit (XLA) on {devices}"
    if BACKEND == "torch":
        return f"torch, {'torch.compile' if model.jit_compile else 'eager'} on {devices}"
    return f"tensorflow, tf.function graph {'with' if model.jit_compile else 'without'} XLA on {devices}"


def _gpu_visible():
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    if BACKEND == "jax":
        import jax

        return jax.default_backend() == "gpu"
    if BACKEND == "torch":
        import torch

        return torch.cuda.is_available()
    return False


def _recorded_feature_seed(path):
    """The `nonlocal_feature_seed` a run folder's `run.json` records, if any."""
    try:
        with open(path) as f:
            return json.load(f)["config"].get("nonlocal_feature_seed")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_run_record(path, record):
    """Refuses to resume a run directory with another model or recipe."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    with open(path) as f:
        previous = json.load(f)
    # The device count may change between runs (it only sets the
    # synchronisation of batch norm); the model, recipe and step count may not.
    def comparable(run, key):
        value = _jsonable(run[key])
        if key == "config":
            value = {k: v for k, v in value.items() if k != "synchronized_batch_norm"}
        return value

    keys = ("model", "config", "recipe", "steps_per_epoch")
    changed = [k for k in keys if k in previous and comparable(previous, k) != comparable(record, k)]
    if changed:
        details = "; ".join(f"{k}: {previous[k]!r} -> {record[k]!r}" for k in changed)
        raise ValueError(
            f"{path.parent} holds a run with other settings ({details}). Use a new output directory, "
            "or the same settings to resume it."
        )


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def _save_final(model, output_dir, portable):
    """`model.keras` (with the optimizer: to train further) and `model.weights.h5`.

    The `.weights.h5` file holds the model's weights only, written from an
    uncompiled copy: Keras would otherwise add the optimizer's slots (three
    times the size), and it is the file `zoo.load(name, weights=...)`,
    `keras-avae evaluate` and the shipped zoo weights use. Synchronised batch
    norm exists only on TensorFlow, so a model trained with it is saved from
    an unsynchronised copy (`portable`) that loads on every backend.
    """
    copy = None
    try:
        config = model.get_config()
        if portable:
            config = dict(config, synchronized_batch_norm=False)
        copy = type(model).from_config(config)
        copy.build()
        copy.set_weights(model.get_weights())
    except (TypeError, ValueError, NotImplementedError):
        if portable:
            raise
        copy = None  # a user model without a config round trip: save as is
    final = copy if portable else model
    _atomic_write(output_dir / "model.keras", lambda tmp: final.save(str(tmp)), ".keras")
    weights = copy if copy is not None else model
    _atomic_write(output_dir / "model.weights.h5", lambda tmp: weights.save_weights(str(tmp)), ".weights.h5")


def train(
    model,
    dataset,
    output_dir,
    epochs=None,
    steps_per_epoch=None,
    strategy=None,
    validation_data=None,
    *,
    validation_steps=None,
    batch_size=None,
    config_overrides=None,
    save_freq="epoch",
    num_images=8,
    tensorboard=True,
    callbacks=None,
    verbose="auto",
    jit_compile="auto",
    **recipe_overrides,
):
    """Trains a zoo entry (or a model), resumably, and saves it.

    One call behind `keras-avae train`. Inside `strategy.scope()` it builds
    the model (`synchronized_batch_norm=True` for zoo entries under a
    multi-replica TensorFlow strategy), compiles it with `make_optimizer`
    (Adamax, warm-up + cosine, `NonFiniteGuard`), restores the last
    checkpoint in `output_dir/backup` if there is one, and calls `fit` with:

    - `NonFiniteMonitor` (skipped steps; stop after `max_nonfinite_steps`),
    - `KLWarmup` (ELBO models), the Gumbel temperature schedule for
      `mnist-gumbel`,
    - `CSVLogger(output_dir/"history.csv", append=True)`, truncated on resume
      to the epochs the checkpoint holds,
    - `TensorBoard(output_dir/"logs")`,
    - `SampleGrid(output_dir/"samples")` (a PNG per epoch),
    - `AtomicBackupAndRestore(output_dir/"backup", save_freq)`.

    A run killed at any moment (SIGKILL included) and started again with the
    same call resumes from its last checkpoint with weights, optimizer state,
    epoch and step (an interrupted epoch continues with its remaining
    steps), KL coefficient and learning-rate step. At the end it writes
    `model.keras` and `model.weights.h5` (atomically; the checkpoint stays, so
    calling again is a no-op and a larger `epochs` continues the run, the
    cosine stretched to the new length). After
    a run with synchronised batch norm both files come from a copy without
    it and without optimizer state, so they load on every backend (the
    checkpoint keeps the optimizer state).
    `run.json` records the settings; resuming with another model or recipe
    is refused. Under `MultiWorkerMirroredStrategy` only the chief writes.

    Args:
        model: a zoo name, a `keras.Model` (created under `strategy.scope()`
            when the strategy has several replicas), or a function returning
            one.
        dataset: a batched `tf.data.Dataset` of images (global batches), or a
            NumPy array of images (then `batch_size` applies).
        output_dir: the run directory.
        epochs: total epochs; defaults to the recipe's.
        steps_per_epoch: steps per epoch; inferred for finite inputs.
        strategy: a `tf.distribute.Strategy` (`make_strategy`), or `None`.
        validation_data: optional held-out images (dataset or array).
        validation_steps: steps of validation per epoch.
        batch_size: global batch for array inputs; defaults to the recipe's
            `batch_size_per_replica` times the replicas.
        config_overrides: architecture overrides for a zoo name.
        save_freq: `"epoch"` or an int: checkpoint every N steps (and at
            every epoch end).
        num_images: images per row of the PNG grid; 0 disables the grid.
        tensorboard: write TensorBoard logs (needs the `tensorboard`
            package; skipped with a warning without it).
        callbacks: extra Keras callbacks.
        verbose: `fit`'s verbosity.
        jit_compile: passed to `compile`.
        **recipe_overrides: training recipe values (see `resolve_recipe`),
            e.g. `learning_rate=2e-3`, `global_clipnorm=200.0`,
            `max_nonfinite_steps=10`.

    Returns:
        The trained model.

    Raises:
        ValueError: for invalid arguments, or an output directory holding
            a run with other settings.
        NonFiniteTrainingError: when more than `max_nonfinite_steps` steps
            were skipped (the checkpoint holds the last finite state).

    Example (a tiny model on random 8x8 images; the same call again with
    the same folder resumes, here it finds the run complete):

    >>> import tempfile
    >>> x = (np.random.rand(16, 8, 8, 1) > 0.5).astype("float32")
    >>> tiny = dict(image_shape=[8, 8, 1], num_layers=2, preprocess_filters=4,
    ...     decoder_filters=4, num_scales=1, crop=0)
    >>> out = tempfile.mkdtemp()
    >>> model = train("mnist-baseline", x, out, epochs=1, batch_size=8,
    ...     config_overrides=tiny, verbose=0, jit_compile=False, tensorboard=False)
    >>> int(ops.convert_to_numpy(model.optimizer.iterations)), sorted(p.name for p in pathlib.Path(out).glob("model.*"))
    (2, ['model.keras', 'model.weights.h5'])
    """
    output_dir = pathlib.Path(output_dir)
    name = model if isinstance(model, str) else None
    recipe = resolve_recipe(name, **recipe_overrides)
    epochs = _positive_int("epochs", recipe["epochs"] if epochs is None else epochs)
    replicas = num_replicas(strategy)
    chief = is_chief(strategy)
    if batch_size is None:
        batch_size = recipe["batch_size_per_replica"] * replicas
    batch_size = _positive_int("batch_size", batch_size)
    steps_per_epoch = _infer_steps_per_epoch(dataset, steps_per_epoch, batch_size)
    if chief:
        output_dir.mkdir(parents=True, exist_ok=True)

    scope = strategy.scope() if strategy is not None and BACKEND == "tensorflow" else contextlib.nullcontext()
    with scope:
        model = _build_model(model, strategy, config_overrides, _recorded_feature_seed(output_dir / "run.json"))
        optimizer = make_optimizer(recipe, steps_per_epoch, epochs)
        model.compile(optimizer=optimizer, jit_compile=jit_compile)
        optimizer.build(model.trainable_variables)
        backup = AtomicBackupAndRestore(output_dir / "backup", save_freq=save_freq, steps_per_epoch=steps_per_epoch)
        record = {
            "model": name or type(model).__name__,
            "config": {k: v for k, v in model.get_config().items() if k != "name"},
            "recipe": recipe,
            "epochs": epochs,
            "steps_per_epoch": steps_per_epoch,
            "batch_size": batch_size,
            "replicas": replicas,
            "backend": BACKEND,
            "compile_mode": compile_mode(model),
        }
        _check_run_record(output_dir / "run.json", record)
        state = backup.restore(model)
    if chief:
        _atomic_write_text(output_dir / "run.json", json.dumps(_jsonable(record), indent=1))

    epoch, step = (state["epoch"], state["step"]) if state else (0, 0)
    if verbose:
        print(f"Training step: {record['compile_mode']}.")
    if state and verbose:
        print(
            f"Resuming from {output_dir / 'backup'}: epoch {epoch + 1} of {epochs}, step {step} of "
            f"{steps_per_epoch} ({state['iterations']} optimizer steps done)."
        )
    if chief:
        # Rows of epochs the checkpoint does not hold (a kill between the
        # CSV row and the checkpoint) would be written twice.
        _truncate_history(output_dir / "history.csv", epoch)

    monitor = NonFiniteMonitor(recipe["max_nonfinite_steps"])
    run_callbacks = []
    if hasattr(model, "kl_weight"):
        run_callbacks.append(KLWarmup(recipe.get("kl_warmup_epochs") or 0, recipe.get("kl_min", 1.0)))
    if recipe.get("temperature_schedule") and hasattr(model, "temperature"):
        from keras_avae.models.discrete_vae import GumbelTemperatureSchedule

        run_callbacks.append(_ResumableGumbelSchedule(GumbelTemperatureSchedule(**recipe["temperature_schedule"])))
    run_callbacks.append(monitor)  # after the schedules, before the loggers
    if chief:
        run_callbacks.append(keras.callbacks.CSVLogger(str(output_dir / "history.csv"), append=True))
        if tensorboard and importlib.util.find_spec("tensorboard") is None:
            warnings.warn(
                "TensorBoard logs skipped: the `tensorboard` package is not installed (pip install tensorboard).",
                stacklevel=2,
            )
        elif tensorboard:
            run_callbacks.append(
                keras.callbacks.TensorBoard(str(output_dir / "logs"), write_graph=False, profile_batch=0)
            )
        if num_images:
            images = _first_images(validation_data if validation_data is not None else dataset, num_images)
            run_callbacks.append(SampleGrid(output_dir / "samples", images=images, num_samples=num_images))
    run_callbacks += list(callbacks or [])
    run_callbacks.append(backup)  # last: a checkpoint follows the epoch's logs

    fit_kwargs = dict(
        validation_data=validation_data,
        validation_steps=validation_steps,
        callbacks=run_callbacks,
        verbose=verbose,
    )
    if isinstance(dataset, np.ndarray):
        fit_kwargs["batch_size"] = batch_size
    else:
        fit_kwargs["shuffle"] = False  # tf.data pipelines shuffle themselves (seeded)
    try:
        with _multi_worker_log_reduction(strategy):
            if epoch < epochs and step > 0:
                # Finish the interrupted epoch with its remaining steps.
                backup.step_offset = step
                model.fit(
                    dataset,
                    epochs=epoch + 1,
                    initial_epoch=epoch,
                    steps_per_epoch=steps_per_epoch - step,
                    **fit_kwargs,
                )
                if monitor.stopped_message is None and not model.stop_training:
                    epoch, step = epoch + 1, 0
            if epoch < epochs and step == 0 and monitor.stopped_message is None and not model.stop_training:
                model.fit(dataset, epochs=epochs, initial_epoch=epoch, steps_per_epoch=steps_per_epoch, **fit_kwargs)
    finally:
        model._initial_epoch = None
    if monitor.stopped_message is not None:
        raise NonFiniteTrainingError(monitor.stopped_message)
    if chief:
        _save_final(model, output_dir, portable=bool(getattr(model, "synchronized_batch_norm", False)))
    return model
