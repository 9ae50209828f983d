"""The learning-rate schedule: linear warm-up, then cosine decay (the paper's recipe)."""

import math

import keras
import numpy as np
from keras import ops

from keras_avae._validation import is_finite_real
from keras_avae.training.recipes import _positive_int


@keras.saving.register_keras_serializable(package="keras_avae")
class WarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then cosine decay to a floor, with one optional restart.

    The paper's schedule (the reference's `CosineWarmup` /
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
            if not (is_finite_real(value) and value >= 0):
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

    >>> from keras_avae.training import resolve_recipe
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
