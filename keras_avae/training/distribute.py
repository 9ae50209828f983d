"""Strategies: `tf.distribute` on TensorFlow, `keras.distribution` on JAX.

On TensorFlow, `make_strategy` gives a `tf.distribute` Mirrored /
MultiWorkerMirrored / one-device strategy, and `split_cpu` splits the CPU
into N logical devices, so `MirroredStrategy` runs (and is tested) without
GPUs. On JAX it gives a `keras.distribution.DataParallel` over the local
devices or several processes (`jax_distribution`), with N host devices for
the same purpose. PyTorch trains on one device.
"""

import contextlib
import os
import warnings

import keras

from keras_avae._validation import is_integer
from keras_avae.keras_compat import multi_worker_scalar_log_reduction
from keras_avae.training.jax_distribution import _is_data_parallel

BACKEND = keras.backend.backend()


STRATEGIES = ("auto", "mirrored", "multi-worker", "one-device")


def make_strategy(kind="auto", cpu_devices=None, *, coordinator_address=None, num_processes=None, process_id=None):
    """A `tf.distribute` strategy (TensorFlow), a `keras.distribution` (JAX), or `None`.

    On TensorFlow:

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

    On JAX the same kinds give a `keras.distribution.DataParallel` (see
    `jax_distribution.make_distribution`): `"mirrored"` over the local
    devices (`cpu_devices` sets XLA's host platform device count),
    `"multi-worker"` over the devices of several processes joined by
    `keras.distribution.initialize`, `"auto"` either when it applies; the
    global batch is the per-replica batch times `num_replicas(strategy)`,
    and batch-norm statistics are those of the global batch. `train` runs
    inside its `scope()`.

    Args:
        kind: one of `STRATEGIES`.
        cpu_devices: `None` or int N >= 1: split the CPU into N logical
            devices, so that `MirroredStrategy` runs (and is tested) without
            GPUs. TensorFlow fixes its devices when it initialises (at the
            first op, tensor, variable or dataset), so call this first
            thing in the program; later it raises a `RuntimeError` unless the
            split is already in place. On JAX: N host devices, under the
            same rule.
        coordinator_address: JAX `"multi-worker"` only: `"host:port"` of
            process 0; default: `KERAS_DISTRIBUTION_JOB_ADDRESSES`.
            (TensorFlow reads its cluster from `TF_CONFIG`.)
        num_processes: JAX `"multi-worker"` only; default:
            `KERAS_DISTRIBUTION_NUM_PROCESSES`.
        process_id: JAX `"multi-worker"` only, in `[0, num_processes)`;
            default: `KERAS_DISTRIBUTION_PROCESS_ID`.

    Returns:
        A `tf.distribute.Strategy` (TensorFlow); a
        `keras.distribution.DataParallel` or `None` (JAX); `None` (PyTorch,
        for `"auto"` and `"one-device"`).

    Raises:
        ValueError: for an unknown `kind` or bad argument, or a multi-device
            kind on PyTorch.
        RuntimeError: when the CPU split or the multi-worker set-up comes
            after the backend initialised.

    Example:

    >>> strategy = make_strategy("one-device")  # doctest: +SKIP
    """
    cpu_devices = _check_kind_and_cpu_devices(kind, cpu_devices)
    if BACKEND == "jax":
        from keras_avae.training.jax_distribution import make_distribution

        return make_distribution(kind, cpu_devices, coordinator_address, num_processes, process_id)
    cluster = dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
    if any(value is not None for value in cluster.values()):
        received = ", ".join(f"{k}={v!r}" for k, v in cluster.items() if v is not None)
        raise ValueError(
            "`coordinator_address`, `num_processes` and `process_id` set up JAX processes; on "
            f"{BACKEND} {'workers read their cluster from TF_CONFIG' if BACKEND == 'tensorflow' else 'they do not apply'}. "
            f"Received: {received}"
        )
    if BACKEND != "tensorflow":
        if kind in ("mirrored", "multi-worker") or (cpu_devices or 1) > 1:
            raise ValueError(
                "Multi-device training needs the TensorFlow backend (tf.distribute) or the JAX backend "
                f"(keras.distribution); {BACKEND} trains on one device. "
                f"Received: kind={kind!r}, cpu_devices={cpu_devices!r}"
            )
        return None
    import tensorflow as tf

    # `auto` with TF_CONFIG is multi-worker: resolved before the check below,
    # which it would otherwise pass and then ignore the CPU split.
    workers = kind == "multi-worker" or (kind == "auto" and os.environ.get("TF_CONFIG"))
    if workers and (cpu_devices or 1) > 1:
        raise ValueError(
            "MultiWorkerMirroredStrategy uses one CPU device per worker; start more workers instead. "
            f"Received: kind={kind!r} (TF_CONFIG {'set' if os.environ.get('TF_CONFIG') else 'unset'}), "
            f"cpu_devices={cpu_devices}"
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


def _check_kind_and_cpu_devices(kind, cpu_devices):
    """`make_strategy`'s and `make_distribution`'s checks of `kind` and `cpu_devices`: `cpu_devices`."""
    if kind not in STRATEGIES:
        raise ValueError(f"`kind` must be one of {STRATEGIES}. Received: kind={kind!r}")
    if cpu_devices is not None and (not is_integer(cpu_devices) or cpu_devices < 1):
        raise ValueError(f"`cpu_devices` must be a positive int or None. Received: cpu_devices={cpu_devices!r}")
    return None if cpu_devices is None else int(cpu_devices)  # a NumPy int as a Python int


def _check_strategy(strategy):
    """Refuses a `strategy` that `make_strategy` does not make on this backend.

    On JAX, `num_replicas` counts 1 for anything but a `DataParallel`, so a
    name or a `ModelParallel` would train on one device without a word; on
    TensorFlow it would fail on a missing attribute.
    """
    if strategy is None:
        return
    if BACKEND == "tensorflow":
        import tensorflow as tf

        accepted, wanted = isinstance(strategy, tf.distribute.Strategy), "a tf.distribute.Strategy or None"
    elif BACKEND == "jax":
        accepted, wanted = _is_data_parallel(strategy), "a keras.distribution.DataParallel or None"
    else:
        accepted, wanted = False, "None (it trains on one device)"
    if not accepted:
        by_name = ""
        if isinstance(strategy, str) and BACKEND in ("tensorflow", "jax"):
            by_name = f" (by name: strategy=make_strategy({strategy!r}))"
        raise ValueError(
            f"`strategy` must be {wanted} on the {BACKEND} backend, as `make_strategy(kind)` returns{by_name}. "
            f"Received: strategy={strategy!r}"
        )


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
    """Replicas in sync under `strategy` (1 without one, or on PyTorch).

    A `tf.distribute` strategy's `num_replicas_in_sync`; for a
    `keras.distribution.DataParallel` (JAX) its devices, in all processes.

    Example:

    >>> num_replicas(None)
    1
    """
    if _is_data_parallel(strategy):
        return int(strategy.device_mesh.devices.size)
    if strategy is None or BACKEND != "tensorflow":
        return 1
    return strategy.num_replicas_in_sync


def is_chief(strategy=None):
    """Whether this process writes checkpoints, logs and images.

    Every process of a single-machine run; under `MultiWorkerMirroredStrategy`
    only the chief (task `chief`, else worker 0); under a multi-process
    `keras.distribution` (JAX) process 0.

    Example:

    >>> is_chief(None)
    True
    """
    if _is_data_parallel(strategy):
        import jax

        return jax.process_index() == 0
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
    with multi_worker_scalar_log_reduction():
        yield


def _model_strategy(model):
    if BACKEND == "jax":
        return keras.distribution.distribution()  # set by `train` while `fit` runs
    if BACKEND != "tensorflow":
        return None
    return getattr(model, "distribute_strategy", None)
