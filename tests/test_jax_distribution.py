"""Data-parallel training on JAX through `keras.distribution`, without GPUs.

`make_strategy` gives a `keras.distribution.DataParallel` on JAX; XLA's host
platform device count gives the CPU 2 devices. JAX fixes that count, and
its process group, when it initialises, so the runs go through
`tests/training_helper.py` in fresh interpreters (as the tf.distribute
tests in `tests/test_training.py` do): one step on 2 devices equals one
device's step on the same global batch, a killed data-parallel run
resumes, and two processes on 127.0.0.1 train together. The argument
checks run in process, on every backend.
"""

import json
import os
import re
import signal

import keras
import numpy as np
import pytest

from keras_avae import cli
from keras_avae import training
from tests.test_case import free_ports
from tests.test_training import TINY
from tests.test_training import decode_png
from tests.test_training import helper  # noqa: F401  (the subprocess fixture)
from tests.test_training import history_epochs
from tests.test_training import result_of
from tests.test_training import wait_for

BACKEND = keras.backend.backend()
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution data parallelism is tested on JAX")


def local_cpu_devices():
    import jax

    return jax.local_device_count("cpu")


# ---------------------------------------------------------------------- #
# Arguments, in process
# ---------------------------------------------------------------------- #


@jax_only
def test_make_strategy_on_jax(monkeypatch):
    existing = local_cpu_devices()  # JAX is initialised in this process
    distribution = training.make_strategy("mirrored")
    assert isinstance(distribution, keras.distribution.DataParallel)
    assert training.num_replicas(distribution) == len(keras.distribution.list_devices())
    assert training.is_chief(distribution)
    if existing == 1:
        assert training.make_strategy("auto") is None
    assert training.make_strategy("one-device", cpu_devices=existing) is None  # the count in place: a no-op

    flags = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match=f"already initialised with {existing}.*--cpu-devices"):
        training.make_strategy("mirrored", cpu_devices=existing + 1)
    assert os.environ.get("XLA_FLAGS") == flags  # left as it was
    with pytest.raises(ValueError, match="cpu_devices=2"):
        training.make_strategy("multi-worker", cpu_devices=2)
    with pytest.raises(ValueError, match="kind='mirrored'.*num_processes=2"):
        training.make_strategy("mirrored", num_processes=2)
    with pytest.raises(ValueError, match="process_id=2"):
        training.make_strategy("multi-worker", coordinator_address="127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator_address='localhost'"):
        training.make_strategy("multi-worker", coordinator_address="localhost", num_processes=2, process_id=0)
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="KERAS_DISTRIBUTION_NUM_PROCESSES='two'"):
        training.make_strategy("multi-worker")


def test_make_distribution_checks_kind_and_cpu_devices_as_make_strategy_does():
    """Before: any `kind` gave a DataParallel, and a bad `cpu_devices` was named `num_devices`."""
    for make in (training.make_strategy, training.make_distribution):
        with pytest.raises(ValueError, match=r"`kind` must be one of .*Received: kind='ring'"):
            make("ring")
        for bad in (0, "2", True, np.True_, np.int64(0), 2.0):
            with pytest.raises(ValueError, match=rf"`cpu_devices` must be .*Received: cpu_devices={re.escape(repr(bad))}$"):
                make("mirrored", cpu_devices=bad)
    # A NumPy int (a sweep over np.arange) is a count, passed on as a Python int.
    from keras_avae.training.distribute import _check_kind_and_cpu_devices

    checked = _check_kind_and_cpu_devices("mirrored", np.int64(2))
    assert checked == 2 and type(checked) is int


@jax_only
def test_train_refuses_what_data_parallel_cannot_split(tmp_path):
    # Two entries of one device: the checks come before the mesh is used.
    distribution = keras.distribution.DataParallel(devices=["cpu:0", "cpu:0"])
    x = np.zeros((24, 8, 8, 1), "float32")
    kwargs = dict(strategy=distribution, config_overrides=TINY, verbose=0, tensorboard=False)
    with pytest.raises(ValueError, match="split evenly over the 2 devices. Received: batch_size=7"):
        training.train("mnist-baseline", x, tmp_path / "a", epochs=1, batch_size=7, **kwargs)
    with pytest.raises(ValueError, match="last batch of 5 images.*Received: dataset of 21 images"):
        training.train("mnist-baseline", x[:21], tmp_path / "b", epochs=1, batch_size=8, **kwargs)
    # Before: a raw jax IndivisibleError once training reached the short batch.
    import tensorflow as tf

    ragged = tf.data.Dataset.from_tensor_slices(x[:21]).batch(8)
    with pytest.raises(ValueError, match="split evenly over the 2 devices.*batches of unknown size"):
        training.train("mnist-baseline", ragged, tmp_path / "d", epochs=1, batch_size=8, **kwargs)
    outside = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(1)])  # one device
    with pytest.raises(ValueError, match="inside `distribution.scope\\(\\)`"):
        training.train(outside, x, tmp_path / "c", epochs=1, batch_size=8, strategy=distribution, verbose=0)


