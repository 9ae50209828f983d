"""Tests of the `keras-avae` command line on generated MNIST files.

Every user mistake must end with status 2 and one line on stderr; the
commands themselves run end to end on a tiny model (`--set` overrides).
"""

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from keras_avae import cli, zoo
from keras_avae.cli import parser as cli_parser
from keras_avae.cli import sample as cli_sample
from tests.test_case import backend_independent
from tests.test_datasets import make_mnist_dir
from tests.test_training import decode_png

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")

# A tiny mnist-baseline-small: 32x32 input, two stochastic layers, 4 filters.
TINY_SETS = [
    "num_layers=2",
    "latent_channels=2",
    "preprocess_filters=4",
    "decoder_filters=4",
]


def sets(values):
    return [arg for value in values for arg in ("--set", value)]


def tiny_overrides():
    """`TINY_SETS` as `zoo.load` keyword arguments."""
    return {key: int(value) for key, value in (s.split("=") for s in TINY_SETS)}


def run_main(argv, capsys):
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("keras-avae"), lines[0]
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_zoo_lists_every_entry_with_its_description(capsys):
    status, out, _ = run_main(["zoo"], capsys)
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == len(zoo.names())
    for name, line in zip(zoo.names(), lines):
        assert line.startswith(name)
        assert zoo.describe(name)["description"][:40] in line
        assert ("[pretrained]" in line) == zoo.has_pretrained(name)


def test_unknown_name_is_one_line_status_2(tmp_path, capsys):
    status, _, err = run_main(["evaluate", "mnist-nope", "--weights", "x.h5", "--data-dir", str(tmp_path)], capsys)
    assert status == 2
    assert_one_line_error(err, "'mnist-nope'", "mnist-attentive")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "mnist-baseline", "--data-dir", "d", "--output", "o", "--epochs", "-3"], "'-3'"),
        (["train", "mnist-baseline", "--data-dir", "d"], "--output"),
        (["sample", "mnist-baseline", "--weights", "w", "--out", "o.png", "--temperature", "zero"], "'zero'"),
        (["sample", "mnist-baseline", "--weights", "w", "--out", "o.png", "--temperature", "inf"], "'inf'"),
        (["evaluate", "mnist-baseline", "--weights", "w", "--data-dir", "d", "--num-samples", "nan"], "'nan'"),
        (["train", "mnist-baseline", "--data-dir", "d", "--output", "o", "--strategy", "tpu"], "'tpu'"),
        (["train", "mnist-baseline", "--data-dir", "d", "--output", "o", "--save-freq", "0"], "--save-freq"),
        (["train", "mnist-baseline", "--data-dir", "d", "--output", "o", "--save-freq", "often"], "'often'"),
        (["frobnicate"], "'frobnicate'"),
        # Checked before anything loads (it was refused after the data and model, or by the dataset).
        (["evaluate", "mnist-baseline", "--weights", "w", "--data-dir", "d", "--seed", "-1"], "[0, 2**20)"),
        (["evaluate", "mnist-baseline", "--weights", "w", "--data-dir", "d", "--seed", "1048576"], "'1048576'"),
        (["evaluate", "mnist-baseline", "--weights", "w", "--data-dir", "d", "--chunk-size", "0"], "'0'"),
        # The model's seed too: up to 2**31 - 2 (it failed after the images were read and hashed).
        (["train", "mnist-baseline", "--data-dir", "d", "--output", "o", "--seed", "2147483647"], "[0, 2**31 - 1)"),
        (["sample", "mnist-baseline", "--weights", "w", "--out", "o.png", "--seed", "2147483647"], "'2147483647'"),
        (["demo", "--seed", "1048576"], "[0, 2**20)"),
        (["report", "mnist-attentive-small", "--out", "o", "--data-dir", "d", "--seed", "-1"], "[0, 2**31)"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


def test_a_plain_ctrl_c_says_interrupted(monkeypatch, capsys):
    # `str(KeyboardInterrupt())` is empty: the line read "keras-avae zoo: ".
    def stop(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli._COMMANDS, "zoo", stop)
    status, _, err = run_main(["zoo"], capsys)
    assert status == 130 and err.strip() == "keras-avae zoo: interrupted"


def test_demo_of_an_untrained_entry_names_the_trained_ones(tmp_path, capsys):
    status, _, err = run_main(["demo", "--name", "cifar10-baseline", "--out", str(tmp_path / "d")], capsys)
    assert status == 2
    assert_one_line_error(err, "'cifar10-baseline'", "mnist-attentive-small")
    assert not (tmp_path / "d").exists()


def test_missing_files_and_folders(tmp_path, capsys):
    status, _, err = run_main(
        ["train", "mnist-baseline", "--data-dir", str(tmp_path / "none"), "--output", str(tmp_path / "o")], capsys
    )
    assert status == 2
    assert_one_line_error(err, "--data-dir", "none")

    status, _, err = run_main(["sample", "mnist-baseline", "--weights", str(tmp_path / "w.h5"), "--out", "s.png"], capsys)
    assert status == 2
    assert_one_line_error(err, "--weights", "w.h5")

    # A data folder without the MNIST files: the loader's message, one line.
    status, _, err = run_main(
        ["train", "mnist-baseline", "--data-dir", str(tmp_path), "--output", str(tmp_path / "o")], capsys
    )
    assert status == 2
    assert_one_line_error(err, "train-images-idx3-ubyte")

    status, _, err = run_main(["sample", "mnist-baseline", "--weights", "pretrained", "--out", "s.png"], capsys)
    assert status == 2
    assert_one_line_error(err, "no pretrained weights", "mnist-baseline")

    status, _, err = run_main(
        ["sample", "mnist-baseline", "--weights", "pretrained", "--out", str(tmp_path / "s.jpg")], capsys
    )
    assert status == 2
    assert_one_line_error(err, "--out", "s.jpg")


def test_report_out_that_is_a_file_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    # Before: "FileExistsError: [Errno 17] File exists", after the model and data had loaded.
    from keras_avae.cli import report as cli_report

    def no_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_report, "_load_model", no_load)
    page = tmp_path / "report.html"
    page.write_text("mine")
    status, _, err = run_main(
        ["report", "mnist-attentive-small", "--weights", "pretrained", "--data-dir", str(tmp_path), "--out", str(page)],
        capsys,
    )
    assert status == 2
    assert_one_line_error(err, "`--out` must be a folder", "not a file", f"Received: --out {str(page)!r}")
    assert page.read_text() == "mine"


