"""Smoke tests of the scripts in benchmarks/ (tiny sizes, current backend)."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.test_case import backend_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_attention_benchmark_runs():
    # One length keeps it to two fresh worker processes (each imports Keras).
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "attention.py")]
    command += ["--lengths", "64", "--repeats", "1", "--heads", "2", "--key-dim", "8", "--features", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| length |")))
    assert lines[header + 1].startswith("|---:")
    row = lines[header + 2].split("|")
    assert row[1].strip() == "64"
    # Both methods ran: times and memories are numbers, not statuses.
    for cell in (row[2], row[3], row[5], row[6]):
        float(cell)
    assert any(line.startswith("Crossover:") for line in lines)


def test_favor_product_layout_benchmark_runs():
    # The script itself checks that all layouts give the same gradients.
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "favor_product_layout.py"), "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    figures = done.stdout.splitlines()[-1].split()
    assert figures[0:6:2] == ["columns", "rows", "mixed"]
    assert all(float(figures[i]) > 0 for i in (1, 3, 5))
    assert figures[10].endswith("x,") and figures[12].endswith("x")


@backend_independent("a smoke test of the script; scoring on each backend is tested in test_evaluation")
def test_evaluation_speed_benchmark_runs():
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "evaluation_speed.py")]
    command += ["--names", "mnist-baseline-small", "--batch-size", "2", "--num-samples", "2", "--repeats", "1", "--tiny"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| mnist-baseline-small"))
    cells = row.split("|")
    assert float(cells[2]) > 0 and float(cells[3]) > 0


@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow",
    reason="a smoke test of the script, run once: on JAX its two processes compile for 80 s",
)
def test_inference_speed_benchmark_runs():
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "inference_speed.py"), "--tiny"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row[0].strip() for row in rows] == ["reconstruct", "encode", "sample", "elbo", "kl_per_layer"]
    for row in rows:
        assert all(float(cell) > 0 for cell in row[1:5]) and all(cell.strip().endswith("x") for cell in row[5:])


def _run_train_throughput(*extra):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "train_throughput.py")]
    command += ["--quick", "--entries", "mnist-baseline-small", *extra]
    # A session of its own: a timeout ends the script's measurement processes too.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, stderr[-2000:]
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| backend |"))
    for column in ("images/s", "GFLOP/s", "conv GFLOP/s", "fraction of conv", "first-step trace s", "train/bare"):
        assert f"| {column} |" in header
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "mnist-baseline-small" in line]
    assert not any(line.startswith("failed:") for line in lines), stdout
    return [[cell.strip() for cell in row] for row in rows]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow",
    reason="every figure comes from child processes; run once, on TensorFlow, to keep CI short",
)
def test_train_throughput_benchmark_against_a_revision(tmp_path):
    # HEAD as the old code: exercises the extraction, the old/new rows and
    # the `keras-avae train` per-step figure.
    path = tmp_path / "figures.json"
    old, new, ratio = _run_train_throughput("--baseline-rev", "HEAD", "--train-steps", "3", "--json", str(path))
    assert old[2].startswith("old (") and new[2].startswith("new") and ratio[2] == "**new vs old**"
    # images/s, step ms, GFLOP/s, conv GFLOP/s, fraction, trace, train ms/step, train/bare
    for row in (old, new):
        assert all(float(cell) > 0 for cell in row[3:]), row
    assert ratio[3].endswith("x")
    figures = json.loads(path.read_text())
    baseline = next(r for r in figures["results"] if r["version"] == "old")
    assert baseline["flops"] > 0 and baseline["rounds"]["step"][0]["keras_avae"] != os.path.join(ROOT, "keras_avae")


def _gpu_train(tmp_path, *extra, entry="omniglot-attentive-small", env=None):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_train.py"), "run", "--data", str(tmp_path / "data.npz")]
    command += ["--entry", entry, "--num-samples", "2", "--eval-seconds", "0.1", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    output = extra[list(extra).index("--output") + 1]
    return json.loads((pathlib.Path(output) / "results.json").read_text()), done.stderr


def _gpu_train_data(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    test = (rng.random((60, 32, 32, 1)) < 0.2).astype(np.uint8)
    np.savez(tmp_path / "data.npz", train_grey=rng.random((40, 28, 28, 1)).astype(np.float16), test=test, every=6)


def _check_learning_rates(training):
    """The rates the loop set before each logged step are the recipe's schedule at that step."""
    import numpy as np

    from keras_avae.training import make_schedule
    from keras_avae.training import resolve_recipe

    recipe = resolve_recipe(training["entry"], **training["recipe"])
    schedule = make_schedule(recipe, training["pseudo_epoch_steps"], recipe["epochs"])
    logged = [row["learning_rate"] for row in training["history"]]
    expected = [float(schedule(row["step"] - 1)) for row in training["history"]]
    np.testing.assert_allclose(logged, expected, rtol=1e-6)
    assert len(set(logged)) > 1  # the rate moved: it is set every step, not once


