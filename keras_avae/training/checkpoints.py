"""`AtomicBackupAndRestore`: checkpoints that survive SIGKILL and resume mid-epoch."""

import json
import pathlib
import time

import keras
import numpy as np
from keras import ops

from keras_avae.evaluation import _seed_states
from keras_avae.keras_compat import set_initial_epoch
from keras_avae.training.atomic_files import _atomic_write
from keras_avae.training.atomic_files import _atomic_write_text
from keras_avae.training.distribute import _model_strategy
from keras_avae.training.distribute import is_chief
from keras_avae.training.jax_distribution import _without_distribution


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
        # `train` sets it: a mid-epoch checkpoint records the epoch's means so far.
        self.epoch_means = None

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
        seed_states = _seed_states(model)
        if state.get("seed_states") is not None and len(state["seed_states"]) == len(seed_states):
            for variable, value in zip(seed_states, state["seed_states"]):
                variable.assign(ops.convert_to_tensor(np.array(value), variable.dtype))
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
                set_initial_epoch(self.model, state["epoch"])
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
        with _without_distribution():  # the chief saves alone (several JAX processes)
            _atomic_write(self.backup_dir / name, lambda tmp: model.save_weights(str(tmp)))
        state = {
            "format": 1,
            "weights": name,
            "epoch": epoch,
            "step": step,
            "iterations": int(ops.convert_to_numpy(model.optimizer.iterations)) if model.optimizer else 0,
            "steps_per_epoch": self.steps_per_epoch,
            # Keras does not save seed generators' states with the weights: a
            # resumed run would draw its samples (latents, dropout) again
            # from the start of their streams.
            "seed_states": [np.asarray(ops.convert_to_numpy(v)).tolist() for v in _seed_states(model)],
            "epoch_means": self.epoch_means.partial() if self.epoch_means is not None and step else None,
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
