"""Training: schedules, the non-finite guard, strategies, checkpoints, `train`.

Everything the `keras-avae train` command does, as a library,
one concept per module:

- `recipes`: `REFERENCE_RECIPE`, `resolve_recipe`, `split_overrides`.
- `schedules`: `WarmupCosineDecay`, a linear learning-rate warm-up from
  1e-4, then cosine decay to a floor, optionally with one warm restart; per
  step. `make_schedule` builds it from a recipe.
- `fused_adamax`: `FusedAdamax`, Keras' Adamax with TensorFlow's fused
  `ApplyAdaMax` kernel as its update (one op per weight, not about 20),
  and on PyTorch flat moment buffers (a few ops per step, not several per
  weight).
- `optimizers`: `make_optimizer(recipe, steps_per_epoch)`: Adamax (lr 1e-2,
  beta_1 0.9, beta_2 0.999, epsilon 1e-3) on that schedule, optional global
  gradient clipping, wrapped in `NonFiniteGuard`: an optimizer wrapper (the
  pattern of Keras' `LossScaleOptimizer`) that skips every step whose
  gradients are not all finite, leaving weights and optimizer state
  untouched, and counts the skipped steps in a checkpointed variable.
- `callbacks`: `NonFiniteMonitor` undoes what the bad batch's forward pass
  wrote (batch-norm statistics, metric totals), logs the count and stops
  training after `max_nonfinite_steps`; `KLWarmup`:
  `beta = kl_min + (1 - kl_min) * epoch / warmup_epochs`, assigned to
  `model.kl_weight` at the start of every epoch; `SampleGrid`: a PNG of
  samples and reconstructions every epoch.
- `distribute`: `make_strategy`, `tf.distribute` Mirrored /
  MultiWorkerMirrored / one device, and a split of the CPU into N logical
  devices (TensorFlow backend); on JAX it delegates to
- `jax_distribution`: `keras.distribution.DataParallel` over the local
  devices or several processes, and N host CPU devices (XLA's host platform
  device count).
- `checkpoints`: `AtomicBackupAndRestore`, `keras.callbacks.BackupAndRestore`
  made safe against a kill at any moment and exact for mid-epoch
  checkpoints (over the atomic writes of `atomic_files`).
- `images`: `image_grid` and `save_image_grid`, PNG grids of images.
- `run_folder`: a run folder's lock (`run.lock`), `run.json` and
  `history.csv`.
- `interrupts`: SIGINT/SIGTERM stop training after a checkpoint of the
  current step (`TrainingInterrupted`).
- `run_settings`: a run's epochs, steps per epoch, global batch and chief,
  resolved from `train`'s arguments and checked against the data.
- `trainer`: `train(...)`, one call that builds, compiles, resumes and
  trains a zoo entry or a model, and writes `model.keras` and
  `model.weights.h5`.

Multi-device training goes through `tf.distribute` on TensorFlow and
`keras.distribution` on JAX; on PyTorch `train` runs on one device.

Example:

>>> import numpy as np, tempfile
>>> from keras_avae import training
>>> x = (np.random.rand(16, 8, 8, 1) > 0.5).astype("float32")
>>> model = training.train("mnist-baseline", x, tempfile.mkdtemp(), epochs=1,
...     batch_size=8, config_overrides=dict(image_shape=[8, 8, 1], num_layers=2,
...     preprocess_filters=4, decoder_filters=4, num_scales=1, crop=0),
...     verbose=0)  # doctest: +SKIP
"""

# The package's names (and the private ones tests and tools use), as before
# the split into modules.
from keras_avae.training.atomic_files import _atomic_write
from keras_avae.training.atomic_files import _atomic_write_text
from keras_avae.training.atomic_files import _fsync
from keras_avae.training.callbacks import KLWarmup
from keras_avae.training.callbacks import NonFiniteMonitor
from keras_avae.training.callbacks import SampleGrid
from keras_avae.training.callbacks import _learning_rate_at
from keras_avae.training.callbacks import _ResumableGumbelSchedule
from keras_avae.training.checkpoints import AtomicBackupAndRestore
from keras_avae.training.distribute import BACKEND
from keras_avae.training.distribute import STRATEGIES
from keras_avae.training.distribute import _is_multi_worker
from keras_avae.training.distribute import _model_strategy
from keras_avae.training.distribute import _multi_worker_log_reduction
from keras_avae.training.distribute import is_chief
from keras_avae.training.distribute import make_strategy
from keras_avae.training.distribute import num_replicas
from keras_avae.training.distribute import split_cpu
from keras_avae.training.fused_adamax import FusedAdamax
from keras_avae.training.images import encode_png
from keras_avae.training.jax_distribution import make_distribution
from keras_avae.training.jax_distribution import set_host_device_count
from keras_avae.training.images import image_grid
from keras_avae.training.images import save_image_grid
from keras_avae.training.interrupts import TrainingInterrupted
from keras_avae.training.optimizers import NonFiniteGuard
from keras_avae.training.optimizers import NonFiniteTrainingError
from keras_avae.training.optimizers import find_guard
from keras_avae.training.optimizers import make_optimizer
from keras_avae.training.recipes import REFERENCE_RECIPE
from keras_avae.training.recipes import resolve_recipe
from keras_avae.training.recipes import split_overrides
from keras_avae.training.run_folder import _check_run_record
from keras_avae.training.run_folder import _truncate_history
from keras_avae.training.schedules import WarmupCosineDecay
from keras_avae.training.schedules import make_schedule
from keras_avae.training.trainer import _build_model
from keras_avae.training.compile_modes import compile_mode
from keras_avae.training.trainer import train
