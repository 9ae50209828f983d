"""`train`: one call that builds, compiles, resumes, trains and saves a model.

Everything the `keras-avae train` command does, as a library.
"""

import contextlib
import importlib.util
import inspect
import json
import warnings
import zipfile

import h5py
import keras
import numpy as np

from keras_avae import zoo
from keras_avae._validation import check_bool
from keras_avae.keras_compat import set_initial_epoch
from keras_avae.training.atomic_files import _atomic_write
from keras_avae.training.atomic_files import _atomic_write_text
from keras_avae.training.atomic_files import _remove_stale_temporaries
from keras_avae.training.callbacks import KLWarmup
from keras_avae.training.callbacks import NonFiniteMonitor
from keras_avae.training.callbacks import SampleGrid
from keras_avae.training.callbacks import _ResumableGumbelSchedule
from keras_avae.training.callbacks import _RunProgressBar
from keras_avae.training.checkpoints import AtomicBackupAndRestore
from keras_avae.training.compile_modes import compile_mode
from keras_avae.training.distribute import _check_strategy
from keras_avae.training.distribute import _is_multi_worker
from keras_avae.training.distribute import _multi_worker_log_reduction
from keras_avae.training.distribute import num_replicas
from keras_avae.training.epoch_means import EpochMeans
from keras_avae.training.jax_distribution import _distribution_scope
from keras_avae.training.jax_distribution import _is_data_parallel
from keras_avae.training.interrupts import TrainingInterrupted
from keras_avae.training.interrupts import _StopOnSignal
from keras_avae.training.optimizers import NonFiniteTrainingError
from keras_avae.training.optimizers import check_guard_policy
from keras_avae.training.optimizers import make_optimizer
from keras_avae.training.reproducibility import _make_reproducible
from keras_avae.training.run_folder import _check_run_record
from keras_avae.training.run_folder import _jsonable
from keras_avae.training.run_folder import _owned
from keras_avae.training.run_folder import _read_record
from keras_avae.training.run_folder import _recorded_feature_seed
from keras_avae.training.run_folder import HistoryLogger
from keras_avae.training.run_folder import _truncate_history
from keras_avae.training.run_settings import _cardinality
from keras_avae.training.run_settings import _first_images
from keras_avae.training.run_settings import _resolve_run

BACKEND = keras.backend.backend()


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
            # The paper's recipe: batch-norm statistics over the global batch. Only
            # `tf.distribute` replicas keep separate statistics; JAX's
            # DataParallel computes them over the global batch as it is.
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
    if replicas > 1 and _is_data_parallel(strategy):
        # A model built outside the distribution lives on one device.
        if len(model.weights[0].value.sharding.device_set) != replicas:
            raise ValueError(
                "A model trained under a multi-device keras.distribution must be created inside "
                "`distribution.scope()`; pass a zoo name or a function that builds the model instead."
            )
    elif replicas > 1:
        import tensorflow as tf

        variable = model.weights[0].value
        if not isinstance(variable, tf.distribute.DistributedValues):
            raise ValueError(
                "A model trained under a multi-replica strategy must be created inside "
                "`strategy.scope()`; pass a zoo name or a function that builds the model instead."
            )
    return model



# The run folder's files written by `_atomic_write`.
_FOLDER_FILES = ("model.keras", "model.weights.h5", "run.json", "history.csv")


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
    _atomic_write(output_dir / "model.keras", lambda tmp: final.save(str(tmp)))
    weights = copy if copy is not None else model
    _atomic_write(output_dir / "model.weights.h5", lambda tmp: weights.save_weights(str(tmp)))



def _run_record(run, model=None):
    """The content of `run.json`: the settings, of which a resume must keep some.

    Without `model`, the settings known before it is built (all but its
    config and compile mode), which a resume checks first: a refusal then
    comes before a full-size model is built.
    """
    settings = {
        "recipe": run.recipe,
        "epochs": run.epochs,
        "steps_per_epoch": run.steps_per_epoch,
        "batch_size": run.batch_size,
        "replicas": run.replicas,
        "backend": BACKEND,
    }
    if run.data is not None:
        settings["data"] = run.data
    if run.batch_from_dataset:
        settings["batch_size_from"] = "dataset"
    if run.reproducibility is not None:
        settings["reproducibility"] = run.reproducibility
    if model is None:
        return {"model": run.name, **settings} if run.name else settings
    return {
        "model": run.name or type(model).__name__,
        "config": {k: v for k, v in model.get_config().items() if k != "name"},
        **settings,
        "compile_mode": compile_mode(model),
    }