def test_report_run_of_another_entry_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    # Before: the baseline run's curves were drawn beside the attentive model's figures, silently.
    from keras_avae.cli import report as cli_report

    def no_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_report, "_load_model", no_load)
    run = tmp_path / "run"
    run.mkdir()
    (run / "history.csv").write_text("epoch,loss\n1,2.0\n")
    (run / "run.json").write_text(json.dumps({"model": "mnist-baseline-small", "config": {"num_layers": 2}}))
    argv = ["report", "mnist-attentive-small", "--weights", "pretrained", "--data-dir", str(tmp_path),
            "--out", str(tmp_path / "out"), "--run", str(run)]
    status, _, err = run_main(argv, capsys)
    assert status == 2
    assert_one_line_error(err, "--run", "'mnist-baseline-small'", "'mnist-attentive-small'")
    assert not (tmp_path / "out").exists()


def test_corrupt_weights_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "broken.weights.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 64)
    status, _, err = run_main(
        ["sample", "mnist-baseline", "--weights", str(bad), "--out", str(tmp_path / "s.png")] + sets(TINY_SETS),
        capsys,
    )
    assert status == 2
    assert_one_line_error(err, "broken.weights.h5")


def test_console_module_reports_without_traceback():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "keras_avae.cli", "sample", "mnist-nope", "--weights", "w", "--out", "o.png"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "keras-avae sample: error: unknown zoo entry 'mnist-nope'" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(BACKEND == "torch", reason="the CLI run is covered on tensorflow and jax; torch trains in test_training")
def test_train_evaluate_sample_end_to_end(tmp_path, capsys):
    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=16, n_test=6)
    out = tmp_path / "run"
    train = ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--epochs", "2"]
    train += ["--steps-per-epoch", "2", "--batch-size", "4", "--verbose", "0"]
    train += sets(TINY_SETS + ["warmup_epochs=1", "kl_warmup_epochs=1"])
    status, _, err = run_main(train, capsys)
    assert status == 0, err
    assert "Trained mnist-baseline-small in" in err
    weights = out / "model.weights.h5"
    assert weights.is_file() and (out / "history.csv").is_file()
    run = json.loads((out / "run.json").read_text())
    assert run["epochs"] == 2 and run["config"]["num_layers"] == 2
    # The same command again trains nothing and says so (before: "Trained ...").
    status, _, err = run_main(train, capsys)
    assert status == 0 and "Nothing to train" in err and "Trained" not in err, err

    evaluate = [
        "evaluate",
        "mnist-baseline-small",
        "--weights",
        str(weights),
        "--data-dir",
        str(data),
        "--limit",
        "5",
        "--batch-size",
        "2",
        "--progress",
        str(tmp_path / "eval.npz"),
    ] + sets(TINY_SETS)
    status, printed, err = run_main(evaluate + ["--num-samples", "3", "--verbose", "1"], capsys)
    assert status == 0, err
    result = json.loads(printed)
    assert result["num_examples"] == 5 and result["num_samples"] == 3 and result["resumed_images"] == 0
    assert err.count("evaluate: ") == 3  # a progress line per batch: 2 + 2 + 1 images
    with np.load(tmp_path / "eval.npz") as progress:
        identity = json.loads(str(progress["identity"]))
    # Each backend draws its own samples: a file is resumed on its own backend only.
    assert identity.get("backend") == (None if BACKEND == "tensorflow" else BACKEND)
    # Run again on the same progress file: nothing left to score, same figures.
    status, printed, err = run_main(evaluate + ["--num-samples", "3"], capsys)
    assert status == 0, err
    again = json.loads(printed)
    assert again["resumed_images"] == 5 and again["nll_nats"] == result["nll_nats"]
    # The file belongs to a K=3 run; a K=4 run must not mix into it.
    status, _, err = run_main(evaluate + ["--num-samples", "4"], capsys)
    assert status == 2
    assert_one_line_error(err, "num_samples: file 3, this run 4", "eval.npz")
    # Another subset of the split (--every) is another evaluation too.
    status, _, err = run_main(evaluate + ["--num-samples", "3", "--every", "2"], capsys)
    assert status == 2
    assert_one_line_error(err, "every: file None, this run 2", "eval.npz")
    other_file = [str(tmp_path / "every.npz") if a == str(tmp_path / "eval.npz") else a for a in evaluate]
    status, printed, err = run_main(other_file + ["--num-samples", "3", "--every", "4"], capsys)
    assert status == 0, err
    assert json.loads(printed)["num_examples"] == 2  # images 0 and 4 of the 6
    assert math.isfinite(result["nll_nats"]) and result["nll_nats"] > 0
    # 28x28 Bernoulli pixels after the 2-pixel crop.
    assert result["bits_per_dim"] == pytest.approx(result["nll_nats"] / (784 * math.log(2)))
    # The importance-sampled bound is at least as tight as the ELBO on average
    # up to Monte Carlo noise; with K=3 only a loose check is fair.
    assert -result["elbo_nats"] > 0

    png = tmp_path / "samples.png"
    status, _, err = run_main(
        ["sample", "mnist-baseline-small", "--weights", str(weights), "--num", "5", "--out", str(png)]
        + sets(TINY_SETS),
        capsys,
    )
    assert status == 0, err
    grid = decode_png(png.read_bytes())
    # 5 samples on a 2-row, 3-column grid of 28x28 crops, 1-pixel borders.
    assert grid.shape == (2 * 29 + 1, 3 * 29 + 1, 1)
    assert grid[1:29, 1:29].std() > 0

    # The sampling seed is --seed, not a model override.
    sample = ["sample", "mnist-baseline-small", "--weights", str(weights), "--num", "2", "--out", str(png)]
    status, _, err = run_main(sample + sets(TINY_SETS + ["seed=3"]), capsys)
    assert status == 2
    assert_one_line_error(err, "--set seed", "--seed")
    # Non-finite samples (a temperature that overflows float32) are an
    # error, not black images.
    png.unlink()
    status, _, err = run_main(sample + ["--temperature", "1e39"] + sets(TINY_SETS), capsys)
    assert status == 2
    assert_one_line_error(err, "FloatingPointError", "2 of the 2 samples hold non-finite values: at temperature=1e+39")
    assert not png.exists()
    # Weights loaded into a model its run did not train (same shapes, other
    # FAVOR+ features here) are refused, with the --set that loads them as trained.
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps(dict(record, config=dict(record["config"], nonlocal_feature_seed=5))))
    status, _, err = run_main(sample + sets(TINY_SETS), capsys)
    assert status == 2
    assert_one_line_error(err, "nonlocal_feature_seed=5 (this model: 0)", "--set nonlocal_feature_seed=5")
    assert run_main(sample + sets(TINY_SETS + ["nonlocal_feature_seed=5"]), capsys)[0] == 0
    # Without the run's architecture --set the weights do not fit: the same
    # hint, not Keras's error (8 KB of variable values on one line).
    status, _, err = run_main(sample, capsys)
    assert status == 2
    assert_one_line_error(err, "records another configuration: num_layers=2 (this model: 4)", "--set num_layers=2")
    assert "without error" not in err and len(err) < 600


