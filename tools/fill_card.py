"""Ships a finished run's weights in the zoo and writes the measured part of its card.

From a finished run folder (`keras-avae train ... --output RUN`) and the
evaluation of the file to ship (the JSON `keras-avae evaluate` printed at
its end, and its `--progress` file), this writes into `zoo/NAME.json` what
can be read from files rather than typed: the weights file, its size and
sha256, the test figures, the training budget (`run.json`), the epoch times
of the training log, the compile mode the run recorded, the paired
comparison with a baseline's `--progress` file and `shipped_sample_nelbo_nats`
(`tools/card_sample_figure.py`, recomputed through `zoo.load(NAME)`). It
refuses an evaluation of other weights (the progress file records their
sha256) or an unfinished one. Notes in words are given with `--note KEY=TEXT`.

Usage (TensorFlow backend, from the repository root):
    python tools/fill_card.py float16 runs/cifar10-baseline-small/model.weights.h5 \\
        runs/cifar10-baseline-small.f16.weights.h5
    python tools/fill_card.py card omniglot-baseline-small --run runs/omniglot-baseline-small \\
        --log runs/omniglot-baseline-small.log --evaluation runs/eval/omniglot-baseline-small.json \\
        --progress runs/eval/omniglot-baseline-small.npz \\
        --train-command "keras-avae train ..." --evaluate-command "keras-avae evaluate ..."
    python tools/fill_card.py paired cifar10-attentive-small --progress runs/eval/cifar10-attentive-small.npz \\
        --baseline cifar10-baseline-small --baseline-progress runs/eval/cifar10-baseline-small.npz
"""

import argparse
import collections
import datetime
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's keras_avae
sys.path.insert(0, str(ROOT / "tools"))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# "602/602 - 245s - 408ms/step - ...": an epoch (or the part of it run) under `--verbose 2`.
_EPOCH_LINE = re.compile(r"^\s*(\d+)/(\d+) - (\d+)s - ")
_EPOCH_HEADER = re.compile(r"^Epoch (\d+)/(\d+)$")


def epoch_seconds(log_path):
    """The wall time of each epoch in a `keras-avae train --verbose 2` log.

    An epoch stopped and resumed logs one line per part, each under its own
    "Epoch N/E" header (the part's steps: "34/145", then "111/111"), and its
    time is their sum; a part killed before it logged is not counted.
    """
    seconds, epoch = {}, None
    with open(log_path) as f:
        for line in f:
            header = _EPOCH_HEADER.match(line)
            if header:
                epoch = int(header.group(1))
                continue
            part = _EPOCH_LINE.match(line)
            if part and epoch is not None:
                seconds[epoch] = seconds.get(epoch, 0) + int(part.group(3))
                epoch = None
    return [seconds[e] for e in sorted(seconds)]


def float16_copy(source, target):
    """Writes `source` to `target` with its float32 arrays stored as float16 (half the bytes)."""
    import h5py
    import numpy as np

    with h5py.File(source, "r") as src, h5py.File(target, "w") as dst:

        def copy(name, item):
            if isinstance(item, h5py.Dataset):
                data = item[()]
                dst.create_dataset(name, data=data.astype(np.float16) if data.dtype == np.float32 else data)
            else:
                dst.require_group(name)
            for key, value in item.attrs.items():
                dst[name].attrs[key] = value

        for key, value in src.attrs.items():
            dst.attrs[key] = value
        src.visititems(copy)


def _float_dtype(path):
    import h5py

    dtypes = set()
    with h5py.File(path, "r") as f:
        f.visititems(lambda _, item: dtypes.add(str(item.dtype)) if isinstance(item, h5py.Dataset) else None)
    floats = sorted(d for d in dtypes if d.startswith("float"))
    if len(floats) != 1:
        raise ValueError(f"{path} mixes float dtypes: {floats}")
    return floats[0]


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# An `evaluate --progress` file, read once: its identity, per-batch pixel
# sums and per-image log p(x).
ProgressFile = collections.namedtuple("ProgressFile", "path identity checksums log_px")


def _progress_file(path):
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        return ProgressFile(path, json.loads(str(data["identity"])), data["checksums"], data["log_px"])


def _require_weights(progress, name, weights_sha256, what):
    """Refuses a progress file that did not score `name` with the weights of sha256 `weights_sha256` (`what`)."""
    identity = progress.identity
    if identity["name"] != name or identity["weights_sha256"] != weights_sha256:
        raise ValueError(
            f"{progress.path} scored {identity['name']!r} with weights of sha256 {identity['weights_sha256']}, "
            f"not {what} ({name!r}, {weights_sha256})"
        )