def _build_and_restore(model, strategy, run, config_overrides, jit_compile, save_freq):
    """Builds and compiles the model in the strategy's scope and restores the last checkpoint.

    Returns `(model, backup, record, state)`: the built model, its
    `AtomicBackupAndRestore` callback, the run record and the restored
    checkpoint's metadata (`None` for a new run). Refuses a run folder whose
    `run.json` holds other settings.
    """
    scope = strategy.scope() if strategy is not None and BACKEND == "tensorflow" else contextlib.nullcontext()
    path = run.output_dir / "run.json"
    with scope:
        backup = AtomicBackupAndRestore(
            run.output_dir / "backup", save_freq=save_freq, steps_per_epoch=run.steps_per_epoch
        )
        committed = backup.read_state()
        finished_epochs = committed["epoch"] if committed else None
        _check_run_record(path, _run_record(run), finished_epochs)
        model = _build_model(model, strategy, config_overrides, _recorded_feature_seed(path))
        check_guard_policy(model)
        optimizer = make_optimizer(run.recipe, run.steps_per_epoch, run.epochs)
        model.compile(optimizer=optimizer, jit_compile=jit_compile)
        optimizer.build(model.trainable_variables)
        record = _run_record(run, model)
        _check_run_record(path, record, finished_epochs)
        state = backup.restore(model)
    carried = state and state["step"] and state.get("epoch_means")
    backup.epoch_means = EpochMeans(resumed=(state["epoch"], carried) if carried else None)
    return model, backup, record, state


def _start(run, record, state, verbose):
    """Writes `run.json`, says where training starts and trims `history.csv`.

    `run.json` describes what was trained: it is written when this call
    trains (a new run, or more epochs) and records something new, never by
    a call that finds the run complete or is refused.

    Returns `(epoch, step)`: where the restored checkpoint left off, or
    `(0, 0)` for a new run.
    """
    epoch, step = (state["epoch"], state["step"]) if state else (0, 0)
    path = run.output_dir / "run.json"
    if run.chief and epoch < run.epochs and _read_record(path) != _jsonable(record):
        _atomic_write_text(path, json.dumps(_jsonable(record), indent=1))
    if verbose:
        print(f"Training step: {record['compile_mode']}.")
    if state and verbose and epoch >= run.epochs:
        print(f"{run.output_dir} holds a finished run of {run.epochs} epochs: nothing to train.")
    elif state and verbose:
        print(
            f"Resuming from {run.output_dir / 'backup'}: epoch {epoch + 1} of {run.epochs}, step {step} of "
            f"{run.steps_per_epoch} ({state['iterations']} optimizer steps done)."
        )
    if run.chief:
        # Rows of epochs the checkpoint does not hold (a kill between the
        # CSV row and the checkpoint) would be written twice.
        _truncate_history(run.output_dir / "history.csv", epoch)
    return epoch, step


def _make_callbacks(model, run, monitor, backup, images_from, tensorboard, num_images, callbacks):
    """`fit`'s callbacks in the order they must run.

    The schedules first (they assign variables at batch begin), then the
    monitor, the chief's loggers, the caller's callbacks, and the checkpoint
    last (it follows the epoch's logs).
    """
    recipe = run.recipe
    run_callbacks = []
    if hasattr(model, "kl_weight"):
        run_callbacks.append(KLWarmup(recipe.get("kl_warmup_epochs") or 0, recipe.get("kl_min", 1.0)))
    if recipe.get("temperature_schedule") and hasattr(model, "temperature"):
        from keras_avae.models.discrete_vae import GumbelTemperatureSchedule

        run_callbacks.append(_ResumableGumbelSchedule(GumbelTemperatureSchedule(**recipe["temperature_schedule"])))
    run_callbacks.append(monitor)  # after the schedules, before the loggers
    run_callbacks.append(backup.epoch_means)  # before the loggers: a resumed epoch's whole means
    if run.chief:
        run_callbacks += _logging_callbacks(run.output_dir, images_from, tensorboard, num_images)
    run_callbacks += list(callbacks or [])
    run_callbacks.append(backup)  # last: a checkpoint follows the epoch's logs
    return run_callbacks