@backend_independent("binarising and batching are NumPy; scoring is tested on each backend in test_evaluation")
def test_evaluate_binarises_the_train_split_once(tmp_path, capsys):
    """`--split train` scores every image, the same binary ones whatever the batch size (dynamic draws would not)."""
    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=8, n_test=2)
    model = zoo.load("mnist-baseline-small", weights=None, **tiny_overrides())
    weights = tmp_path / "fresh.weights.h5"
    model.save_weights(str(weights))
    pixel_sums, counts = [], []
    for batch_size in ("2", "4", "3"):
        progress = tmp_path / f"train-{batch_size}.npz"
        argv = ["evaluate", "mnist-baseline-small", "--weights", str(weights), "--data-dir", str(data), "--split"]
        argv += ["train", "--batch-size", batch_size, "--num-samples", "1", "--progress", str(progress)]
        status, _, err = run_main(argv + sets(TINY_SETS), capsys)
        assert status == 0, err
        with np.load(progress) as scored:
            pixel_sums.append(scored["checksums"])
            counts.append(len(scored["log_px"]))
    # Batch by batch: two batches of 2 hold the images of one batch of 4.
    np.testing.assert_array_equal(pixel_sums[0].reshape(-1, 2).sum(axis=1), pixel_sums[1])
    # Batches of 3 end with a batch of 2, which the train split used to drop (6 images scored).
    assert counts == [8, 8, 8]
    np.testing.assert_allclose(pixel_sums[2].sum(), pixel_sums[1].sum())


