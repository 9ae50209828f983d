"""Reading a run folder's `history.csv` (written by `training.HistoryLogger`)."""

import math
import pathlib
import re

from keras_avae.training.run_folder import _read_whole_csv_rows

HISTORY = "history.csv"


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
