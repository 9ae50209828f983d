"""Training callbacks: the non-finite monitor, KL warm-up and sample grids.

- `NonFiniteMonitor` completes `NonFiniteGuard`: it undoes what a skipped
  batch's forward pass wrote (batch-norm statistics, metric totals), logs
  the count and stops training after `max_nonfinite_steps`.
- `KLWarmup`: `beta = kl_min + (1 - kl_min) * epoch / warmup_epochs`,
  assigned to `model.kl_weight` at the start of every epoch.
- `SampleGrid`: a PNG of samples and reconstructions every epoch.
"""

import pathlib

import keras
import numpy as np
from keras import ops

from keras_avae.evaluation import _seed_states
from keras_avae.training.distribute import _model_strategy
from keras_avae.training.distribute import is_chief
from keras_avae.training.images import save_image_grid
from keras_avae.training.optimizers import find_guard


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
        self._count = int(ops.convert_to_numpy(self._guard.nonfinite_steps))
        non_trainable = [
            v
            for v in model.non_trainable_variables
            if "float" in str(v.dtype) and "seed_generator_state" not in v.path
        ]
        self._variables = non_trainable + list(model.metrics_variables)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        _ = self.model  # on JAX, the property writes the trainer's state back into the variables
        self._snapshot = [ops.copy(ops.convert_to_tensor(v)) for v in self._variables]

    def on_train_batch_end(self, batch, logs=None):
        _ = self.model  # on JAX, the property writes the trainer's state back into the variables
        count = int(ops.convert_to_numpy(self._guard.nonfinite_steps))
        if count > self._count:
            if self._snapshot is not None:
                # Synced above, so on JAX the next step re-reads these variables.
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
                "Lower the learning rate or set global_clipnorm (a new run: they change the recipe), check the "
                "data for NaN/Inf, or continue this run with a larger max_nonfinite_steps."
            )
            print("\n" + self.stopped_message)
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs["nonfinite_steps"] = self._count
        optimizer = self.model.optimizer
        step = ops.convert_to_numpy(optimizer.iterations)
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
        # Copies on the device: under a multi-process JAX distribution,
        # assigning a host value is a collective that the chief, alone
        # here, would wait on forever.
        saved = [ops.copy(v) for v in states]
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


class _RunProgressBar(keras.callbacks.ProgbarLogger):
    """The run's progress bar: the run's epoch count, and the steps a stopped epoch ran.

    Finishing an interrupted epoch is a `fit` of one epoch, which Keras'
    bar would show as "Epoch 2/2" in a run of 8 epochs. And Keras' bar ends
    every epoch at its full step count, so an epoch stopped by a signal (or
    by `NonFiniteMonitor`) after 34 of 145 steps would read "145/145" in the
    log, as if it had finished; here it reads "34/145".
    """

    def __init__(self, epochs):
        super().__init__()
        self.run_epochs = epochs

    def set_params(self, params):
        super().set_params({**params, "epochs": self.run_epochs})

    def _finalize_progbar(self, logs):
        stopped = self.model is not None and self.model.stop_training
        if stopped and self.progbar is not None and self.target and self.seen < self.target:
            self.progbar.update(self.seen, list((logs or {}).items()), finalize=True)
            return
        super()._finalize_progbar(logs)