def _checked_evaluation(args, weights_sha256):
    """The printed figures and the read progress file, checked against each other and the weights to ship."""
    printed = json.loads(pathlib.Path(args.evaluation).read_text())
    progress = _progress_file(args.progress)
    _require_weights(progress, args.name, weights_sha256, "the file to ship")
    log_px = progress.log_px
    if printed["num_examples"] != log_px.size or abs(printed["nll_nats"] + log_px.mean()) > 1e-6:
        raise ValueError(f"{args.evaluation} (the finished evaluation) and {args.progress} disagree")
    return printed, progress


def fill_card(args):
    card_path = ROOT / "zoo" / f"{args.name}.json"
    card = json.loads(card_path.read_text())
    run = json.loads((pathlib.Path(args.run) / "run.json").read_text())
    if run["model"] != args.name:
        raise ValueError(f"--run trained {run['model']!r}, not {args.name!r}. Received: --run {args.run}")
    source = pathlib.Path(args.weights or pathlib.Path(args.run) / "model.weights.h5")
    source_sha256 = _sha256(source)
    printed, progress = _checked_evaluation(args, source_sha256)
    if printed["nll_stderr"] is None:
        raise ValueError(
            f"the evaluation scored {printed['num_examples']} image: a card's figure needs a standard error, "
            "so score at least 2 (a card's test set, at least 1,000)"
        )
    seconds = epoch_seconds(args.log)
    if len(seconds) != run["epochs"]:
        raise ValueError(f"{args.log} logs {len(seconds)} finished epochs, the run has {run['epochs']}")

    weights_file = f"{args.name}.weights.h5"
    shutil.copyfile(source, ROOT / "zoo" / weights_file)
    card["weights"] = {
        "file": weights_file,
        "dtype": _float_dtype(source),
        "bytes": source.stat().st_size,
        "sha256": source_sha256,
    }
    images_seen = run["epochs"] * run["steps_per_epoch"] * run["batch_size"] * run["replicas"]
    results = {
        "test_nll_nats": round(printed["nll_nats"], 2),
        "test_nll_stderr": round(printed["nll_stderr"], 2),
        "bits_per_dim": round(printed["bits_per_dim"], 4),
        "elbo_nats": round(printed["elbo_nats"], 2),
        "test_images": printed["num_examples"],
        "importance_samples": progress.identity["num_samples"],
        "evaluation_seconds": printed["seconds"],
        "epochs": run["epochs"],
        "steps_per_epoch": run["steps_per_epoch"],
        "batch_size": run["batch_size"] * run["replicas"],
        "training_images_seen": images_seen,
        "train_seconds": sum(seconds),
        "epoch_seconds": seconds,
        "hardware": args.hardware,
        "backend": f"{run['backend']} {_version(run['backend'])} (keras {_version('keras')}); "
        f"training: {run['compile_mode']}; evaluation: {args.evaluation_mode}",
        "train_command": args.train_command,
        "evaluate_command": args.evaluate_command,
    }
    if args.baseline_progress:
        results["paired_vs_baseline"] = paired_comparison(progress, args.baseline, _progress_file(args.baseline_progress))
    for note in args.note or []:
        key, _, text = note.partition("=")
        results[key] = text
    card["results"] = results
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    _reload_zoo_entries()

    from card_sample_figure import shipped_sample_nelbo

    results["shipped_sample_nelbo_nats"] = round(shipped_sample_nelbo(args.name), 4)
    results["shipped_sample_note"] = (
        "mean negative ELBO on the first 100 test images shipped in keras_avae/data, every seed state of the model "
        f"at (7, 0), TensorFlow, through zoo.load({args.name!r}): python tools/card_sample_figure.py {args.name}"
    )
    results["measured"] = args.measured or datetime.date.today().isoformat()
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    return card


