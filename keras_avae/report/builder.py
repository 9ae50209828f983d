"""`write_report`: compute a model's numbers, draw every figure, write the page.

The numbers come from `keras_avae.inspection` and the model's own
`sample`/`reconstruct`; `figures` and `grids` draw them, `page` links them.
Every random step starts the model's seed generator at its own state
`(seed, stream)` and restores the generator afterwards, so a figure does
not depend on which figures came before it, and the same `seed` at the
same `batch_size` gives the same report (the KL and attention figures draw
their posterior samples batch by batch, so their numbers follow
`batch_size`).

The figures are written into a hidden folder of the report folder and moved
in only when all are done, so a report stopped part-way leaves an earlier
report in the same folder as it was.
"""

import contextlib
import os
import pathlib
import shutil
import time

import keras
import numpy as np
from keras import ops

from keras_avae._validation import check_images
from keras_avae._validation import check_positive_int
from keras_avae._validation import check_temperature
from keras_avae._validation import is_integer
from keras_avae.report import figures
from keras_avae.report import grids
from keras_avae.report.history import check_run_trained
from keras_avae.report.history import read_history
from keras_avae.report.page import write_page
from keras_avae.training.atomic_files import _fsync
from keras_avae.training.atomic_files import _process_alive

# The seed-generator stream of each random step: state (seed, stream << 20),
# so the steps draw disjoint runs of seeds. The sample grids of temperature
# k use `_STREAMS["samples"] + k`, with and without re-adjustment.
_STREAMS = {
    "kl_per_layer": 1,
    "active_units": 2,
    "depthwise_attention": 3,
    "nonlocal_attention": 4,
    "reconstructions": 5,
    "interpolations": 6,
    "samples": 16,
}


# Every figure a report can hold (the file names of its PNG and JSON).
_FIGURES = (
    "training_curves",
    "kl_per_layer",
    "depthwise_attention",
    "nonlocal_attention",
    "samples",
    "reconstructions",
    "interpolations",
)


# The hidden folder of `out_dir` a report's figures are written to first.
_STAGING = ".partial-report-"


@contextlib.contextmanager
def _seeded(model, seed, stream):
    """Runs the body with the model's seed generator at `(seed, stream << 20)`, then restores it."""
    state = model.seed_generator.state
    saved = np.asarray(ops.convert_to_numpy(state.value))
    state.assign(np.array([seed, stream << 20], dtype=saved.dtype))
    try:
        yield
    finally:
        state.assign(saved)


def _check_model(model):
    from keras_avae.models.hierarchical_vae import HierarchicalVAE

    if not isinstance(model, HierarchicalVAE):
        raise ValueError(
            "`model` must be a HierarchicalVAE: the report draws per-layer KL, depth-wise attention and "
            "temperature sampling, which a DiscreteVAE (the mnist-gumbel entries) does not have. "
            f"Received: model of class {type(model).__name__}"
        )