def test_cli_passes_the_distribution_flags_to_make_strategy(tmp_path, capsys):
    """Each backend refuses what it cannot do, in one line, before any data is read."""
    (tmp_path / "data").mkdir()
    base = ["train", "mnist-baseline-small", "--data-dir", str(tmp_path / "data"), "--output", str(tmp_path / "o")]
    if BACKEND == "jax":
        cases = [
            (["--cpu-devices", str(local_cpu_devices() + 1)], ["RuntimeError", "--cpu-devices", "already initialised"]),
            (
                ["--strategy", "multi-worker", "--coordinator-address", "127.0.0.1:1", "--num-processes", "2",
                 "--process-id", "2"],
                ["ValueError", "process_id=2"],
            ),
        ]
    elif BACKEND == "tensorflow":
        cases = [(["--num-processes", "2"], ["ValueError", "TF_CONFIG", "num_processes=2"])]
    else:
        cases = [(["--cpu-devices", "2"], ["ValueError", "cpu_devices=2"])]
    for flags, fragments in cases:
        status = cli.main(base + flags)
        err = capsys.readouterr().err
        assert status == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err
        for fragment in fragments:
            assert fragment in lines[0], (fragment, lines[0])


# ---------------------------------------------------------------------- #
# Subprocess runs: 2 host devices, SIGKILL, two processes
# ---------------------------------------------------------------------- #


@jax_only
@pytest.mark.slow
def test_step_on_two_host_devices_equals_one_device(tmp_path, helper):  # noqa: F811
    """One step on 2 devices (4 + 4 images) == one step on one device (8 images).

    Weights, batch-norm moving statistics and optimizer state agree up to
    float32 summation order. The control (one device on its own half, twice
    over) must differ, batch-norm statistics included, so the comparison can
    fail. Then a NaN in one device's share makes the whole step skip.
    """
    result = result_of(helper("jax-data-parallel-step", tmp_path / "state.json"))
    assert result["replicas"] == 2 and result["devices"] == [2, 2]  # every weight on both devices
    data = json.loads((tmp_path / "state.json").read_text())
    assert data["synchronized_batch_norm"] is False  # not needed: statistics are the global batch's
    losses, states = data["losses"], data["states"]
    # rel 1e-5: the sharded sum's order moves the loss by about 1e-6 relative on
    # AVX-512/AMX CPUs (4.6e-5 of 44.5); the control's loss is ~40x farther off.
    assert losses["parallel"] == pytest.approx(losses["single"], rel=1e-5)
    assert losses["half"] != pytest.approx(losses["single"], rel=1e-5)
    for group in ("trainable", "non_trainable", "optimizer"):
        pairs = list(zip(states["parallel"][group], states["single"][group]))
        assert len(pairs) == len(states["single"][group]) > 0
        for (path, a), (_, b) in pairs:
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=2e-5, err_msg=path)

    def largest_difference(group, to, paths=""):
        return max(
            np.max(np.abs(np.array(a) - np.array(b)))
            for (path, a), (_, b) in zip(states["single"][group], states[to][group])
            if np.size(a) and paths in path
        )

    assert largest_difference("optimizer", "half") > 1e-2
    assert largest_difference("non_trainable", "half", "moving_") > 1e-3  # the half's statistics differ
    assert data["nan_step"] == {"unchanged": True, "finite": True, "nonfinite_steps": 1, "iterations": 1}


@jax_only
@pytest.mark.slow
def test_killed_data_parallel_run_resumes(tmp_path, helper):  # noqa: F811
    """`--strategy auto` with 2 host devices: killed after a checkpoint, the same command finishes the run."""
    epochs, steps_per_epoch = 3, 3
    total = epochs * steps_per_epoch
    out = tmp_path / "run"
    command = ("train", out, epochs, "--strategy", "auto", "--cpu-devices", 2, "--save-freq", 2)
    process = helper(*command, env={"KAVAE_TEST_BATCH_DELAY": "0.5"})
    pointer = out / "backup" / "checkpoint.json"
    wait_for(pointer, process)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    state = json.loads(pointer.read_text())
    done = state["epoch"] * steps_per_epoch + state["step"]
    assert 0 < done < total and state["iterations"] == done

    resumed = result_of(helper(*command))
    assert resumed["replicas"] == 2 and resumed["devices"] == 2
    assert resumed["batches"] == total - done and resumed["iterations"] == total  # nothing lost or repeated
    assert resumed["kl_weight"] == pytest.approx(0.1 + 0.9 * 2 / 16) and resumed["finite"]
    assert json.loads((out / "run.json").read_text())["replicas"] == 2
    assert history_epochs(out) == ["1", "2", "3"]
    assert (out / "model.keras").is_file() and (out / "model.weights.h5").is_file()


@jax_only
@pytest.mark.slow
def test_two_processes_train_together_on_localhost(tmp_path, helper):  # noqa: F811
    """Process 0 gets its settings from flags, process 1 from Keras' environment variables (`auto`)."""
    (port,) = free_ports(1)
    out = tmp_path / "run"
    chief = helper(
        "train", out, 2, "--strategy", "multi-worker",
        "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", 2, "--process-id", 0,
    )
    environment = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    }
    worker = helper("train", out, 2, "--strategy", "auto", env=environment)
    results = [result_of(chief), result_of(worker)]
    assert [r["chief"] for r in results] == [True, False]
    for r in results:
        assert r["processes"] == 2 and r["replicas"] == 2 and r["devices"] == 2
        assert r["iterations"] == 2 * 3 and r["finite"]  # 24 images, global batches of 8
        assert r["kl_weight"] == pytest.approx(0.1 + 0.9 / 16)
    assert results[0]["weights_sum"] == results[1]["weights_sum"]  # one model, replicated
    assert (out / "model.keras").is_file() and (out / "backup" / "checkpoint.json").is_file()
    assert history_epochs(out) == ["1", "2"]
    grid = decode_png((out / "samples" / "epoch_0002.png").read_bytes())  # written by the chief alone
    assert grid.shape[0] > 1