def _logging_callbacks(output_dir, images_from, tensorboard, num_images):
    """The chief's `history.csv`, TensorBoard logs and PNG grids of samples."""
    logging = [HistoryLogger(output_dir / "history.csv")]
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        warnings.warn(
            "TensorBoard logs skipped: the `tensorboard` package is not installed (pip install tensorboard).",
            stacklevel=4,  # the caller of `train`
        )
    elif tensorboard:
        logging.append(keras.callbacks.TensorBoard(str(output_dir / "logs"), write_graph=False, profile_batch=0))
    if num_images:
        images = _first_images(images_from, num_images)
        logging.append(SampleGrid(output_dir / "samples", images=images, num_samples=num_images))
    return logging


def _fit(model, data_at, run, strategy, backup, monitor, epoch, step, fit_kwargs):
    """Trains from `(epoch, step)` to `run.epochs`: the rest of an interrupted epoch, then whole epochs.

    `data_at(batch)` is the data from global batch `batch` on (the same
    data for every `batch` unless `train` was given a stream function).
    """
    if fit_kwargs.get("verbose"):
        fit_kwargs = dict(fit_kwargs, callbacks=fit_kwargs["callbacks"] + [_RunProgressBar(run.epochs)])
    try:
        with _multi_worker_log_reduction(strategy):
            if epoch < run.epochs and step > 0:
                # Finish the interrupted epoch with its remaining steps.
                backup.step_offset = step
                model.fit(
                    data_at(epoch * run.steps_per_epoch + step),
                    epochs=epoch + 1,
                    initial_epoch=epoch,
                    steps_per_epoch=run.steps_per_epoch - step,
                    **fit_kwargs,
                )
                if monitor.stopped_message is None and not model.stop_training:
                    epoch, step = epoch + 1, 0
            if epoch < run.epochs and step == 0 and monitor.stopped_message is None and not model.stop_training:
                model.fit(
                    data_at(epoch * run.steps_per_epoch),
                    epochs=run.epochs,
                    initial_epoch=epoch,
                    steps_per_epoch=run.steps_per_epoch,
                    **fit_kwargs,
                )
    finally:
        set_initial_epoch(model, None)


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
    data_info=None,
    seed=None,
    deterministic=True,
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
    - `HistoryLogger(output_dir/"history.csv")` (epochs from 1), truncated on resume
      to the epochs the checkpoint holds,
    - `TensorBoard(output_dir/"logs")`,
    - `SampleGrid(output_dir/"samples")` (a PNG per epoch),
    - `AtomicBackupAndRestore(output_dir/"backup", save_freq)`.

    A run killed at any moment (SIGKILL included) and started again with the
    same call resumes from its last checkpoint with weights, optimizer state,
    epoch and step (an interrupted epoch continues with its remaining
    steps), KL coefficient and learning-rate step, and, given a stream
    function as `dataset`, the next batch of the data. At the end it writes
    `model.keras` and `model.weights.h5` (atomically; the checkpoint stays, so
    calling again is a no-op and a larger `epochs` continues the run, the
    cosine stretched to the new length). After
    a run with synchronised batch norm both files come from a copy without
    it and without optimizer state, so they load on every backend (the
    checkpoint keeps the optimizer state).
    The run folder is owned: while `train` runs, an exclusive lock on
    `output_dir/run.lock` (which names the holder's PID and host) makes a
    second `train` on it fail with a `RuntimeError`; the kernel releases the
    lock however the process ends, so a killed run's lock is taken over; a
    call refused before it wrote anything takes its lock file and the
    folders it made away again.
    `run.json` records the settings of what was trained (a call that trains
    nothing or is refused leaves it as it is); resuming with another model
    config, recipe, batch size, step count, epoch count (except more epochs
    after a finished run), `data_info`, `seed` or `deterministic` is refused
    with a `ValueError` naming each differing setting. `history.csv` keeps
    one row per finished epoch. SIGINT (Ctrl-C) or SIGTERM stops training
    after the current step, checkpoints it and raises `TrainingInterrupted` (the same call resumes
    from there; a second signal stops at once); the handlers are installed
    in the main thread for the duration of the call only. Under
    `MultiWorkerMirroredStrategy` only the chief writes (and locks); so does
    process 0 of a multi-process `keras.distribution` on JAX.

    Args:
        model: a zoo name, a `keras.Model` (created under `strategy.scope()`
            when the strategy has several replicas), or a function returning
            one.
        dataset: a batched `tf.data.Dataset` of images (global batches), a
            NumPy array of images (then `batch_size` applies), or a function
            `start_batch -> dataset` of an endless stream (with
            `steps_per_epoch`), e.g. `datasets.make_dataset(...,
            repeat=True, start_batch=start_batch)`: a resumed run then
            trains on the batches an uninterrupted run would (a plain
            dataset starts again from its beginning).
        output_dir: the run directory.
        epochs: total epochs; defaults to the recipe's.
        steps_per_epoch: steps per epoch; inferred for finite inputs.
        strategy: what `make_strategy` returns: a `tf.distribute.Strategy`
            (TensorFlow), a `keras.distribution.DataParallel` (JAX: the
            model is built and `fit` runs in its `scope()`; each global
            batch is split over the devices and batch-norm statistics are
            those of the global batch), or `None`; anything else (a name,
            another `keras.distribution`) is refused.
        validation_data: optional held-out images (dataset or array).
        validation_steps: steps of validation per epoch.
        batch_size: global batch for array inputs; defaults to the recipe's
            `batch_size_per_replica` times the replicas. A `tf.data.Dataset`
            of fixed-size batches sets it (another value is refused).
        config_overrides: architecture overrides for a zoo name.
        save_freq: `"epoch"` or an int: checkpoint every N steps (and at
            every epoch end).
        num_images: images per row of the PNG grid; 0 disables the grid.
        tensorboard: write TensorBoard logs (needs the `tensorboard`
            package; skipped with a warning without it).
        callbacks: extra Keras callbacks.
        verbose: `fit`'s verbosity.
        jit_compile: passed to `compile`.
        data_info: optional dict describing the training data (what
            `keras-avae train` passes: dataset, `limit`, seed), recorded in
            `run.json` as `data` and checked on resume.
        seed: int or `None`. An int seeds Python, NumPy, the backend and
            Keras (`keras.utils.set_random_seed`) before the model is built:
            weight initialisation, seeds the model leaves as `None`,
            shuffling of arrays. A dataset built before the call keeps its
            order. `None` leaves the generators as they are.
        deterministic: with a `seed`, also ask the backend for
            deterministic kernels, process-wide (TensorFlow's
            `enable_op_determinism`, torch's deterministic algorithms): the
            same call then gives the same numbers on the same machine. A
            bool; `run.json` records it with the seed
            (`reproducibility`).
        **recipe_overrides: training recipe values (see `resolve_recipe`),
            e.g. `learning_rate=2e-3`, `global_clipnorm=200.0`,
            `max_nonfinite_steps=10`.

    Returns:
        The trained model.

    Raises:
        ValueError: for invalid arguments, fewer batches than
            `steps_per_epoch`, or an output directory holding a run with
            other settings.
        RuntimeError: another process is training in `output_dir`.
        TrainingInterrupted: SIGINT or SIGTERM stopped the run (its
            checkpoint holds the last step).
        NonFiniteTrainingError: when more than `max_nonfinite_steps` steps
            were skipped (the checkpoint holds the last finite state).

    Example (a tiny model on random 8x8 images; the same call again with
    the same folder resumes, here it finds the run complete):

    >>> import pathlib, tempfile
    >>> x = (np.random.rand(16, 8, 8, 1) > 0.5).astype("float32")
    >>> tiny = dict(image_shape=[8, 8, 1], num_layers=2, preprocess_filters=4,
    ...     decoder_filters=4, num_scales=1, crop=0)
    >>> out = tempfile.mkdtemp()
    >>> model = train("mnist-baseline", x, out, epochs=1, batch_size=8,
    ...     config_overrides=tiny, verbose=0, tensorboard=False)
    >>> int(keras.ops.convert_to_numpy(model.optimizer.iterations)), sorted(p.name for p in pathlib.Path(out).glob("model.*"))
    (2, ['model.keras', 'model.weights.h5'])
    """
    check_bool(deterministic, "deterministic")
    _check_strategy(strategy)
    stream = dataset if callable(dataset) else None
    if stream is not None:
        dataset = stream(0)
    run = _resolve_run(
        model,
        dataset,
        output_dir,
        epochs,
        steps_per_epoch,
        strategy,
        batch_size,
        recipe_overrides,
        data_info,
        validation_data,
        # Deterministic kernels are asked for only with a seed.
        reproducibility={"seed": seed, "deterministic_kernels": seed is not None and deterministic},
    )
    if seed is not None:
        _make_reproducible(seed, deterministic)
    if _is_data_parallel(strategy) and strategy.num_processes > 1 and _cardinality(dataset) > 0:
        # Each process reads a rebatched shard of unknown length, which
        # `fit` does not start again at the next epoch: repeat the whole
        # data instead (every epoch still takes `steps_per_epoch` batches).
        dataset = dataset.repeat()
    # The chief owns the folder (the other workers only read its checkpoint).
    with _owned(run.output_dir, run.new_folders) if run.chief else contextlib.nullcontext(), _StopOnSignal() as stopper:
        if run.chief:  # what a kill in the middle of a write left
            for name in _FOLDER_FILES:
                _remove_stale_temporaries(run.output_dir / name)
        # JAX: the model is built and trained under the keras.distribution;
        # the final files are written outside it, by the chief alone.
        with _distribution_scope(strategy):
            model, backup, record, state = _build_and_restore(
                model, strategy, run, config_overrides, jit_compile, save_freq
            )
            epoch, step = _start(run, record, state, verbose)

            monitor = NonFiniteMonitor(run.recipe["max_nonfinite_steps"])
            images_from = validation_data if validation_data is not None else dataset
            if _is_multi_worker(strategy) and hasattr(images_from, "element_spec") and not hasattr(images_from, "take"):
                # A distributed dataset read by the chief alone would stall the
                # workers' collectives: the grid shows samples only.
                images_from = None
            run_callbacks = _make_callbacks(
                model, run, monitor, backup, images_from, tensorboard, num_images, callbacks
            )
            fit_kwargs = dict(
                validation_data=validation_data,
                validation_steps=validation_steps,
                callbacks=[stopper] + run_callbacks,
                verbose=verbose,
            )
            if isinstance(dataset, np.ndarray):
                fit_kwargs["batch_size"] = run.batch_size
            else:
                fit_kwargs["shuffle"] = False  # tf.data pipelines shuffle themselves (seeded)
            if stopper.signum is None:
                # `dataset` is the stream's start: a new run does not build it twice.
                data_at = (lambda batch: dataset) if stream is None else (lambda b: dataset if b == 0 else stream(b))
                _fit(model, data_at, run, strategy, backup, monitor, epoch, step, fit_kwargs)
        done = _committed_epoch(backup, epoch)
        if done < run.epochs and run.chief:
            # A stop mid-epoch logged a row for the unfinished epoch.
            _truncate_history(run.output_dir / "history.csv", done)
        if stopper.signum is not None and done < run.epochs:
            _interrupted(run, backup, stopper)
        if monitor.stopped_message is not None:
            raise NonFiniteTrainingError(monitor.stopped_message)
        trained = epoch < run.epochs
        if run.chief and (trained or _final_files_stale(run.output_dir, backup)):
            _save_final(model, run.output_dir, portable=bool(getattr(model, "synchronized_batch_norm", False)))
    return model


def _final_files_stale(output_dir, backup):
    """Whether `model.keras` / `model.weights.h5` are missing, cut short or older than the committed checkpoint.

    A kill after the last checkpoint of a longer run (more `epochs`) but
    before its final files leaves the shorter run's; the same call on the
    now complete run writes them again from the checkpoint.
    """
    finals = [output_dir / "model.keras", output_dir / "model.weights.h5"]
    if not all(_whole_file(path) for path in finals):
        return True
    pointer = backup.backup_dir / backup.POINTER
    return pointer.exists() and min(path.stat().st_mtime_ns for path in finals) < pointer.stat().st_mtime_ns


def _whole_file(path):
    """Whether `path` exists and opens as the archive it should be (a cut copy does not)."""
    if not path.exists():
        return False
    if path.suffix == ".keras":
        return zipfile.is_zipfile(path)  # the zip directory is at the file's end
    try:
        with h5py.File(path, "r"):  # HDF5 checks the file's recorded end
            return True
    except OSError:
        return False


def _committed_epoch(backup, default):
    """The epoch the committed checkpoint starts (its finished epochs)."""
    state = backup.read_state()
    return state["epoch"] if state else default


def _interrupted(run, backup, stopper):
    """Raises `TrainingInterrupted`: what was saved, and how to resume."""
    state = backup.read_state()
    if state is None:
        where = "no step was trained, no checkpoint written"
    else:
        where = (
            f"checkpoint at epoch {state['epoch'] + 1} of {run.epochs}, step {state['step']} of "
            f"{run.steps_per_epoch} ({state['iterations']} optimizer steps) in {backup.backup_dir}"
        )
    raise TrainingInterrupted(
        stopper.signum, f"stopped by {stopper.signal_name}: {where}; run the same command again to resume."
    )
