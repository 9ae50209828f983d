"""A run folder's records: `run.json` (the settings) and `history.csv`.

`train` refuses to resume a folder whose `run.json` names another model,
recipe or step count, and truncates `history.csv` to the epochs the
checkpoint holds.
"""

import csv
import json
import pathlib

from keras_avae.training.atomic_files import _atomic_write


def _recorded_feature_seed(path):
    """The `nonlocal_feature_seed` a run folder's `run.json` records, if any."""
    try:
        with open(path) as f:
            return json.load(f)["config"].get("nonlocal_feature_seed")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None



def _check_run_record(path, record):
    """Refuses to resume a run directory with another model or recipe."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    with open(path) as f:
        previous = json.load(f)
    # The device count may change between runs (it only sets the
    # synchronisation of batch norm); the model, recipe and step count may not.
    def comparable(run, key):
        value = _jsonable(run[key])
        if key == "config":
            value = {k: v for k, v in value.items() if k != "synchronized_batch_norm"}
        return value

    keys = ("model", "config", "recipe", "steps_per_epoch")
    changed = [k for k in keys if k in previous and comparable(previous, k) != comparable(record, k)]
    if changed:
        details = "; ".join(f"{k}: {previous[k]!r} -> {record[k]!r}" for k in changed)
        raise ValueError(
            f"{path.parent} holds a run with other settings ({details}). Use a new output directory, "
            "or the same settings to resume it."
        )



def _jsonable(value):
    return json.loads(json.dumps(value, default=str))



def _truncate_history(path, epoch):
    """Keeps the CSV rows of epochs before `epoch` (those the checkpoint holds)."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    header, body = rows[0], rows[1:]
    column = header.index("epoch") if "epoch" in header else None
    kept = [r for r in body if column is None or (len(r) > column and r[column] and int(float(r[column])) < epoch)]
    if len(kept) == len(body):
        return

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows([header] + kept)

    _atomic_write(path, write, ".csv")
