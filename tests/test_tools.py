"""The maintainer tools in tools/ that write model cards."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fill_card  # noqa: E402
from keras_avae import evaluation  # noqa: E402
from fill_card import epoch_seconds  # noqa: E402


def test_epoch_seconds_sums_the_parts_of_a_stopped_and_resumed_epoch(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "Training step: tensorflow, tf.function graph without XLA on CPU.\n"
        "Epoch 1/3\n"
        "145/145 - 150s - 1s/step - loss: 3.0\n"
        "Epoch 2/3\n"
        "34/145 - 35s - 1s/step - loss: 2.5\n"
        "keras-avae train: stopped by SIGTERM: checkpoint at epoch 2 of 3, step 34 of 145\n"
        "Resuming from runs/x/backup: epoch 2 of 3, step 34 of 145 (179 optimizer steps done).\n"
        "Epoch 2/3\n"
        "111/111 - 302s - 3s/step - loss: 2.4\n"
        "Epoch 3/3\n"
        "145/145 - 140s - 966ms/step - loss: 2.2\n"
    )
    assert epoch_seconds(log) == [150, 337, 140]


def _progress(path, name, sha, log_px, checksums=(10.0, 20.0), **identity):
    """A finished `evaluate --progress` file, written by the evaluation's own writer."""
    identity = {"name": name, "weights_sha256": sha, "num_samples": 100, "seed": 0, "limit": None, **identity}
    state = {"log_px": log_px, "elbo": np.asarray(log_px) - 5.0, "checksums": checksums, "seconds": 1.0}
    evaluation._write_progress(str(path), identity, state)
    return path


def test_the_card_command_checks_the_evaluation_against_its_progress_file(tmp_path):
    progress = _progress(tmp_path / "a.npz", "x-attentive", "aa", [-85.0, -95.0])
    printed = tmp_path / "a.json"
    printed.write_text(json.dumps({"num_examples": 2, "nll_nats": 90.0}))
    args = argparse.Namespace(name="x-attentive", evaluation=str(printed), progress=str(progress))
    figures, progress = fill_card._checked_evaluation(args, "aa")
    assert figures["nll_nats"] == 90.0 and progress.identity["weights_sha256"] == "aa"
    with pytest.raises(ValueError, match="not the file to ship"):
        fill_card._checked_evaluation(args, "bb")
    printed.write_text(json.dumps({"num_examples": 2, "nll_nats": 91.0}))
    with pytest.raises(ValueError, match="disagree"):
        fill_card._checked_evaluation(args, "aa")


def test_paired_comparison_against_numpy_and_refuses_other_images(tmp_path):
    def read(*args, **identity):
        return fill_card._progress_file(_progress(*args, **identity))

    a = read(tmp_path / "a.npz", "a-attentive", "aa", [-100.0, -90.0, -80.0])
    b = read(tmp_path / "b.npz", "a-baseline", "bb", [-101.0, -93.0, -79.0])
    paired = fill_card.paired_comparison(a, "a-baseline", b)
    difference = np.array([-101.0, -93.0, -79.0]) - np.array([-100.0, -90.0, -80.0])
    assert paired["nll_difference_nats"] == round(difference.mean(), 2)
    assert paired["stderr"] == round(difference.std(ddof=1) / np.sqrt(3), 2)
    assert paired["test_images"] == 3
    assert paired["fraction_of_images_attentive_scores_higher"] == round(2 / 3, 3)
    other_k = read(tmp_path / "k.npz", "a-baseline", "bb", [-1.0, -2.0, -3.0], num_samples=10)
    with pytest.raises(ValueError, match="num_samples"):
        fill_card.paired_comparison(a, "a-baseline", other_k)
    other_images = read(tmp_path / "c.npz", "a-baseline", "bb", [-1.0, -2.0, -3.0], checksums=(10.0, 21.0))
    with pytest.raises(ValueError, match="pixel sums equal: False"):
        fill_card.paired_comparison(a, "a-baseline", other_images)
    with pytest.raises(ValueError, match="not the baseline"):
        fill_card.paired_comparison(a, "another-baseline", b)


def test_paired_command_needs_evaluations_that_reproduce_both_shipped_cards(tmp_path, monkeypatch):
    monkeypatch.setattr(fill_card, "ROOT", tmp_path)
    (tmp_path / "zoo").mkdir()
    for name, sha, nll in (("x-attentive", "aa", 90.0), ("x-baseline", "bb", 91.0)):
        card = {"name": name, "weights": {"sha256": sha}, "results": {"test_nll_nats": nll, "test_images": 2}}
        (tmp_path / "zoo" / f"{name}.json").write_text(json.dumps(card))
    a = _progress(tmp_path / "a.npz", "x-attentive", "aa", [-85.0, -95.0])
    b = _progress(tmp_path / "b.npz", "x-baseline", "bb", [-86.0, -96.0])
    fill_card.main(["paired", "x-attentive", "--progress", str(a), "--baseline", "x-baseline", "--baseline-progress", str(b)])
    card = json.loads((tmp_path / "zoo" / "x-attentive.json").read_text())
    assert card["results"]["paired_vs_baseline"]["nll_difference_nats"] == -1.0
    assert card["results"]["test_nll_nats"] == 90.0  # the rest of the card is kept
    unfinished = _progress(tmp_path / "u.npz", "x-baseline", "bb", [-86.0], checksums=(10.0,))
    with pytest.raises(ValueError, match="does not reproduce 'x-baseline'"):
        fill_card.main(["paired", "x-attentive", "--progress", str(a), "--baseline", "x-baseline", "--baseline-progress", str(unfinished)])
    other_weights = _progress(tmp_path / "w.npz", "x-baseline", "cc", [-86.0, -96.0])
    with pytest.raises(ValueError, match="shipped weights"):
        fill_card.main(["paired", "x-attentive", "--progress", str(a), "--baseline", "x-baseline", "--baseline-progress", str(other_weights)])
