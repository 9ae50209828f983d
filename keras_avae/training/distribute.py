"""Strategies: `tf.distribute` Mirrored / MultiWorkerMirrored / one device.

Multi-device training goes through `tf.distribute` and so needs the
TensorFlow backend; on JAX and PyTorch `train` runs on one device (Keras'
own `keras.distribution` API can be set up by the caller on JAX).
`split_cpu` splits the CPU into N logical devices, so `MirroredStrategy`
runs (and is tested) without GPUs.
"""

import contextlib
import os
import warnings

import keras

BACKEND = keras.backend.backend()


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