@pytest.mark.slow
@backend_independent("the progress file's bookkeeping is NumPy; each backend's resumed score is in test_evaluation")
def test_evaluate_extends_a_smaller_limit_to_the_same_figures(tmp_path, capsys, monkeypatch):
    from keras_avae.cli import evaluate as cli_evaluate

    # One model for every run (the same weights file each time): its compiled
    # scoring functions are traced once, not once per command.
    models = []
    load = cli_evaluate._load_model

    def load_once(args):
        if not models:
            models.append(load(args))
        return models[0]

    monkeypatch.setattr(cli_evaluate, "_load_model", load_once)
    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=4, n_test=7)
    overrides = dict(s.split("=") for s in TINY_SETS)
    model = zoo.load("mnist-baseline-small", weights=None, **{k: int(v) for k, v in overrides.items()})
    weights = tmp_path / "fresh.weights.h5"
    model.save_weights(str(weights))
    evaluate = ["evaluate", "mnist-baseline-small", "--weights", str(weights), "--data-dir", str(data)]
    evaluate += ["--batch-size", "2", "--num-samples", "3"] + sets(TINY_SETS)

    def scores(progress, *flags):
        status, printed, err = run_main(evaluate + ["--progress", str(tmp_path / progress), *flags], capsys)
        assert status == 0, err
        return json.loads(printed), err

    first, _ = scores("grown.npz", "--limit", "4")  # two full batches
    assert first["num_examples"] == 4 and first["resumed_images"] == 0
    grown, err = scores("grown.npz", "--limit", "5")  # the 4 come from the file
    assert grown["num_examples"] == 5 and grown["resumed_images"] == 4
    assert "scored 4 images with --limit 4; continuing with --limit 5" in err
    fresh, _ = scores("fresh.npz", "--limit", "5")  # one uninterrupted run over the 5
    assert fresh["resumed_images"] == 0
    for key in ("nll_nats", "elbo_nats", "nll_stderr"):
        assert grown[key] == fresh[key], key
    # The file now holds batches of 2, 2 and 1: another image would join the
    # short last batch, so it cannot grow; nor can it shrink.
    refusals = {
        "7": ("short last batch", "5 images in 3 batches", "--limit 7"),
        "4": ("different evaluation", "limit: file 5, this run 4"),
    }
    for limit, fragments in refusals.items():
        status, _, err = run_main(evaluate + ["--progress", str(tmp_path / "grown.npz"), "--limit", limit], capsys)
        assert status == 2
        assert_one_line_error(err, *fragments)
    # --chunk-size is recorded: a file grows only with the same value.
    chunked, _ = scores("chunked.npz", "--limit", "4", "--chunk-size", "2")
    grown, _ = scores("chunked.npz", "--limit", "5", "--chunk-size", "2")
    assert grown["resumed_images"] == 4 and grown["num_examples"] == 5
    status, _, err = run_main(evaluate + ["--progress", str(tmp_path / "chunked.npz"), "--limit", "6"], capsys)
    assert status == 2
    assert_one_line_error(err, "different evaluation", "chunk_size: file 2, this run None")


@pytest.mark.slow
@backend_independent("the command's own code; zoo weights are scored on JAX in test_zoo")
@pytest.mark.parametrize("name,source", [(None, "MNIST test images"), ("omniglot-baseline-small", "OMNIGLOT evaluation")])
def test_demo_scores_the_shipped_sample_and_draws_grids(tmp_path, capsys, name, source):
    out_dir = tmp_path / "demo"
    chosen = [] if name is None else ["--name", name]
    status, printed, err = run_main(
        ["demo", "--out", str(out_dir), "--num-images", "100", "--num-samples", "5"] + chosen, capsys
    )
    assert status == 0, err
    assert f"100 {source}" in printed
    nll = float(re.search(r"test NLL\s+([0-9.]+) nats", printed).group(1))
    card = zoo.describe(name or "mnist-attentive-small")["results"]
    # The card's figure on the same 100 shipped images (their mean negative
    # ELBO, not the test set's NLL: OMNIGLOT's shipped images come from one
    # of its hardest alphabets): K = 5 tightens the bound by a few nats, and the
    # latent draws differ by about a nat.
    gain = card["shipped_sample_nelbo_nats"] - nll
    assert -2 < gain < 15, (nll, card["shipped_sample_nelbo_nats"])
    card_line = f"{card['test_nll_nats']:.2f} nats on {card['test_images']} test images with K={card['importance_samples']};"
    assert card_line in printed
    assert f"{card['shipped_sample_nelbo_nats']:.2f} nats on the 100 shipped images" in printed

    samples = decode_png((out_dir / "samples.png").read_bytes())
    assert samples.shape == (8 * 29 + 1, 8 * 29 + 1, 1)
    grid = decode_png((out_dir / "reconstructions.png").read_bytes()).astype("float32") / 255
    assert grid.shape == (8 * 29 + 1, 8 * 29 + 1, 1)  # 32 images and their reconstructions, 8 a row
    images, recons = grid[1:29], grid[30:58]
    # The trained model reconstructs the images it is shown (a fresh one
    # gives grey noise, about 0.5 from every pixel).
    assert np.abs(images - recons).mean() < 0.12


