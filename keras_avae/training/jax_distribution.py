"""Data-parallel training on JAX through `keras.distribution`.

On the JAX backend `make_strategy` returns a `keras.distribution.DataParallel`
over the local devices (`"mirrored"`) or over the devices of several
processes (`"multi-worker"`, after `keras.distribution.initialize`), and
`train` runs `fit` inside its `scope()`. The variables are replicated on
every device and each global batch is split along its first axis; JAX
compiles one program for the whole global batch and XLA inserts the
all-reduces. So, unlike `tf.distribute` replicas, nothing is computed per
replica: batch-norm statistics are means over the global batch (no
synchronised batch norm is needed), the loss and its gradients are those of
the global batch, and JAX's partitionable random numbers (threefry) draw the
same latent noise as one device would. One step on N devices therefore
gives the weights of one step on one device with the same global batch, up
to float summation order (`tests/test_jax_distribution.py`).

`set_host_device_count` gives the CPU N devices (XLA's host platform device
count), so all of this runs, and is tested, without GPUs.
"""

import contextlib
import os
import re

import keras

_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"

# Keras' own variables for `keras.distribution.initialize`.
_CLUSTER_ENV = {
    "coordinator_address": "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "num_processes": "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "process_id": "KERAS_DISTRIBUTION_PROCESS_ID",
}


def set_host_device_count(num_devices):
    """Gives JAX `num_devices` CPU devices (XLA's host platform device count).

    Sets `--xla_force_host_platform_device_count=N` in `XLA_FLAGS` (keeping
    the other flags), then checks that JAX sees N CPU devices. XLA reads the
    flag when JAX initialises its backends (at the first array, op or
    device query), so call this first thing in the program; a later call
    with the count already in place is a no-op.

    Args:
        num_devices: int >= 1.

    Returns:
        `num_devices`.

    Raises:
        ValueError: `num_devices` is not a positive int.
        RuntimeError: JAX already initialised with another number of CPU
            devices.

    Example (the test process's JAX has one CPU device already):

    >>> set_host_device_count(1)  # doctest: +SKIP
    1
    """
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int. Received: num_devices={num_devices!r}")
    import jax

    previous = os.environ.get("XLA_FLAGS")
    kept = re.sub(rf"{_HOST_DEVICES_FLAG}=\S*", "", previous or "").split()
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{_HOST_DEVICES_FLAG}={num_devices}"])
    try:
        if jax.config.jax_num_cpu_devices >= 0:  # set by the user: it overrides the flag
            jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
        pass  # JAX already initialised with another count: said below
    existing = jax.local_device_count("cpu")  # initialises JAX's backends
    if existing != num_devices:
        # Too late: leave the flags as they were (child processes inherit them).
        if previous is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = previous
        raise RuntimeError(
            f"Cannot give JAX {num_devices} CPU devices: JAX already initialised with "
            f"{existing}. Call "
            "make_strategy(cpu_devices=N) (or the CLI's --cpu-devices) before anything creates a JAX "
            f"array, or start Python with XLA_FLAGS={_HOST_DEVICES_FLAG}={num_devices}. "
            f"Received: cpu_devices={num_devices}"
        )
    return num_devices