def paired_comparison(progress, baseline, baseline_progress):
    """The card's `paired_vs_baseline` from two read `--progress` files (`_progress_file`) of the same images.

    Refuses files that scored other images (a different data selection,
    batch size, K or seed in the identity, or other per-batch pixel sums).
    """
    import numpy as np

    from keras_avae import evaluation

    identity, base_identity = progress.identity, baseline_progress.identity
    log_px, base_log_px = progress.log_px, baseline_progress.log_px
    differ = sorted(
        key
        for key in set(identity) | set(base_identity)
        if key not in ("name", "weights_sha256") and identity.get(key) != base_identity.get(key)
    )
    same_pixels = np.array_equal(progress.checksums, baseline_progress.checksums)
    if differ or not same_pixels:
        raise ValueError(
            f"{progress.path} and {baseline_progress.path} did not score the same images the same way "
            f"(identity keys that differ: {differ or 'none'}; per-batch pixel sums equal: {same_pixels})"
        )
    if base_identity["name"] != baseline:
        raise ValueError(f"{baseline_progress.path} scored {base_identity['name']!r}, not the baseline {baseline!r}")
    paired = evaluation.paired_difference(log_px, base_log_px)
    return {
        "baseline": baseline,
        "nll_difference_nats": round(paired["nll_difference_nats"], 2),
        "stderr": round(paired["stderr"], 2),
        "test_images": paired["num_examples"],
        "fraction_of_images_attentive_scores_higher": round(float(np.mean(log_px > base_log_px)), 3),
        "note": "keras_avae.evaluation.paired_difference of the two --progress files (the same images, "
        "prepared alike)",
    }


def add_paired_comparison(args):
    """Adds `paired_vs_baseline` to a shipped card, from new evaluations of both shipped files.

    Each progress file must have scored its entry's shipped weights (their
    sha256), finished, and reproduced the card's test NLL to its rounding.
    """
    cards, scored = {}, {}
    for name, path in ((args.name, args.progress), (args.baseline, args.baseline_progress)):
        card = cards[name] = json.loads((ROOT / "zoo" / f"{name}.json").read_text())
        progress = scored[name] = _progress_file(path)
        _require_weights(progress, name, card["weights"]["sha256"], "the shipped weights")
        results, log_px = card["results"], progress.log_px
        nll = -float(log_px.mean())
        if log_px.size != results["test_images"] or abs(nll - results["test_nll_nats"]) > 0.005 + 1e-9:
            raise ValueError(
                f"{path} does not reproduce {name!r}'s card: {log_px.size} images, {nll:.3f} nats "
                f"(card: {results['test_images']} images, {results['test_nll_nats']} nats)"
            )
    card = cards[args.name]
    card["results"]["paired_vs_baseline"] = paired_comparison(scored[args.name], args.baseline, scored[args.baseline])
    (ROOT / "zoo" / f"{args.name}.json").write_text(json.dumps(card, indent=2) + "\n")
    return card


def _reload_zoo_entries():
    from keras_avae import zoo

    zoo._entries.cache_clear()


def _version(package):
    import importlib.metadata

    return importlib.metadata.version(package)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    half = commands.add_parser("float16", help="a float16 copy of a .weights.h5 file")
    half.add_argument("source")
    half.add_argument("target")
    card = commands.add_parser("card", help="ship a run's weights and write its card's measured figures")
    card.add_argument("name", help="the zoo entry the run trained")
    card.add_argument("--run", required=True, help="the finished run folder")
    card.add_argument("--log", required=True, help="the run's `--verbose 2` training log")
    card.add_argument("--weights", help="the file to ship (default: RUN/model.weights.h5)")
    card.add_argument("--evaluation", required=True, help="the JSON `keras-avae evaluate` printed")
    card.add_argument("--progress", required=True, help="that evaluation's --progress file")
    card.add_argument("--train-command", required=True)
    card.add_argument("--evaluate-command", required=True)
    card.add_argument("--baseline", help="the baseline entry of the paired comparison")
    card.add_argument("--baseline-progress", help="the baseline's --progress file on the same images")
    card.add_argument("--hardware", default="2-core AMD EPYC CPU, no GPU, 24 GB RAM")
    card.add_argument("--evaluation-mode", default="XLA")
    card.add_argument("--measured", help="the dates of the measurements (default: today)")
    card.add_argument("--note", action="append", metavar="KEY=TEXT", help="a note in words (repeatable)")
    paired = commands.add_parser(
        "paired", help="add the paired comparison to a shipped card from new evaluations of both shipped files"
    )
    paired.add_argument("name", help="the zoo entry whose card gets the comparison")
    paired.add_argument("--progress", required=True, help="its --progress file (the shipped weights, finished)")
    paired.add_argument("--baseline", required=True, help="the baseline entry")
    paired.add_argument("--baseline-progress", required=True, help="the baseline's --progress file on the same images")
    args = parser.parse_args(argv)
    if args.command == "float16":
        float16_copy(args.source, args.target)
        return
    if args.command == "paired":
        print(json.dumps(add_paired_comparison(args)["results"]["paired_vs_baseline"], indent=1))
        return
    if bool(args.baseline) != bool(args.baseline_progress):
        parser.error("--baseline and --baseline-progress go together")
    print(json.dumps(fill_card(args)["results"], indent=1))


if __name__ == "__main__":
    main()