# ---------------------------------------------------------------------- #
# --set follows zoo.load's rules
# ---------------------------------------------------------------------- #


def _sample_with(tmp_path, capsys, monkeypatch, extra_sets, png="s.png"):
    """Runs `sample mnist-gumbel-small --weights pretrained`; returns (status, err, model, png bytes)."""
    loaded = {}
    save_grid = cli_sample._save_grid

    def capture(path, model, rows):
        loaded["model"] = model
        save_grid(path, model, rows)

    monkeypatch.setattr(cli_sample, "_save_grid", capture)  # where `sample` looks it up
    out = tmp_path / png
    status, _, err = run_main(
        ["sample", "mnist-gumbel-small", "--weights", "pretrained", "--num", "4", "--out", str(out)]
        + sets(extra_sets),
        capsys,
    )
    return status, err, loaded.get("model"), out.read_bytes() if out.is_file() else None


@pytest.mark.skipif(BACKEND == "torch", reason="zoo models are supported on TensorFlow and JAX")
def test_set_keeps_pretrained_weights_for_neutral_and_same_value_keys(tmp_path, capsys, monkeypatch):
    from tests.models.test_zoo import has_pretrained_weights, model_arrays

    status, err, plain, plain_png = _sample_with(tmp_path, capsys, monkeypatch, [], "plain.png")
    assert status == 0, err
    status, err, model, png = _sample_with(
        tmp_path, capsys, monkeypatch, ["l2=0.01", "hidden_units=256", "image_shape=[32,32,1]"]
    )
    assert status == 0, err
    assert has_pretrained_weights(model, "mnist-gumbel-small")  # against the file itself
    assert png == plain_png  # the same function, the same seed: the same samples
    # Python, with the same overrides, gives the same model.
    python = zoo.load("mnist-gumbel-small", seed=0, l2=0.01, hidden_units=256, image_shape=[32, 32, 1])
    assert model_arrays(python) == model_arrays(model)
    same_config = ({**m.get_config(), "name": None} for m in (model, python))
    assert next(same_config) == next(same_config)


@pytest.mark.skipif(BACKEND == "torch", reason="zoo models are supported on TensorFlow and JAX")
def test_set_that_changes_the_architecture_is_refused_like_python(tmp_path, capsys, monkeypatch):
    status, err, model, png = _sample_with(tmp_path, capsys, monkeypatch, ["hidden_units=128", "l2=0.01"])
    assert status == 2 and model is None and png is None
    assert_one_line_error(err, "hidden_units=128 (entry: 256)")
    assert "l2" not in err
    with pytest.raises(ValueError) as info:
        zoo.load("mnist-gumbel-small", weights="pretrained", seed=0, hidden_units=128, l2=0.01)
    assert " ".join(str(info.value).split()) in err


# ---------------------------------------------------------------------- #
# Start-up: no framework for --help and argument errors, no log noise
# ---------------------------------------------------------------------- #

FRAMEWORKS = {"keras", "tensorflow", "jax", "jaxlib", "torch", "tensorflow_probability", "tensorflow_datasets"}
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "keras-avae")


