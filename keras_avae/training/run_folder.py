"""A run folder's owner and records: `run.lock`, `run.json` and `history.csv`.

`train` holds an exclusive lock on the folder while it runs (a second
`train` on it is refused, naming the process that holds it), refuses to
resume a folder whose `run.json` holds other settings, and truncates
`history.csv` to the epochs the checkpoint holds. `HistoryLogger` writes
that file: one row per finished epoch, numbered from 1 as the logs and the
sample grids are.
"""

import contextlib
import csv
import json
import os
import pathlib
import socket

import filelock
import keras
import numpy as np

from keras_avae.training.atomic_files import _atomic_write

LOCK = "run.lock"

# The settings a resume must keep: the rest of `run.json` (backend, compile
# mode, replicas) may change. The device count may change between runs as
# long as the global batch does not (it only sets the synchronisation of
# batch norm, whose statistics are those of the global batch either way).
# `reproducibility` (the seed, deterministic kernels): a resume under other
# ones would not give the numbers the record promises.
# `epochs` is checked apart: a finished run may be continued with more.
_RESUME_KEYS = ("model", "config", "recipe", "steps_per_epoch", "batch_size", "data", "reproducibility")
# Entries of those settings a resume may change: synchronised batch norm
# follows the device count; the stop limit, raised, lets a stopped run go on.
_FREE_ENTRIES = {("config", "synchronized_batch_norm"), ("recipe", "max_nonfinite_steps")}


def _batch_size_hint(previous, record):
    """Which batch size resumes the recorded global batch on this device count.

    The message quotes global batches, which a resume on another device
    count changes for the same per-replica `keras-avae train --batch-size`;
    `train(batch_size=...)` takes the global batch itself, so the two
    answers differ (a Python caller given only the flag's value was
    refused again).
    """
    recorded, replicas = previous["batch_size"], record.get("replicas")
    if not isinstance(recorded, int) or not isinstance(replicas, int) or replicas < 1:
        return ""
    counts = f"{replicas} now"
    if previous.get("replicas") not in (None, replicas):
        counts = f"{previous['replicas']} then, {counts}"
    if recorded % replicas:
        flag = f"no --batch-size gives {recorded} on {replicas}, nor does batch_size={recorded} split over {replicas}"
    else:
        flag = (
            f"--batch-size {recorded // replicas} gives {recorded}; `train` takes the global batch: "
            f"batch_size={recorded}"
        )
    return f" (global batches: the per-replica --batch-size of `keras-avae train` times the replicas, {counts}; {flag})"


# What a differing entry means, where its name does not say it:
# `(recorded record, requested record) -> text` after its values.
_HINTS = {
    "data.train_images_sha256": lambda previous, record: " (these are not the images the run trained on)",
    "batch_size": _batch_size_hint,
}


@contextlib.contextmanager
def _owned(output_dir, new_folders=()):
    """Holds an exclusive lock on `output_dir/run.lock` while the body runs.

    The lock is an `flock` (through `filelock`): the kernel releases it when
    the process ends, however it ends (SIGKILL included), so a stale lock is
    taken over by the next run. The holder writes its PID and host into the
    file, for the message a refused run prints. A body that raises while
    the folder holds nothing but a lock file it made (a refused call) leaves
    no trace: the lock file goes while still held, then the `new_folders`
    the call made, if they are empty.
    """
    path = pathlib.Path(output_dir) / LOCK
    made_lock_file = not path.exists()
    left_no_trace = False
    lock = filelock.FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise RuntimeError(
            f"{output_dir} is in use by {_holder(path)}: one `train` at a time per run folder "
            f"(lock {path}). Wait for it to end, stop it, or use another output folder."
        ) from None
    try:
        # In place (a rename would replace the locked file): readers may see
        # it empty for a moment, which only shortens their message.
        with open(path, "r+") as f:
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        yield
    except BaseException:
        if made_lock_file and _holds_only_the_lock(output_dir):
            path.unlink()  # while still held: no other run holds a lock on this file
            left_no_trace = True
        raise
    finally:
        lock.release()
        if left_no_trace:
            for folder in new_folders:
                with contextlib.suppress(OSError):  # another process wrote into it meanwhile
                    folder.rmdir()


def _holds_only_the_lock(output_dir):
    """Whether `output_dir` holds `run.lock` and nothing else (a folder gone meanwhile does not)."""
    try:
        return os.listdir(output_dir) == [LOCK]
    except OSError:
        return False


def _holder(path):
    """`process PID on host HOST`, as the lock file names its holder."""
    try:
        with open(path) as f:
            owner = json.loads(f.read())
        return f"process {int(owner['pid'])} on host {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _recorded_feature_seed(path):
    """The `nonlocal_feature_seed` a run folder's `run.json` records, if any (a damaged one is refused)."""
    config = (_read_record(path) or {}).get("config")
    return config.get("nonlocal_feature_seed") if isinstance(config, dict) else None