def make_distribution(kind="auto", cpu_devices=None, coordinator_address=None, num_processes=None, process_id=None):
    """A `keras.distribution.DataParallel` for `kind` (JAX backend), or `None`.

    - `"auto"`: `"multi-worker"` when a coordinator is given (argument or
      `KERAS_DISTRIBUTION_JOB_ADDRESSES`), else `"mirrored"` when more than
      one device is visible (or `cpu_devices > 1`), else `None`.
    - `"mirrored"`: `DataParallel` over the local devices (GPUs, else the
      CPU's `cpu_devices` host devices).
    - `"multi-worker"`: `keras.distribution.initialize` with the coordinator
      address, number of processes and process id (arguments, else Keras'
      `KERAS_DISTRIBUTION_*` environment variables), then `DataParallel` over
      the devices of all processes; process 0 is the chief.
    - `"one-device"`: `None` (JAX's default device).

    Call it first thing in the program: the host device count and the
    process group are fixed when JAX initialises.

    Args:
        kind: `"auto"`, `"mirrored"`, `"multi-worker"` or `"one-device"`.
        cpu_devices: `None` or int N >= 1: N CPU devices
            (`set_host_device_count`). Not with `"multi-worker"`: start more
            processes instead.
        coordinator_address: `"host:port"` of process 0 (`"multi-worker"`).
        num_processes: int >= 1 (`"multi-worker"`).
        process_id: int in `[0, num_processes)` (`"multi-worker"`).

    Returns:
        A `keras.distribution.DataParallel`, or `None`.

    Raises:
        ValueError: an invalid argument or environment variable (named, with
            the value received).
        RuntimeError: JAX initialised before the host devices or the process
            group could be set up, or the coordinator could not be reached.

    Example (in a fresh program: JAX is already initialised here):

    >>> distribution = make_distribution("mirrored", cpu_devices=2)  # doctest: +SKIP
    >>> distribution.device_mesh.shape  # doctest: +SKIP
    (2,)
    """
    from keras_avae.training.distribute import _check_kind_and_cpu_devices  # here: distribute imports this module

    cpu_devices = _check_kind_and_cpu_devices(kind, cpu_devices)
    cluster = _cluster_settings(coordinator_address, num_processes, process_id)
    if kind == "auto" and cluster["coordinator_address"] is not None:
        kind = "multi-worker"
    if kind == "multi-worker":
        if (cpu_devices or 1) > 1:
            raise ValueError(
                "kind='multi-worker' uses the devices each process sees; start more processes instead of "
                f"splitting the CPU. Received: kind='multi-worker', cpu_devices={cpu_devices}"
            )
        _initialize_processes(**cluster)
        return keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    if any(value is not None for value in (coordinator_address, num_processes, process_id)):
        raise ValueError(
            "`coordinator_address`, `num_processes` and `process_id` apply to kind='multi-worker' only. "
            f"Received: kind={kind!r}, coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}"
        )
    if cpu_devices is not None:
        set_host_device_count(cpu_devices)
    if kind == "one-device":
        return None
    devices = keras.distribution.list_devices()
    if kind == "auto" and len(devices) < 2 and (cpu_devices or 1) < 2:
        return None
    return keras.distribution.DataParallel(devices=devices)


def _cluster_settings(coordinator_address, num_processes, process_id):
    """The process group's settings from the arguments, else Keras' environment variables."""
    values = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    for name, variable in _CLUSTER_ENV.items():
        if values[name] is None and os.environ.get(variable):
            text = os.environ[variable]
            if name == "coordinator_address":
                values[name] = text
                continue
            try:
                values[name] = int(text)
            except ValueError:
                raise ValueError(f"{variable} must be an int. Received: {variable}={text!r}") from None
    address, count, index = values["coordinator_address"], values["num_processes"], values["process_id"]
    if address is not None and (not isinstance(address, str) or ":" not in address):
        raise ValueError(
            f"`coordinator_address` must be 'host:port'. Received: coordinator_address={address!r}"
        )
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ValueError(f"`num_processes` must be a positive int. Received: num_processes={count!r}")
    if index is not None and (
        not isinstance(index, int) or isinstance(index, bool) or index < 0 or (count is not None and index >= count)
    ):
        raise ValueError(
            f"`process_id` must be an int in [0, num_processes). Received: process_id={index!r}, "
            f"num_processes={count!r}"
        )
    return values


def _initialize_processes(coordinator_address, num_processes, process_id):
    """`keras.distribution.initialize`, once per program, before JAX initialises."""
    import jax

    if jax.distributed.is_initialized():
        return
    try:
        # With no settings at all, JAX looks for a cluster it knows (SLURM,
        # Open MPI, Cloud TPU) by itself.
        keras.distribution.initialize(coordinator_address, num_processes, process_id)
    except (RuntimeError, ValueError) as error:
        raise RuntimeError(
            "Could not start the JAX process group for kind='multi-worker'. Give every process the "
            "coordinator's address (process 0, 'host:port'), the number of processes and its own id "
            "(--coordinator-address, --num-processes, --process-id, or KERAS_DISTRIBUTION_JOB_ADDRESSES, "
            "KERAS_DISTRIBUTION_NUM_PROCESSES, KERAS_DISTRIBUTION_PROCESS_ID), before anything creates a "
            f"JAX array. Received: coordinator_address={coordinator_address!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}: {error}"
        ) from error


def _is_data_parallel(strategy):
    """A `keras.distribution.DataParallel` (what `make_strategy` gives on JAX)."""
    return keras.backend.backend() == "jax" and isinstance(strategy, keras.distribution.DataParallel)


def _distribution_scope(strategy):
    """`strategy.scope()` for a `keras.distribution`; a no-op otherwise.

    On JAX the distribution must be set while the model is built (its
    variables are replicated over the devices) and while `fit` runs (each
    batch is split over them), so `train` holds it for both.
    """
    if _is_data_parallel(strategy):
        return strategy.scope()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _without_distribution():
    """Unsets the JAX `keras.distribution` while the chief alone saves.

    Keras' saver creates a throw-away optimizer variable; under a
    multi-process distribution, placing it on the devices is a collective
    the other processes never join, so the chief would wait forever.
    Reading the replicated weights needs no distribution.
    """
    current = keras.distribution.distribution() if keras.backend.backend() == "jax" else None
    if current is None:
        yield
        return
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(current)