def imported_packages(command, env=None):
    """Runs `python -X importtime COMMAND...`; returns (process, top-level packages imported)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *command], capture_output=True, text=True, env=env, timeout=300
    )
    packages = {
        line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time:")
    }
    return proc, packages


@pytest.mark.parametrize(
    "argv, status",
    [
        (["--help"], 0),
        (["evaluate", "--help"], 0),
        (["zoo"], 0),
        (["sample", "mnist-nope", "--weights", "w", "--out", "o.png"], 2),
        (["sample", "mnist-gumbel-small", "--weights", "missing.h5", "--out", "o.png"], 2),
        (["train", "mnist-baseline", "--data-dir", "d", "--output", "o", "--epochs", "-3"], 2),
    ],
)
@pytest.mark.parametrize("launcher", ["module", "console_script"])
def test_help_and_argument_errors_import_no_framework(argv, status, launcher):
    if launcher == "module":
        command = ["-m", "keras_avae.cli", *argv]
    else:
        if not os.path.isfile(CONSOLE_SCRIPT):
            pytest.skip("keras-avae console script not installed next to this Python")
        command = [CONSOLE_SCRIPT, *argv]
    proc, packages = imported_packages(command)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert "keras_avae" in packages
    assert not packages & FRAMEWORKS, packages & FRAMEWORKS


def test_library_import_still_registers_every_module():
    # Outside the command line `import keras_avae` imports its modules, so
    # `.keras` files load after it (the layers and models register on import).
    code = (
        "import sys, keras_avae, keras; "
        "assert 'keras_avae.models.hierarchical_vae' in sys.modules; "
        "assert keras.saving.get_registered_object('keras_avae>HierarchicalVAE') is not None; "
        "print(keras_avae.layers.PerformerAttention.__name__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "PerformerAttention"


def test_help_shows_every_default():
    parser = cli_parser._build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        text = "".join(sub.format_help().split())  # argparse wraps lines at spaces and hyphens
        for action in sub._actions:
            if not action.option_strings or action.required or action.default == argparse.SUPPRESS:
                continue
            if action.default is None:
                assert "default" in action.help, (name, action.option_strings)
            elif not isinstance(action.default, bool):
                assert f"(default:{action.default})" in text, (name, action.option_strings)


TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} |absl::InitializeLog|oneDNN|cuda", re.IGNORECASE)


@pytest.mark.slow
@pytest.mark.skipif(BACKEND == "torch", reason="zoo models are supported on TensorFlow and JAX")
def test_commands_print_no_backend_log_lines_unless_asked(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if BACKEND == "jax":
        # Without a JAX cache of the user's, the command keeps its compiled
        # programs in the user's cache folder (quietly too).
        env = {k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    command = [sys.executable, "-m", "keras_avae.cli", "sample", "mnist-gumbel-small", "--weights", "pretrained"]
    quiet = subprocess.run(
        command + ["--num", "2", "--out", str(tmp_path / "q.png")], capture_output=True, text=True, env=env, timeout=300
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stderr.splitlines() == [f"Wrote 2 samples to {tmp_path / 'q.png'}"], quiet.stderr
    if BACKEND == "jax":
        assert len(os.listdir(tmp_path / "cache" / "keras-avae" / "jax")) > 10
    if BACKEND == "tensorflow":
        # The check sees the lines when they are there: --backend-logs shows them.
        loud = subprocess.run(
            command + ["--num", "2", "--out", str(tmp_path / "l.png"), "--backend-logs"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert loud.returncode == 0, loud.stderr[-2000:]
        assert any(TF_LOG_LINE.search(line) for line in loud.stderr.splitlines()), loud.stderr


@pytest.mark.slow
def test_sample_from_a_run_folder_prints_no_backend_log_lines(tmp_path):
    # The run.json check serialises the model's config, for which Keras
    # imports TensorFlow on every backend: on PyTorch its start-up lines showed.
    run = tmp_path / "run"
    run.mkdir()
    overrides = tiny_overrides()
    zoo.load("mnist-baseline-small", weights=None, **overrides).save_weights(str(run / "model.weights.h5"))
    (run / "run.json").write_text(json.dumps({"config": overrides}))
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    out = tmp_path / "q.png"
    command = [sys.executable, "-m", "keras_avae.cli", "sample", "mnist-baseline-small", "--weights"]
    command += [str(run / "model.weights.h5"), "--num", "2", "--out", str(out)] + sets(TINY_SETS)
    quiet = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stderr.splitlines() == [f"Wrote 2 samples to {out}"], quiet.stderr


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compilation cache")
def test_a_jax_cache_the_user_configured_is_kept():
    import jax

    from keras_avae.cli.backend import _keep_compiled_jax_programs

    configured = jax.config.jax_compilation_cache_dir  # the test session's JAX_COMPILATION_CACHE_DIR
    assert configured
    _keep_compiled_jax_programs()
    assert jax.config.jax_compilation_cache_dir == configured


def tiny_train_command(tmp_path):
    """`(run folder, keras-avae train argv)` on 16 made-up MNIST training images."""
    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=16, n_test=2)
    out = tmp_path / "run"
    return out, ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--verbose", "0"]


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--limit", "3", "--batch-size", "4"], ["`limit` too small", "limit=3", "batch_size=4"]),
        (
            ["--limit", "8", "--batch-size", "4", "--steps-per-epoch", "3"],
            ["steps_per_epoch=3", "limit=8", "2 batches"],
        ),
        (["--batch-size", "4", "--steps-per-epoch", "5"], ["steps_per_epoch=5", "the split has 16", "more images"]),
        # Before: "`limit` too small ... limit=None" and "a larger --limit", without a --limit.
        (["--batch-size", "32"], ["Too few training images: the split has 16", "more images", "limit=None"]),
    ],
)
def test_train_with_too_little_data_fails_before_training(tmp_path, capsys, flags, fragments):
    out, argv = tiny_train_command(tmp_path)
    status, _, err = run_main(argv + flags + sets(TINY_SETS), capsys)
    assert status == 2
    assert_one_line_error(err, "ValueError", *fragments)
    assert not (out / "run.json").exists() and not (out / "backup").exists()


def test_train_folder_in_use_and_signal_stop_are_one_line(tmp_path, capsys, monkeypatch):
    import signal

    import filelock

    from keras_avae import training

    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=16, n_test=2)
    out = tmp_path / "run"
    out.mkdir()
    argv = ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--batch-size", "4"]
    argv += ["--steps-per-epoch", "2"]
    argv += sets(TINY_SETS)
    # The folder's lock held by another holder (here this process, through
    # another descriptor; tests/test_training.py uses two processes).
    holder = filelock.FileLock(str(out / "run.lock"), timeout=0)
    with holder:
        (out / "run.lock").write_text(json.dumps({"pid": 4242, "host": "node-7"}))
        status, _, err = run_main(argv, capsys)
    assert status == 2
    assert_one_line_error(err, "RuntimeError", "in use by process 4242 on host node-7")

    def stopped(*args, **kwargs):
        raise training.TrainingInterrupted(signal.SIGTERM, "stopped by SIGTERM: checkpoint at epoch 1 of 2")

    monkeypatch.setattr(training, "train", stopped)
    status, _, err = run_main(argv, capsys)
    assert status == 143
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["keras-avae train: stopped by SIGTERM: checkpoint at epoch 1 of 2"]


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--set", "dataset=cifar10"], ["`dataset` describes the entry", "--data-dir", "dataset='cifar10'"]),
        (["--set", "replicas=7"], ["--strategy", "replicas=7"]),
        (["--set", "evaluation_importance_samples=5"], ["--num-samples", "evaluation_importance_samples=5"]),
        (["--set", "batch_size_per_replica=0"], ["batch_size_per_replica=0"]),
        (["--set", "augmentation=[\"vertical_flip\"]"], ["augmentation=['vertical_flip']"]),
        (["--set", "kl_min=1.5"], ["kl_min=1.5"]),
        (["--set", "max_nonfinite_steps=-1"], ["max_nonfinite_steps=-1"]),
        (["--epochs", "1", "--set", "epochs=2"], ["--epochs 1 and --set epochs=2 disagree"]),
    ],
)
def test_train_recipe_settings_are_checked_before_the_run_is_recorded(tmp_path, capsys, flags, fragments):
    out, argv = tiny_train_command(tmp_path)
    status, _, err = run_main(argv + ["--batch-size", "4"] + flags + sets(TINY_SETS), capsys)
    assert status == 2
    assert_one_line_error(err, *fragments)
    assert not (out / "run.json").exists()


def test_train_applies_the_recipe_augmentation_and_set_epochs(tmp_path, capsys, monkeypatch):
    from tests.test_datasets import make_cifar_folder

    from keras_avae import datasets
    from keras_avae import training
    from keras_avae.datasets import pipeline

    make_cifar_folder(tmp_path / "cifar", n=4)
    calls = {}
    real_dataset_from_arrays = pipeline._dataset_from_arrays

    # `make_dataset` on the split the command has read (once).
    def dataset_from_arrays(*args, **kwargs):
        calls["dataset"] = real_dataset_from_arrays(*args, **kwargs)
        calls["random_flip"] = kwargs.get("random_flip")
        return calls["dataset"]

    monkeypatch.setattr(pipeline, "_dataset_from_arrays", dataset_from_arrays)
    monkeypatch.setattr(training, "train", lambda name, stream, *args, **kwargs: calls.update(train=kwargs, stream=stream))
    argv = ["train", "cifar10-baseline-small", "--data-dir", str(tmp_path / "cifar"), "--output", str(tmp_path / "r")]
    argv += ["--batch-size", "4", "--set", "epochs=3", "--verbose", "0"]
    assert run_main(argv, capsys)[0] == 0
    calls["stream"](0)  # the data train() would read from its first batch
    # The recipe's horizontal flips reach the pipeline and the run's record.
    assert calls["random_flip"] is True and calls["train"]["data_info"]["random_flip"] is True
    assert calls["train"]["epochs"] == 3  # --set epochs=3 is --epochs 3
    batches = [np.asarray(batch) for batch in calls["dataset"].take(5)]
    images = np.asarray(datasets.load("cifar10", tmp_path / "cifar", "train")[0], "float32") / 127.5 - 1.0
    mirrored = images[:, :, ::-1]
    flipped = [np.any(np.all(np.isclose(image, mirrored), axis=(1, 2, 3))) for batch in batches for image in batch]
    assert any(flipped) and not all(flipped)
    # Without augmentation, no flips and nothing recorded.
    assert run_main(argv + ["--set", "augmentation=[]"], capsys)[0] == 0
    calls["stream"](0)
    assert calls["random_flip"] is False and "random_flip" not in calls["train"]["data_info"]


@backend_independent("the run record is checked in Python before any backend work")
def test_train_resumed_on_another_device_count_says_which_batch_size_works(tmp_path, capsys):
    """Before: only "batch_size: recorded 8, requested 4", global batches the user never typed."""
    from keras_avae.training.run_folder import _check_run_record

    out, argv = tiny_train_command(tmp_path)
    argv += ["--epochs", "1", "--steps-per-epoch", "1"] + sets(TINY_SETS)
    assert run_main(argv + ["--batch-size", "4"], capsys)[0] == 0
    # What `--batch-size 4 --strategy mirrored --cpu-devices 2` records: 4 x 2.
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps(dict(record, batch_size=8, replicas=2)))
    status, _, err = run_main(argv + ["--batch-size", "4"], capsys)
    assert status == 2
    assert_one_line_error(
        err, "batch_size: recorded 8, requested 4 (global batches: the per-replica --batch-size of "
        "`keras-avae train` times the replicas, 2 then, 1 now; --batch-size 8 gives 8; `train` takes the global "
        "batch: batch_size=8)"
    )
    status, _, err = run_main(argv + ["--batch-size", "8"], capsys)  # the hint's value resumes it
    assert status == 0 and "Nothing to train" in err, err
    # A global batch that the replicas now cannot make.
    (out / "run.json").write_text(json.dumps(dict(record, batch_size=10, replicas=2)))
    with pytest.raises(
        ValueError, match=r"requested 9 \(.*replicas, 2 then, 3 now; no --batch-size gives 10 on 3, nor does batch_size=10 split"
    ):
        _check_run_record(out / "run.json", dict(record, batch_size=9, replicas=3))


def test_train_stopped_mid_epoch_resumes_on_the_same_batches(tmp_path, capsys, monkeypatch):
    """A run stopped by SIGINT mid-epoch and resumed ends with the weights of an uninterrupted run.

    The data stream continues where it stopped (before, the resumed run
    started the data over: it saw the first batches again, and never the
    rest of the interrupted epoch).
    """
    import signal

    import h5py
    import keras

    from keras_avae import training

    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=16, n_test=2)
    real_train = training.train

    class StopAt(keras.callbacks.Callback):
        def __init__(self, batch):
            super().__init__()
            self.batch, self.seen = batch, 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == self.batch:
                signal.raise_signal(signal.SIGINT)

    def run(out, stop_at=None):
        monkeypatch.setattr(
            training, "train", lambda *a, **kw: real_train(*a, callbacks=[StopAt(stop_at)] if stop_at else [], **kw)
        )
        argv = ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--epochs", "2"]
        argv += ["--steps-per-epoch", "3", "--batch-size", "4", "--verbose", "0"]  # 4 batches of 4 per pass
        return run_main(argv + sets(TINY_SETS + ["warmup_epochs=1", "kl_warmup_epochs=1"]), capsys)[0]

    def weights(out):
        with h5py.File(out / "model.weights.h5") as f:
            arrays = []
            f.visititems(lambda name, obj: arrays.append((name, obj[()])) if isinstance(obj, h5py.Dataset) else None)
        return arrays

    assert run(tmp_path / "reference") == 0
    # The signal comes at the end of batch 1; the run stops after the step under way: epoch 1, step 2 of 3.
    assert run(tmp_path / "stopped", stop_at=1) == 130
    state = json.loads((tmp_path / "stopped" / "backup" / "checkpoint.json").read_text())
    assert (state["epoch"], state["step"]) == (0, 2), state
    assert run(tmp_path / "stopped") == 0
    reference, resumed = weights(tmp_path / "reference"), weights(tmp_path / "stopped")
    assert [name for name, _ in reference] == [name for name, _ in resumed]
    for (name, a), (_, b) in zip(reference, resumed):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # The resumed epoch's history row is the whole epoch's (before: the
    # means of its last step only, the one run after the resume).
    rows = {}
    for name in ("reference", "stopped"):
        with open(tmp_path / name / "history.csv") as f:
            rows[name] = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows["stopped"]] == ["1", "2"]
    for reference_row, resumed_row in zip(rows["reference"], rows["stopped"]):
        assert reference_row.keys() == resumed_row.keys()
        for key, value in reference_row.items():
            assert float(resumed_row[key]) == pytest.approx(float(value), rel=1e-5), key


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="MirroredStrategy (JAX: tests/test_jax_distribution.py)")
def test_train_on_two_mirrored_cpu_devices(tmp_path):
    """`keras-avae train --strategy mirrored --cpu-devices 2` trains end to end.

    Before: it crashed before training (a distributed dataset's
    `cardinality` is a value, not the method `train` called).
    """
    data = tmp_path / "mnist"
    data.mkdir()
    make_mnist_dir(data, n_train=16, n_test=2)
    out = tmp_path / "run"
    argv = ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--epochs", "1"]
    argv += ["--steps-per-epoch", "2", "--batch-size", "4", "--verbose", "0", "--strategy", "mirrored"]
    argv += ["--cpu-devices", "2"] + sets(TINY_SETS + ["warmup_epochs=1", "kl_warmup_epochs=1"])
    proc = subprocess.run(
        [sys.executable, "-m", "keras_avae.cli", *argv], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["replicas"] == 2 and run["batch_size"] == 8
    assert (out / "model.weights.h5").is_file()
    rows = (out / "history.csv").read_text().splitlines()
    assert len(rows) == 2 and all(math.isfinite(float(v)) for v in rows[1].split(",")[1:])