@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND", "tensorflow") != "torch",
    reason="the script runs on PyTorch or JAX (the GPU machine has no TensorFlow); this test runs once, "
    "in the torch session, and the JAX path has its own below",
)
def test_gpu_train_script_trains_saves_and_scores_resumably(tmp_path):
    import numpy as np

    import keras_avae

    _gpu_train_data(tmp_path)
    out = tmp_path / "out"
    results, _ = _gpu_train(
        tmp_path, "--output", str(out), "--batch-size", "4", "--train-seconds", "0.1", "--timing-steps", "1",
        "--steps-per-epoch", "2", "--log-every", "1", "--progress", str(out / "progress.npz"),
        "--throughput-entry", "mnist-baseline-small", "--deadline-seconds", "900", "--throughput-seconds", "1",
        "--throughput-warmup", "1", "--throughput-steps", "1",
    )
    training = results["training"]
    # At least one schedule "epoch"; each step's loss logged and finite; the timing steps' updates undone.
    assert training["steps"] == training["optimizer_iterations"] == 2 and training["images_seen"] == 8
    assert len(training["history"]) == 2 and all(np.isfinite(row["nelbo"]) for row in training["history"])
    _check_learning_rates(training)
    assert results["cifar10_throughput"]["images_per_second"] > 0
    # The float16 file of the trained weights loads into the entry's default model.
    weights = out / "omniglot-attentive-small.float16.weights.h5"
    model = keras_avae.zoo.load("omniglot-attentive-small", weights=str(weights))
    assert model.count_params() == training["parameters"]
    # The scoring budget ran out after the first batch of 25; a second call continues.
    first = results["evaluation"]
    assert first["images"] == 25 and first["resumed_images"] == 0 and np.isfinite(first["nll_nats"])
    again = _gpu_train(
        tmp_path, "--output", str(out), "--weights", str(weights), "--progress", str(out / "progress.npz"),
        "--no-cifar10",
    )[0]["evaluation"]
    assert again["images"] == 50 and again["resumed_images"] == 25
    assert again["weights_sha256"] == first["weights_sha256"]
    # `--init-weights` trains on from a float16 file: with a vanishing learning rate the trainable
    # weights come back as they went in (fresh weights would not).
    continued = tmp_path / "continued"
    training = _gpu_train(
        tmp_path, "--output", str(continued), "--init-weights", str(weights), "--learning-rate", "1e-20",
        "--kl-warmup-fraction", "0", "--batch-size", "4", "--train-seconds", "0.1", "--timing-steps", "1",
        "--steps-per-epoch", "2", "--no-cifar10", "--data-seed", "1", "--split-mib", "0.1", "--eval-seconds", "0",
    )[0]
    assert training["evaluation"] == {"skipped": "--eval-seconds 0"}  # trained and saved only
    training = training["training"]
    assert training["init_weights"] == str(weights) and training["recipe"]["kl_warmup_epochs"] == 0
    before = keras_avae.zoo.load("omniglot-attentive-small", weights=str(weights))
    after = keras_avae.zoo.load(
        "omniglot-attentive-small", weights=str(continued / "omniglot-attentive-small.float16.weights.h5")
    )
    for a, b in zip(before.trainable_weights, after.trainable_weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    # `--split-mib`: parts small enough to come back from the device, which join to the file.
    parts = sorted(continued.glob("*.part*"), key=lambda part: int(part.suffix[len(".part"):]))
    assert len(parts) > 1 and all(part.stat().st_size <= 0.1 * 2**20 for part in parts)
    joined = b"".join(part.read_bytes() for part in parts)
    assert joined == (continued / "omniglot-attentive-small.float16.weights.h5").read_bytes()


@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND", "tensorflow") != "jax",
    reason="the script's JAX path (XLA on the GPU); the PyTorch path has the test above",
)
def test_gpu_train_script_on_jax_compiles_the_training_step_once(tmp_path):
    import numpy as np

    import keras_avae

    _gpu_train_data(tmp_path)
    out = tmp_path / "out"
    # The smallest binary entry: two compiles (training, scoring) of a paper-size step take minutes.
    results, log = _gpu_train(
        tmp_path, "--output", str(out), "--batch-size", "4", "--train-seconds", "0.1", "--timing-steps", "1",
        "--steps-per-epoch", "4", "--log-every", "1", "--no-cifar10",
        # Every compile logged, none served from the session's persistent cache.
        entry="mnist-baseline-small", env={"JAX_LOG_COMPILES": "1", "JAX_ENABLE_COMPILATION_CACHE": "false"},
    )
    training = results["training"]
    assert results["backend"] == "jax" and training["steps"] == training["optimizer_iterations"] == 4
    assert training["warmup_seconds"] > training["timed_step_seconds"] > 0  # the compile is in the warm-up
    assert all(np.isfinite(row["nelbo"]) for row in training["history"])
    _check_learning_rates(training)
    # One XLA compile of the training step for the timing steps and the run, although the run's
    # length (so its schedule) was decided after timing the step.
    assert log.count("Finished XLA compilation of jit(train_step)") == 1, log[-3000:]
    model = keras_avae.zoo.load("mnist-baseline-small", weights=str(out / "mnist-baseline-small.float16.weights.h5"))
    assert model.count_params() == training["parameters"]
    assert results["evaluation"]["images"] == 25 and np.isfinite(results["evaluation"]["nll_nats"])