def _default_query_pixels(image, crop, pixel_range, count=4):
    """`count` (row, col) pixels spread over the image's bright pixels (else a fixed pattern)."""
    height, width = image.shape[:2]
    middle = (pixel_range[0] + pixel_range[1]) / 2
    bright = np.argwhere(image[crop : height - crop, crop : width - crop].mean(-1) > middle) + crop
    if len(bright) < count:
        return [(height // 2, width // 2), (height // 4, width // 4), (height // 4, 3 * width // 4),
                (3 * height // 4, width // 2)][:count]
    picks = np.linspace(0, len(bright) - 1, count).round().astype(int)
    return [(int(r), int(c)) for r, c in bright[picks]]


def _check_query_pixels(query_pixels, image_shape):
    from keras_avae.inspection import _pixel_list

    height, width = image_shape[:2]
    pixels = []
    listed = _pixel_list(query_pixels)  # float or bool coordinates are refused, not truncated
    if listed is None or any(len(q) != 2 for q in listed):
        raise ValueError(f"`query_pixels` must be (row, col) pairs of ints. Received: query_pixels={query_pixels!r}")
    for row, col in listed:
        if not (0 <= row < height and 0 <= col < width):
            raise ValueError(
                f"`query_pixels` must lie in the {height}x{width} image. Received: query_pixels={query_pixels!r}"
            )
        pixels.append((row, col))
    if not pixels:
        raise ValueError(f"`query_pixels` must hold at least one pixel. Received: query_pixels={query_pixels!r}")
    return pixels


class _Steps:
    """A `keras.utils.Progbar` over the report's steps (silent without `progress`)."""

    def __init__(self, total, progress):
        self.done = 0
        self.bar = keras.utils.Progbar(total, unit_name="step") if progress else None

    def step(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.done)


def _check_out_dir(out_dir, argument="out_dir"):
    """`out_dir` as a path, refused where it is a file or a new folder named like a page.

    `argument` is how the caller spells it: `out_dir`, or `--out` for the
    command line, which checks it before it loads the model and the data.
    """
    out = pathlib.Path(out_dir)

    def spelt(value):
        return f"{argument} {value!r}" if argument.startswith("--") else f"{argument}={value!r}"

    if out.exists() and not out.is_dir():
        # mkdir's "File exists" named neither the argument nor the problem.
        raise ValueError(
            f"`{argument}` must be a folder (the report writes index.html and a PNG and a JSON per figure into "
            f"it), not a file. Received: {spelt(str(out_dir))}, an existing file"
        )
    if not out.exists() and out.suffix.lower() in (".html", ".htm"):
        # It would become a folder named like a page, the page inside it.
        raise ValueError(
            f"`{argument}` is the report's folder, and the page is written into it as index.html; a new folder "
            f"named like a page file is refused. Pass a folder, e.g. {spelt(str(out.with_suffix('')))}. "
            f"Received: {spelt(str(out_dir))}"
        )
    return out


@contextlib.contextmanager
def _staging(out):
    """A fresh folder `out/.partial-report-PID` for the figures, removed afterwards whatever happened."""
    for stale in out.glob(_STAGING + "*"):
        pid = stale.name[len(_STAGING) :]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed report
    stage = out / f"{_STAGING}{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish(stage, out, records):
    """Moves the finished figures from `stage` into `out` and removes the earlier report's others."""
    # The earlier page goes first: a kill in this short window leaves no page
    # presenting the new figures beside old ones.
    (out / "index.html").unlink(missing_ok=True)
    for record in records:
        for key in ("png", "json"):
            os.replace(stage / record[key], out / record[key])
    # A figure an earlier report wrote into this folder and this one left
    # out must not stay beside the page as if it were this model's.
    for stale in set(_FIGURES) - {r["name"] for r in records}:
        for suffix in (".png", ".json"):
            (out / (stale + suffix)).unlink(missing_ok=True)
    _fsync(out)


def _checked_arguments(model, images, temperatures, counts, seed, query_pixels):
    """`write_report`'s arguments checked: `(images, temperatures, counts, query_pixels)`."""
    num_samples, num_reconstructions, num_interpolations, interpolation_steps, batch_size = counts
    _check_model(model)
    x = check_images(images, model.image_shape, model.pixel_range, "images")
    if len(x) < 2:
        raise ValueError(
            f"`images` must hold at least 2 images (active units are a variance over images). "
            f"Received: images.shape={x.shape}"
        )
    if not isinstance(temperatures, (list, tuple, np.ndarray)):
        raise ValueError(f"`temperatures` must be a list of temperatures. Received: temperatures={temperatures!r}")
    temperatures = [check_temperature(t, "temperatures") for t in temperatures]
    if not temperatures:
        raise ValueError("`temperatures` must hold at least one temperature. Received: temperatures=()")
    if len(set(temperatures)) != len(temperatures):
        # The figure has one panel per temperature: a repeat would be drawn over.
        raise ValueError(f"`temperatures` must not repeat a value. Received: temperatures={tuple(temperatures)}")
    num_samples = check_positive_int(num_samples, "num_samples")
    num_reconstructions = check_positive_int(num_reconstructions, "num_reconstructions")
    num_interpolations = check_positive_int(num_interpolations, "num_interpolations")
    if check_positive_int(interpolation_steps, "interpolation_steps") < 2:
        raise ValueError(f"`interpolation_steps` must be an int >= 2. Received: interpolation_steps={interpolation_steps!r}")
    batch_size = check_positive_int(batch_size, "batch_size")
    if not is_integer(seed) or not 0 <= seed < 2**31:
        raise ValueError(f"`seed` must be an int in [0, 2**31). Received: seed={seed!r}")
    seed = int(seed)
    if query_pixels is None:
        query_pixels = _default_query_pixels(x[0], model.crop, model.pixel_range)
    counts = (num_samples, num_reconstructions, num_interpolations, interpolation_steps, batch_size)
    return x, temperatures, counts, _check_query_pixels(query_pixels, model.image_shape)


def _drawn_figures(
    model, x, temperatures, num_samples, num_reconstructions, pairs, interpolation_steps, seed, out, steps
):
    """Samples at each temperature (with and without re-adjusted batch norm), reconstructions, interpolations."""
    from keras_avae import inspection

    crop, pixel_range, records = model.crop, model.pixel_range, []
    sample_grids = []
    for t_index, temperature in enumerate(temperatures):
        for mode in (False, True):
            # The same stream with and without re-adjustment (which puts the
            # generator back after its passes): the same latent noise, so
            # the two grids differ by the batch-norm statistics alone.
            with _seeded(model, seed, _STREAMS["samples"] + t_index):
                drawn = model.sample(num_samples, temperature=temperature, readjust_batch_norm=mode)
            sample_grids.append({"temperature": temperature, "readjust_batch_norm": mode, "images": drawn})
            steps.step()
    records.append(grids.sample_grids(sample_grids, out, crop, pixel_range))

    shown = x[:num_reconstructions]
    with _seeded(model, seed, _STREAMS["reconstructions"]):
        reconstructions = model.reconstruct(shown)
    records.append(grids.reconstruction_grid(shown, reconstructions, out, crop, pixel_range))
    steps.step()

    # At least one pair: `images` holds 2 or more.
    first, second = x[[a for a, _ in pairs]], x[[b for _, b in pairs]]
    with _seeded(model, seed, _STREAMS["interpolations"]):
        path = inspection.interpolate(model, first, second, steps=interpolation_steps)
    records.append(grids.interpolation_grid(path, pairs, out, crop, pixel_range))
    steps.step()
    return records


def _written_figures(model, x, history, temperatures, counts, seed, query_pixels, out, progress):
    """Computes and writes every figure that applies into `out`: `(records, skipped, notes)`."""
    from keras_avae import inspection

    num_samples, num_reconstructions, num_interpolations, interpolation_steps, batch_size = counts
    crop, pixel_range = model.crop, model.pixel_range
    has_generative = any(cell.attend is not None for cell in model.prior_cells)
    has_inference = any(cell.attend is not None for cell in model.posterior_cells)
    pairs = [(2 * i, 2 * i + 1) for i in range(min(num_interpolations, len(x) // 2))]
    steps = _Steps(6 + 2 * len(temperatures), progress)
    records, notes, skipped = [], [], {}

    def skip(key, title, reason):
        notes.append((title, reason))
        skipped[key] = reason

    if history is not None:
        records.append(figures.training_curves(history, out))
    else:
        skip("training_curves", "Training curves", "No run folder was given (--run RUN_DIR), so no history.csv.")
    steps.step()

    with _seeded(model, seed, _STREAMS["kl_per_layer"]):
        kl = inspection.kl_per_layer(model, x, batch_size=batch_size)
    with _seeded(model, seed, _STREAMS["active_units"]):
        active = inspection.active_units(model, x, batch_size=batch_size)
    records.append(figures.kl_per_layer(kl, active, out))
    steps.step()

    if has_generative or has_inference:
        with _seeded(model, seed, _STREAMS["depthwise_attention"]):
            attention = inspection.depthwise_attention(model, x, batch_size=batch_size)
        records.append(figures.depthwise_attention(attention, out))
    else:
        skip("depthwise_attention", "Depth-wise attention", "The model has no depth-wise attention (a baseline).")
    steps.step()

    if model.nonlocal_blocks:
        with _seeded(model, seed, _STREAMS["nonlocal_attention"]):
            blocks = inspection.nonlocal_attention(model, x[:1], query_pixels, batch_size=batch_size)
        records.append(figures.nonlocal_maps(x[0], blocks, query_pixels, out, crop, pixel_range))
    else:
        skip("nonlocal_attention", "Non-local attention maps", "The model has no non-local blocks.")
    steps.step()

    records += _drawn_figures(
        model, x, temperatures, num_samples, num_reconstructions, pairs, interpolation_steps, seed, out, steps
    )
    return records, skipped, notes


def write_report(
    model,
    images,
    out_dir,
    run_dir=None,
    name=None,
    query_pixels=None,
    temperatures=(0.6, 0.8, 1.0),
    num_samples=25,
    progress=True,
    *,
    num_reconstructions=16,
    num_interpolations=4,
    interpolation_steps=8,
    seed=0,
    batch_size=100,
    info=None,
):
    """Writes a report folder: `index.html` and a PNG and JSON per figure.

    Figures: training curves (with `run_dir`), KL per layer with active
    units, depth-wise attention (models with it), non-local attention maps
    of `query_pixels` on the first image (models with non-local blocks),
    sample grids at each temperature with and without batch-norm
    re-adjustment, reconstructions and interpolations. A figure that does
    not apply is left out, and the page says why.

    Args:
        model: a `HierarchicalVAE` (a `DiscreteVAE` is refused: it has no
            layers of KL, no attention and no temperature).
        images: `(N, H, W, C)` images in the model's input range; all N are
            scored, the first ones are drawn.
        out_dir: the report folder (created if needed). The figures go in
            when all are written: a report stopped part-way leaves the
            folder as it was.
        run_dir: a `keras-avae train` run folder whose `history.csv` gives
            the training curves; `None` leaves them out. A folder whose
            `run.json` records another architecture than `model`'s is
            refused (`ValueError`); one without `run.json` is taken as given.
        name: the page's heading, default `model.name`.
        query_pixels: `(row, col)` image pixels for the non-local maps;
            default: 4 pixels spread over the first image's bright pixels.
        temperatures: the sampling temperatures.
        num_samples: samples per grid.
        progress: show a `keras.utils.Progbar` over the steps.
        num_reconstructions: images shown with their reconstructions.
        num_interpolations: pairs of images interpolated (images 0-1, 2-3, ...).
        interpolation_steps: images per interpolation, endpoints included.
        seed: seeds every random step (see the module docstring).
        batch_size: images per pass of the inspection functions; the KL
            and attention numbers depend on it (see the module docstring).
        info: dict of extra rows for the page's header (weights, data, ...).

    Returns:
        A dict: `"index"` (the page's path), `"figures"` (name -> record
        with the `"png"` and `"json"` paths), `"skipped"` (name -> reason)
        and `"seconds"`.

    Example:

    >>> import keras_avae
    >>> model = keras_avae.zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> x = keras_avae.datasets.mnist_test_sample(100)  # doctest: +SKIP
    >>> report = write_report(model, x, "report")  # doctest: +SKIP
    >>> sorted(report["figures"])  # doctest: +SKIP
    ['depthwise_attention', 'interpolations', 'kl_per_layer', 'nonlocal_attention', 'reconstructions', 'samples']
    """
    start = time.time()
    x, temperatures, counts, query_pixels = _checked_arguments(
        model,
        images,
        temperatures,
        (num_samples, num_reconstructions, num_interpolations, interpolation_steps, batch_size),
        seed,
        query_pixels,
    )
    out = _check_out_dir(out_dir)
    history = read_history(run_dir) if run_dir is not None else None  # a missing file fails first
    if run_dir is not None:
        check_run_trained(run_dir, model)
    out.mkdir(parents=True, exist_ok=True)
    with _staging(out) as stage:
        records, skipped, notes = _written_figures(
            model, x, history, temperatures, counts, seed, query_pixels, stage, progress
        )
        _publish(stage, out, records)
    header = {
        "model": f"{type(model).__name__} {model.name!r}",
        "parameters": f"{sum(int(np.prod(w.shape)) for w in model.trainable_weights):,} trainable "
        f"({model.count_params():,} in all)",
        "stochastic layers": model.num_layers,
        "images used": f"{len(x)} images of shape {tuple(x.shape[1:])}",
        **(info or {}),
        "seed": seed,
        # The KL and attention draws follow the batches: the seed alone does not reproduce them.
        "batch size": f"{counts[-1]} images per pass",
        "backend": keras.backend.backend(),
    }
    if run_dir is not None:
        header["run folder"] = str(run_dir)
    index = write_page(out, name or model.name, header, records, notes)
    return {
        "index": str(index),
        "figures": {r["name"]: {**r, "png": str(out / r["png"]), "json": str(out / r["json"])} for r in records},
        "skipped": skipped,
        "seconds": time.time() - start,
    }
