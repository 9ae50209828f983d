"""The wheel holds every module, the shipped samples and the zoo, and works installed.

`pyproject.toml` lists its packages by hand (the zoo's folder is mapped to
`keras_avae.zoo_data`), so a new subpackage or data file left out of it would
be missing only for users who install the wheel, never in the editable
checkout the other tests import.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest

import keras_avae

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run in a process that imports keras_avae from the installed wheel only.
INSTALLED_CHECK = """
import json, pathlib, sys
import keras_avae
from keras_avae import datasets, zoo
where = pathlib.Path(keras_avae.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), where
samples = {name: datasets.shipped_sample(name, 100).tolist() for name in ("mnist", "omniglot", "cifar10")}
model = zoo.load("mnist-baseline-small")
print(json.dumps({
    "trained": [name for name in zoo.names() if zoo.has_pretrained(name)],
    "samples": samples,
    "weight_sums": [float(w.sum()) for w in model.get_weights()],
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="packaging does not depend on the backend")
def test_wheel_holds_every_module_and_data_file_and_works_installed(tmp_path):
    source = tmp_path / "source"  # setuptools writes build/ and *.egg-info into the tree
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("keras_avae", "zoo"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    done = subprocess.run(build + [str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "BuildBackendWarning" not in done.stderr, done.stderr[-4000:]
    (wheel,) = wheels.glob("keras_avae-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = set(archive.namelist())

    expected = {p.relative_to(source).as_posix() for p in (source / "keras_avae").rglob("*.py")}
    expected |= {p.relative_to(source).as_posix() for p in (source / "keras_avae" / "data").iterdir()}
    expected |= {f"keras_avae/zoo_data/{p.name}" for p in (source / "zoo").iterdir() if p.is_file()}
    assert not expected - packed, f"missing from the wheel: {sorted(expected - packed)}"

    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site)]
    done = subprocess.run(install + [str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED_CHECK, str(site)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    installed = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = sorted(p.name.removesuffix(".weights.h5") for p in (ROOT / "zoo").glob("*.weights.h5"))
    assert sorted(installed["trained"]) == shipped
    for name, images in installed["samples"].items():
        np.testing.assert_array_equal(np.array(images), keras_avae.datasets.shipped_sample(name, 100), err_msg=name)
    # The installed zoo's weights are the checkout's.
    here = [float(w.sum()) for w in keras_avae.zoo.load("mnist-baseline-small").get_weights()]
    assert installed["weight_sums"] == here
