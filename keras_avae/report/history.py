"""Reading a run folder's `history.csv` (written by `training.HistoryLogger`)."""

import math
import pathlib
import re

from keras_avae.training.run_folder import _read_record
from keras_avae.training.run_folder import _read_whole_csv_rows

HISTORY = "history.csv"
RUN_RECORD = "run.json"
# Not compared with a run's record: the FAVOR+ features' draw is no part of
# the architecture (the weights' own run.json check covers it), so a run of
# the same entry gives the curves of the pretrained weights' architecture.
_NOT_ARCHITECTURE = ("nonlocal_feature_seed",)


def check_run_trained(run_dir, model, name="run_dir"):
    """Refuses a run folder whose `run.json` records another model than `model`.

    Compares the recorded config with `model.get_config()` as the CLI's
    `--weights` check does (`zoo._config_differences`): the architecture,
    not the training-only or sampling settings. A folder without `run.json`
    (a `history.csv` alone, as older or hand-made folders have) says
    nothing about its model and passes, as before; a damaged one is refused.

    Example:

    >>> from keras_avae import zoo
    >>> check_run_trained("runs/mnist-baseline", zoo.load("mnist-attentive-small"))  # doctest: +SKIP
    Traceback (most recent call last):
    ...
    ValueError: `run_dir` 'runs/mnist-baseline' trained another architecture than this model's: ...

    Raises:
        ValueError: naming `name` (the argument: `run_dir`, or the CLI's
            `--run`) and `run_dir`, the recorded model and the keys that
            differ, with their recorded and current values.
    """
    from keras_avae import zoo

    record = _read_record(pathlib.Path(run_dir) / RUN_RECORD)
    recorded = (record or {}).get("config")
    if not isinstance(recorded, dict):
        return
    built = model.get_config()
    differing = zoo._config_differences(recorded, built, ignore=_NOT_ARCHITECTURE)
    if differing:
        details = ", ".join(f"{key}={recorded[key]!r} (this model: {built[key]!r})" for key in differing)
        raise ValueError(
            f"`{name}` {str(run_dir)!r} trained another architecture than this model's: its run.json records "
            f"{record.get('model')!r} with {details}, so its history.csv is not this model's training. Pass "
            f"the run folder that trained this model, or no {name}. Received: {name}={str(run_dir)!r}"
        )


def read_history(run_dir):
    """The columns of `RUN_DIR/history.csv`, one list of values per column.

    `keras-avae train` writes one row per finished epoch: `epoch`, `loss`,
    `nelbo`, `kl`, `kl_0` ... `kl_{L-1}`, `reconstruction`, `bits_per_dim`,
    `kl_weight`, `learning_rate`, ... Values are floats (`epoch` an int);
    an empty or non-finite cell is `None`. Rows are kept in file order.

    Args:
        run_dir: a run folder of `keras-avae train` (or `training.train`).

    Returns:
        A dict `column -> list`, with the columns in the file's order.

    Raises:
        FileNotFoundError: when `run_dir` is not a folder or holds no
            `history.csv` (the message names the path).
        ValueError: when the file has no `epoch` column, no rows, or a value
            that is not a number (the message names the file and the cell).

    Example:

    >>> history = read_history("runs/my-run")  # doctest: +SKIP
    >>> history["epoch"], history["kl_0"]  # doctest: +SKIP
    ([1, 2], [86.5, 34.1])
    """
    run_dir = pathlib.Path(run_dir)
    path = run_dir / HISTORY
    if not run_dir.is_dir():
        raise FileNotFoundError(f"The run folder does not exist or is not a folder. Received: run_dir={str(run_dir)!r}")
    if not path.is_file():
        raise FileNotFoundError(
            f"No {HISTORY} in the run folder: {str(path)!r} does not exist (`keras-avae train --output "
            f"RUN_DIR` writes it after the first epoch). Received: run_dir={str(run_dir)!r}"
        )
    rows = [row for row in _read_whole_csv_rows(path)[1] if row]
    if not rows or "epoch" not in rows[0]:
        raise ValueError(f"{str(path)!r} has no header with an `epoch` column. Received header: {rows[:1]}")
    header, body = rows[0], rows[1:]
    if not body:
        raise ValueError(f"{str(path)!r} has a header but no epochs yet. Received: {len(rows)} line(s)")
    columns = {key: [] for key in header}
    for line, row in enumerate(body, start=2):
        if len(row) != len(header):
            continue  # a row cut short by a kill (a resumed run drops it)
        for key, cell in zip(header, row):
            columns[key].append(_number(cell, path, line, key))
    columns["epoch"] = [None if e is None else int(e) for e in columns["epoch"]]
    return columns


def _number(cell, path, line, key):
    if cell.strip() == "":
        return None
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(
            f"{str(path)!r} line {line}, column {key!r}: not a number. Received: {cell!r}"
        ) from None
    return value if math.isfinite(value) else None


def kl_columns(history):
    """The per-layer KL columns of a history, in layer order: `kl_0`, `kl_1`, ...

    Args:
        history: a dict from `read_history`.

    Returns:
        A list of column names (empty when the run logged no per-layer KL).

    Example:

    >>> kl_columns({"epoch": [1], "kl": [3.0], "kl_10": [1.0], "kl_2": [2.0]})
    ['kl_2', 'kl_10']
    """
    names = [key for key in history if re.fullmatch(r"kl_\d+", key)]
    return sorted(names, key=lambda key: int(key[3:]))