def _read_record(path):
    """A run folder's `run.json` as a dict, or `None` when there is none."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(
            f"{path} is not a readable run record ({type(error).__name__}: {error}); it was damaged after "
            "`train` wrote it (its writes are atomic). Restore it from a copy, or use a new output folder."
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{path} is not a run record: it holds a {type(record).__name__}, not a JSON object.")
    return record


def _check_run_record(path, record, finished_epochs=None):
    """Refuses to resume a run folder recorded with other settings.

    Compares the settings of `_RESUME_KEYS` that both records hold (a key a
    newer version records is not in an older `run.json`), entry by entry for
    the model config and the recipe, and `epochs` unless the checkpoint holds
    every recorded epoch (`finished_epochs`) and more are asked for. The
    message names the differing keys with their recorded and requested
    values, in one line.
    """
    path = pathlib.Path(path)
    previous = _read_record(path)
    if previous is None:
        if finished_epochs is not None:
            # `train` writes run.json before the first checkpoint: without it,
            # neither the settings nor the FAVOR+ feature seed can be checked.
            raise ValueError(
                f"{path.parent} holds a checkpoint but no {path.name}, so a resume cannot check that the "
                f"settings (and the attention's feature seed) are the checkpoint's. Restore {path.name} "
                "from a copy of the run folder, or use a new output folder."
            )
        return
    changes = list(_differences(previous, record))
    if "epochs" in previous and previous["epochs"] != record["epochs"]:
        extended = finished_epochs is not None and finished_epochs >= previous["epochs"] < record["epochs"]
        if not extended:
            changes.append(("epochs", previous["epochs"], record["epochs"]))
    if changes:
        details = "; ".join(
            f"{key}: recorded {old!r}, requested {new!r}{_HINTS[key](previous, record) if key in _HINTS else ''}"
            for key, old, new in changes
        )
        raise ValueError(
            f"{path.parent} holds a run with other settings ({details}). Resume it with the recorded "
            "settings, or use a new output folder."
        )


def _differences(previous, record):
    """`(key, recorded, requested)` for each resume setting that differs."""
    for key in _RESUME_KEYS:
        if key not in previous or key not in record:
            continue
        if key == "batch_size" and record.get("batch_size_from") == "dataset" and "batch_size_from" not in previous:
            continue  # recorded before a dataset's own batch was: the recipe's number, not the data's
        old, new = _jsonable(previous[key]), _jsonable(record[key])
        if isinstance(old, dict) and isinstance(new, dict):
            for name in sorted(old.keys() & new.keys()):
                if (key, name) not in _FREE_ENTRIES and old[name] != new[name]:
                    yield f"{key}.{name}", old[name], new[name]
        elif old != new:
            yield key, old, new


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def _truncate_history(path, epoch):
    """Keeps the CSV rows of the first `epoch` epochs (those the checkpoint holds).

    Also drops a row cut short by a kill while it was written (fewer fields
    than the header), so the next row starts on a line of its own.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return
    text, rows = _read_whole_csv_rows(path)
    if not rows:
        if text:
            _write_csv(path, [])  # a cut header: the logger writes it again into an empty file
        return
    header, body = rows[0], rows[1:]
    column = header.index("epoch") if "epoch" in header else None

    def kept_row(row):
        if len(row) != len(header):
            return False
        return column is None or (row[column] != "" and int(float(row[column])) <= epoch)

    kept = [r for r in body if kept_row(r)]
    if len(kept) == len(body) and text.endswith("\n"):
        return
    _write_csv(path, [header] + kept)


def _read_whole_csv_rows(path):
    """The text of CSV file `path` and the rows of its lines written whole.

    A last line without its newline is a row whose append was cut by a kill,
    perhaps inside its last field (so a field count cannot tell): dropped.
    """
    with open(path, newline="") as f:
        text = f.read()
    lines = text.splitlines()
    if not text.endswith("\n"):
        lines = lines[:-1]
    return text, list(csv.reader(lines))


def _write_csv(path, rows):
    """Writes `rows` as the whole CSV file `path`, atomically."""

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(rows)

    _atomic_write(path, write)


class HistoryLogger(keras.callbacks.Callback):
    """Appends one CSV row of epoch logs per finished epoch to `path`.

    Unlike `keras.callbacks.CSVLogger`, epochs are numbered from 1 (as the
    progress bar and `samples/epoch_NNNN.png` are) and there are no empty
    `val_*` columns when the run has no validation data. The file is
    opened, appended and flushed once per epoch, so a kill leaves at most
    one partial row, which `_truncate_history` drops on resume; the header
    and the first row are written together, atomically. A resumed
    run keeps the header already in the file.

    Args:
        path: the CSV file.

    Example:

    >>> logger = HistoryLogger("/tmp/run/history.csv")
    """

    def __init__(self, path):
        super().__init__()
        self.path = pathlib.Path(path)

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        header = self._header() or ["epoch"] + sorted(logs)
        row = [epoch + 1] + [_csv_value(logs.get(key, "")) for key in header[1:]]
        if not self.path.exists() or self.path.stat().st_size == 0:
            # The header and first row appear together (a kill while writing
            # them would leave a header cut short, which no resume repairs).
            _write_csv(self.path, [header, row])
            return
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow(row)
            f.flush()
            os.fsync(f.fileno())

    def _header(self):
        if not self.path.exists():
            return None
        with open(self.path, newline="") as f:
            return next(csv.reader(f), None)


def _csv_value(value):
    if isinstance(value, str):
        return value
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()
