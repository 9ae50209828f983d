"""The recipe's optimizer and `NonFiniteGuard`, which skips non-finite steps.

`make_optimizer` builds Adamax (`FusedAdamax` on TensorFlow and PyTorch) or Adam on
`make_schedule`'s schedule, with optional global gradient clipping,
wrapped in `NonFiniteGuard`: an optimizer wrapper (the pattern of Keras'
`LossScaleOptimizer`) that skips every step whose gradients are not all
finite and counts the skipped steps in a checkpointed variable.
`NonFiniteMonitor` (in `callbacks`) completes it.
"""

import keras
from keras import ops

from keras_avae.keras_compat import no_automatic_dependency_tracking
from keras_avae.training.fused_adamax import FusedAdamax
from keras_avae.training.schedules import make_schedule

BACKEND = keras.backend.backend()

_OPTIMIZERS = ("adamax", "adam")


def make_optimizer(recipe, steps_per_epoch, epochs=None, guard=True, schedule=True):
    """The recipe's optimizer: Adamax (or Adam) on `make_schedule`'s schedule.

    Args:
        recipe: a dict from `resolve_recipe` (keys `optimizer`,
            `learning_rate`, `beta_1`, `beta_2`, `epsilon`, `warmup_epochs`,
            `initial_learning_rate`, `min_learning_rate`, `restart_epochs`,
            `epochs`, `global_clipnorm`).
        steps_per_epoch: int, optimizer steps per epoch.
        epochs: run length in epochs; defaults to `recipe["epochs"]`.
        guard: wrap the optimizer in `NonFiniteGuard` (default).
        schedule: `True` (default) puts `make_schedule`'s schedule in the
            optimizer. `False` gives it a plain rate instead (a variable set to
            the schedule's rate at step 0), for a caller that sets
            `optimizer.learning_rate` from `make_schedule` before every step:
            the compiled step then does not depend on the run's length, so
            a JAX step compiled once serves a run whose length is decided
            after timing it.

    Returns:
        A `NonFiniteGuard` around the optimizer (its `inner_optimizer`), or
        the optimizer itself with `guard=False`.

    Example:

    >>> from keras_avae.training import resolve_recipe
    >>> optimizer = make_optimizer(resolve_recipe(None, epochs=10), 100)
    >>> isinstance(optimizer.inner_optimizer, keras.optimizers.Adamax), optimizer.inner_optimizer.epsilon
    (True, 0.001)
    """
    kind = recipe.get("optimizer", "adamax")
    if kind not in _OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {_OPTIMIZERS}. Received: optimizer={kind!r}")
    clipnorm = recipe.get("global_clipnorm")
    if clipnorm is not None and not clipnorm > 0:
        raise ValueError(f"`global_clipnorm` must be positive or None. Received: global_clipnorm={clipnorm!r}")
    kwargs = {k: recipe[k] for k in ("beta_1", "beta_2", "epsilon") if recipe.get(k) is not None}
    if kind == "adam":
        cls = keras.optimizers.Adam
    else:
        # The same update as Keras' Adamax: TensorFlow's fused kernel, one op
        # per weight, and flat moment buffers on PyTorch; on JAX, which
        # compiles the whole step, Keras' own.
        cls = FusedAdamax if BACKEND in ("tensorflow", "torch") else keras.optimizers.Adamax
    learning_rate = make_schedule(recipe, steps_per_epoch, epochs)
    if not schedule:
        learning_rate = float(learning_rate(0))
    optimizer = cls(
        learning_rate=learning_rate,
        global_clipnorm=clipnorm,
        name=kind,
        **kwargs,
    )
    return NonFiniteGuard(optimizer) if guard else optimizer



def check_guard_policy(model):
    """Refuses to guard a model whose dtype policy is `"mixed_float16"`.

    Keras' `compile` wraps such a model's optimizer in a
    `LossScaleOptimizer`, which skips non-finite steps itself, before the
    guard sees them: nothing is counted, batch-norm statistics made NaN by
    the forward pass are not put back, and training never stops (on JAX the
    first step failed). `"mixed_bfloat16"` has float32's range and needs no
    loss scaling.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, dtype="mixed_bfloat16")])
    >>> check_guard_policy(model)
    """
    policy = model.dtype_policy.name
    if policy == "mixed_float16":
        raise ValueError(
            "Training with the NaN guard (`NonFiniteGuard`, as `train` and the tuner do) cannot use the "
            "'mixed_float16' policy: Keras' loss scaling skips non-finite steps before the guard sees them "
            "(none counted, NaN batch-norm statistics kept). Use 'mixed_bfloat16' (float32's range, no loss "
            f"scaling) or 'float32'. Received: dtype policy {policy!r}"
        )


@keras.saving.register_keras_serializable(package="keras_avae")
class NonFiniteGuard(keras.optimizers.Optimizer):
    """Skips optimizer steps whose gradients are not all finite, and counts them.

    NVAE-style models fail most often by a NaN or Inf loss. This
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
    every replica skips or applies the same step. Under `"mixed_float16"`,
    `compile` puts a `LossScaleOptimizer` around it, which hides the bad
    steps from it: see `check_guard_policy`.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to guard.
        name: string.

    Example:

    >>> import numpy as np
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

    @no_automatic_dependency_tracking
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
        grads = [g for g in grads if g is not None]
        if BACKEND == "torch" and grads and len({g.device for g in grads}) == 1:
            return _torch_all_finite(grads)
        flags = [ops.all(ops.isfinite(g)) for g in grads]
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


def _torch_all_finite(grads):
    """`all(isfinite(g))` over every gradient as one multi-tensor kernel call.

    It is the check `torch.amp.GradScaler` runs on every step: it raises a
    flag if any gradient holds an inf or a NaN, and multiplies every
    gradient in place by the scale, here 1 (the values do not change).
    Keras' `isfinite` and `all` per gradient dispatch about 1,400 ops per
    step of `mnist-baseline-small` (230 weights); this is one. The
    gradients must be on one device.
    """
    import torch

    device = grads[0].device
    found_inf = torch.zeros((), device=device)
    with torch.no_grad():  # an in-place op, and `apply` may run outside `no_grad`
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones((), device=device))
    return found_inf == 0


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
