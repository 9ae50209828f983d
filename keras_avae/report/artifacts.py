"""A figure's two files: `NAME.png` (matplotlib, Agg) and `NAME.json`.

The JSON holds exactly the numbers the PNG draws, as plain lists: arrays
become nested lists, float32 values are written with their shortest exact
decimal form (reading one back as float32 gives the same number), and NaN or
infinite values become `null`, so every file is strict JSON.
"""

import json
import math
import pathlib

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from keras_avae.training.atomic_files import _atomic_write
from keras_avae.training.atomic_files import _atomic_write_text


def jsonable(value):
    """`value` as plain JSON data: lists, floats, ints, strings, `None`.

    NumPy arrays become nested lists; float32 values keep their shortest
    exact form (`np.float32(0.1)` is written `0.1`, not `0.10000000149...`);
    NaN and infinities become `None`; dicts, lists and tuples are converted
    entry by entry.

    Args:
        value: a number, string, `None`, NumPy array or scalar, or a dict,
            list or tuple of those.

    Returns:
        The same numbers as JSON-serialisable Python objects.

    Example:

    >>> jsonable({"kl": np.array([0.1, np.nan], "float32"), "layers": np.arange(2)})
    {'kl': [0.1, None], 'layers': [0, 1]}
    """
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    array = np.asarray(value)
    if array.dtype.kind in "iu":
        return array.tolist()
    if array.dtype.kind == "b":
        return array.tolist()
    if array.dtype.kind != "f":
        raise ValueError(f"`value` must hold numbers, strings or None. Received: value of dtype {array.dtype}")
    if array.dtype == np.float32 or array.dtype == np.float16:
        # NumPy's str of a float32 is its shortest round-trip decimal.
        text = array.astype(np.float32).astype(str)
        floats = np.vectorize(float, otypes=[object])(text) if text.ndim else float(text)
    else:
        floats = array.astype(np.float64).astype(object) if array.ndim else float(array)
    return _finite_or_none(floats.tolist() if isinstance(floats, np.ndarray) else floats)


def _finite_or_none(value):
    if isinstance(value, list):
        return [_finite_or_none(item) for item in value]
    return value if math.isfinite(value) else None


def new_figure(width, height):
    """A matplotlib `Figure` on the Agg canvas (no pyplot, no global state).

    Args:
        width: inches.
        height: inches.

    Returns:
        A `matplotlib.figure.Figure` with constrained layout.

    Example:

    >>> fig = new_figure(4, 3)
    >>> fig.get_size_inches().tolist()
    [4.0, 3.0]
    """
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure, out_dir, name, numbers, title, caption):
    """Writes `out_dir/NAME.png` and `out_dir/NAME.json` (atomically).

    Args:
        figure: the matplotlib figure (see `new_figure`).
        out_dir: an existing folder.
        name: the file stem, letters, digits, `_` and `-`.
        numbers: the numbers the figure draws (see `jsonable`).
        title: the figure's section heading in the page.
        caption: what the figure shows and how to read it.

    Returns:
        A dict: `"name"`, `"title"`, `"caption"`, `"png"` and `"json"`
        (the file names, relative to `out_dir`).

    Example:

    >>> fig = new_figure(2, 2)
    >>> _ = fig.add_subplot().plot([0, 1], [1, 0])
    >>> save_figure(fig, ".", "line", {"y": [1, 0]}, "A line", "It falls.")["png"]
    'line.png'
    """
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"`name` must be letters, digits, '_' or '-'. Received: name={name!r}")
    out_dir = pathlib.Path(out_dir)
    text = json.dumps(jsonable(numbers), allow_nan=False, separators=(",", ":"))

    def write_png(tmp):
        figure.savefig(tmp, format="png", dpi=100, metadata={"Software": None})

    _atomic_write(out_dir / f"{name}.png", write_png)
    _atomic_write_text(out_dir / f"{name}.json", text + "\n")
    return {"name": name, "title": title, "caption": caption, "png": f"{name}.png", "json": f"{name}.json"}
