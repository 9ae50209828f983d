"""Converts a `HierarchicalVAE` weight file from the layout before `PriorCell`/`PosteriorCell`.

The old file is read by the code of that time (`--revision`, extracted with
`git archive` into a temporary folder and run in a child process), which
writes every variable by its path and the model's per-image ELBO terms on
the 100 shipped MNIST test images (random images for RGB models) under a
fixed sampling state. The current model gets the
same values by `keras_avae.models.weight_layout.legacy_variable_key`; the
conversion is written only if every variable is matched once, shapes
agree and the new model computes the same ELBO terms (rtol 1e-5). It
prints their mean, the figure a model card records as
`shipped_sample_nelbo_nats`.

Usage (from a keras-avae git checkout):
    python tools/convert_weights_layout.py OLD.weights.h5 NEW.weights.h5 \\
        --config mnist-attentive-small      # a zoo entry, or a run.json / config.json
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's keras_avae
# The last commit with the old layout.
DEFAULT_REVISION = "c8f1795"

_DUMP = """
import json, sys
import numpy as np
import keras
from keras_avae.models import HierarchicalVAE
config = json.loads(open(sys.argv[1]).read())
model = HierarchicalVAE.from_config(config)
model.build()
model.load_weights(sys.argv[2])
x = np.load(sys.argv[3])
model.seed_generator.state.assign(keras.ops.convert_to_tensor(np.array([7, 0]), model.seed_generator.state.dtype))
out = model(keras.ops.convert_to_tensor(x), training=False)
terms = keras.ops.convert_to_numpy(out["nll"]) + keras.ops.convert_to_numpy(out["kl"])
arrays = {"__model_name__": np.array(model.name), "__terms__": terms}
for v in model.weights:
    arrays["var:" + v.path] = keras.ops.convert_to_numpy(v)
np.savez(sys.argv[4], **arrays)
"""


def read_config(spec):
    path = pathlib.Path(spec)
    if path.is_file():
        data = json.loads(path.read_text())
        return data.get("config", data)
    from keras_avae import zoo

    return zoo.describe(spec)["config"]


def dump_old(old_path, config, images, revision, workdir):
    source = workdir / "old"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "keras_avae"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    (workdir / "config.json").write_text(json.dumps(config))
    np.save(workdir / "x.npy", images)
    out = workdir / "old.npz"
    env = {**os.environ, "PYTHONPATH": str(source), "KERAS_BACKEND": "tensorflow"}
    subprocess.run(
        [sys.executable, "-c", _DUMP, str(workdir / "config.json"), str(old_path), str(workdir / "x.npy"), str(out)],
        check=True,
        cwd=str(source),
        env=env,
    )
    return dict(np.load(out))


def convert(old_path, new_path, config, revision=DEFAULT_REVISION):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    from keras_avae import datasets
    from keras_avae.models import HierarchicalVAE
    from keras_avae.models.weight_layout import legacy_variable_key

    if config["image_shape"][-1] == 1:
        images = datasets.mnist_test_sample(100)  # the shipped test images
    else:
        rng = np.random.default_rng(0)
        images = (rng.integers(0, 256, (100, *config["image_shape"])) / 127.5 - 1.0).astype("float32")
    with tempfile.TemporaryDirectory() as tmp:
        old = dump_old(old_path, config, images, revision, pathlib.Path(tmp))
    old_name = str(old.pop("__model_name__"))
    old_terms = old.pop("__terms__")
    old_values = {legacy_variable_key(k[len("var:") :], old_name): v for k, v in old.items()}

    model = HierarchicalVAE.from_config(config)
    model.build()
    unmatched = dict(old_values)
    for variable in model.weights:
        key = legacy_variable_key(variable.path, model.name)
        if key not in unmatched:
            raise ValueError(f"{variable.path}: no variable {key!r} in {old_path}")
        value = unmatched.pop(key)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"{variable.path}: shape {variable.shape} in the model, {value.shape} in {old_path}")
        variable.assign(value)
    if unmatched:
        raise ValueError(f"{old_path}: variables with no place in the new model: {sorted(unmatched)}")
    state = model.seed_generator.state
    state.assign(keras.ops.convert_to_tensor(np.array([7, 0]), state.dtype))
    out = model(keras.ops.convert_to_tensor(images), training=False)
    terms = keras.ops.convert_to_numpy(out["nll"]) + keras.ops.convert_to_numpy(out["kl"])
    np.testing.assert_allclose(terms, old_terms, rtol=1e-5)
    model.save_weights(str(new_path))
    return float(np.max(np.abs(terms - old_terms))), float(np.mean(old_terms))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--config", required=True, help="zoo entry name, run.json or config.json")
    parser.add_argument("--revision", default=DEFAULT_REVISION, help="a git revision with the old layout")
    args = parser.parse_args(argv)
    difference, mean = convert(args.old, args.new, read_config(args.config), args.revision)
    print(
        f"{args.new}: written. Negative ELBO on the 100 shipped test images, sampling state (7, 0): "
        f"{mean:.4f} nats with the old file and code; per image the new file gives the same within {difference:.2e}"
    )


if __name__ == "__main__":
    main()
