"""Smoke tests of the scripts in examples/: each runs with `--quick` in a subprocess.

The subprocess inherits `KERAS_BACKEND`, so the same tests run on each
backend. To cover another example, add a `pytest.param` to `EXAMPLES`.
"""

import os
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

only_tensorflow_and_jax = pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="multi-device training runs on the TensorFlow and JAX backends only",
)

only_tensorflow = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the example is written for (and claims) TensorFlow only"
)

# (script in examples/, arguments besides --quick, texts its output must contain).
# "{tmp}" in an argument is replaced by a fresh temporary folder.
EXAMPLES = [
    pytest.param(
        "custom_layers.py",
        [],
        ["[classifier] test accuracy", "[sequence] test loss", "[subclass]", "[performer subclass]", "All checks passed."],
        id="custom_layers",
    ),
    pytest.param(
        "zoo_quickstart.py",
        ["--out", "{tmp}"],
        ["bits/dim", "samples.png", "reconstructions.png"],
        id="zoo_quickstart",
    ),
    pytest.param(
        "tune_mnist.py",
        ["--out", "{tmp}"],
        ["Search: 2 trials", "val_nelbo", "Best configuration retrained", "Test NLL"],
        id="tune_mnist",
        marks=only_tensorflow,
    ),
    pytest.param(
        "distributed_training.py",
        ["mirrored", "--cpu-devices", "2", "--output", "{tmp}"],
        ['"replicas": 2', '"iterations": 4'],
        id="distributed_mirrored",
        marks=only_tensorflow_and_jax,
    ),
    pytest.param(
        "distributed_training.py",
        ["launch", "--workers", "2", "--output", "{tmp}"],
        ['"strategy": "multi-worker"', '"chief": true', '"chief": false', "2 workers finished"],
        id="distributed_two_workers",
        marks=only_tensorflow_and_jax,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("script, arguments, expected_output", EXAMPLES)
def test_example_runs_quick(script, arguments, expected_output, tmp_path):
    command = [sys.executable, os.path.join(ROOT, "examples", script), "--quick"]
    command += [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]
    # The child inherits KERAS_BACKEND (and the rest of the environment).
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for text in expected_output:
        assert text in done.stdout, f"{text!r} is not in the output of {script}:\n{done.stdout}"
