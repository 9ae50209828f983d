"""The report's image grids: samples, reconstructions, interpolations.

Images are cropped by `crop` pixels on each side (the padding the
likelihood ignores) and mapped from `pixel_range` for display; the JSON of
each figure holds the cropped float images it draws.
"""

import math

import numpy as np

from keras_avae.report.artifacts import new_figure
from keras_avae.report.artifacts import save_figure
from keras_avae.training.images import image_grid

# Screen pixels per image pixel in the PNGs (at 100 dpi).
_ZOOM = 2.0


def crop_images(images, crop):
    """`images[..., crop:H-crop, crop:W-crop, :]`: the padding cut off each side.

    Args:
        images: an array `(..., H, W, C)`.
        crop: non-negative int.

    Returns:
        A float32 NumPy array `(..., H - 2 crop, W - 2 crop, C)`.

    Example:

    >>> crop_images(np.zeros((3, 32, 32, 1)), 2).shape
    (3, 28, 28, 1)
    """
    images = np.asarray(images, "float32")
    if crop < 0 or 2 * crop >= min(images.shape[-3:-1]):
        raise ValueError(f"`crop` must be in [0, min(H, W) / 2). Received: crop={crop}, images.shape={images.shape}")
    height, width = images.shape[-3:-1]
    return images[..., crop : height - crop, crop : width - crop, :]


def _draw(axes, rows, pixel_range, title=None):
    """Tiles image rows into one picture on `axes` (white 1-pixel borders)."""
    grid = image_grid(rows, padding=1, value_range=pixel_range)
    if grid.shape[-1] == 1:
        axes.imshow(grid[..., 0], cmap="gray", vmin=0, vmax=255, interpolation="nearest")
    else:
        axes.imshow(grid, interpolation="nearest")
    axes.set_xticks([])
    axes.set_yticks([])
    if title:
        axes.set_title(title, fontsize=9)
    return grid.shape


def _inches(pixels):
    return pixels * _ZOOM / 100.0


def _rows(images, per_row):
    return [images[i : i + per_row] for i in range(0, len(images), per_row)]


def sample_grids(grids, out_dir, crop=0, pixel_range=(0.0, 1.0), name="samples"):
    """Sample grids, one panel per temperature, with and without batch-norm re-adjustment.

    Args:
        grids: list of dicts `{"temperature": float, "readjust_batch_norm":
            bool, "images": (n, H, W, C)}` (from `model.sample`).
        out_dir: the report folder.
        crop: pixels of padding cut off each side for display.
        pixel_range: `(low, high)` of the pixel values.
        name: the file stem.

    Returns:
        The figure's record. The JSON holds `pixel_range`, `crop` and
        `grids`: per panel `temperature`, `readjust_batch_norm` and the
        cropped `images`.

    Example:

    >>> grids = [{"temperature": t, "readjust_batch_norm": False,
    ...           "images": np.random.rand(4, 8, 8, 1)} for t in (0.6, 1.0)]
    >>> sample_grids(grids, ".")["json"]
    'samples.json'
    """
    if not grids:
        raise ValueError("`grids` must hold at least one grid of samples. Received: grids=[]")
    temperatures = sorted({float(g["temperature"]) for g in grids})
    modes = sorted({bool(g["readjust_batch_norm"]) for g in grids})
    count = max(len(g["images"]) for g in grids)
    per_row = max(1, math.ceil(math.sqrt(count)))
    first = crop_images(grids[0]["images"], crop)
    side = per_row * (first.shape[-2] + 1) + 1
    panel = max(_inches(side), 1.4)
    figure = new_figure(len(temperatures) * (panel + 0.3) + 0.4, len(modes) * (panel + 0.6))
    panels = np.asarray(figure.subplots(len(modes), len(temperatures), squeeze=False))
    numbers = {"pixel_range": list(pixel_range), "crop": int(crop), "grids": []}
    for grid in grids:
        images = crop_images(grid["images"], crop)
        temperature, readjust = float(grid["temperature"]), bool(grid["readjust_batch_norm"])
        axes = panels[modes.index(readjust), temperatures.index(temperature)]
        title = f"T = {temperature:g}" + ("\nbatch norm re-adjusted" if readjust else "")
        _draw(axes, _rows(images, per_row), pixel_range, title)
        numbers["grids"].append({"temperature": temperature, "readjust_batch_norm": readjust, "images": images})
    caption = (
        f"Samples from the prior, {count} per panel: each latent z_l is drawn at the panel's temperature T "
        "(its prior's scale multiplied by T; T = 1 is the model's prior, lower T gives cleaner but less varied "
        "images) and the image shown is the mean of p(x | z). "
        + (
            "Bottom row: the batch-norm statistics are first re-estimated on samples drawn at that temperature "
            "(NVAE's readjust_bn), then restored; this often repairs low-temperature samples."
            if True in modes
            else ""
        )
    )
    return save_figure(figure, out_dir, name, numbers, "Samples", caption.strip())


def reconstruction_grid(inputs, reconstructions, out_dir, crop=0, pixel_range=(0.0, 1.0), per_row=8,
                        indices=None, name="reconstructions"):
    """Input images and their reconstructions, in interleaved rows.

    Args:
        inputs: `(n, H, W, C)` images.
        reconstructions: `(n, H, W, C)`, `model.reconstruct(inputs)`.
        out_dir: the report folder.
        crop: pixels of padding cut off each side for display.
        pixel_range: `(low, high)` of the pixel values.
        per_row: images per row.
        indices: the images' indices in the report's image set (for the
            JSON), default `0 ... n-1`.
        name: the file stem.

    Returns:
        The figure's record. The JSON holds `indices`, the cropped
        `inputs` and `reconstructions`, `per_row`, `crop` and
        `pixel_range`.

    Example:

    >>> x = np.random.rand(4, 8, 8, 1)
    >>> reconstruction_grid(x, x, ".", per_row=2)["name"]
    'reconstructions'
    """
    inputs, reconstructions = crop_images(inputs, crop), crop_images(reconstructions, crop)
    if inputs.shape != reconstructions.shape:
        raise ValueError(
            f"`inputs` and `reconstructions` must have one shape. Received: {inputs.shape} and "
            f"{reconstructions.shape} (after cropping)"
        )
    indices = list(range(len(inputs))) if indices is None else [int(i) for i in indices]
    rows = [r for pair in zip(_rows(inputs, per_row), _rows(reconstructions, per_row)) for r in pair]
    width = min(per_row, len(inputs)) * (inputs.shape[-2] + 1) + 1
    height = len(rows) * (inputs.shape[-3] + 1) + 1
    figure = new_figure(_inches(width) + 0.4, _inches(height) + 0.5)
    _draw(figure.subplots(), rows, pixel_range, "rows: inputs, then their reconstructions")
    numbers = {
        "indices": indices,
        "per_row": int(per_row),
        "crop": int(crop),
        "pixel_range": list(pixel_range),
        "inputs": inputs,
        "reconstructions": reconstructions,
    }
    caption = (
        f"Reconstructions of {len(inputs)} images: each row of inputs is followed by a row of their "
        "reconstructions, the mean of p(x | z) for one posterior sample z ~ q(z | x). Differences show "
        "what the latents do not keep."
    )
    return save_figure(figure, out_dir, name, numbers, "Reconstructions", caption)


def interpolation_grid(images, pairs, out_dir, crop=0, pixel_range=(0.0, 1.0), name="interpolations"):
    """Rows of images decoded along a path between two images' latents.

    Args:
        images: `(B, steps, H, W, C)` from `inspection.interpolate`, the
            endpoints included.
        pairs: the B `(a, b)` index pairs of the report's images.
        out_dir: the report folder.
        crop: pixels of padding cut off each side for display.
        pixel_range: `(low, high)` of the pixel values.
        name: the file stem.

    Returns:
        The figure's record. The JSON holds `pairs`, `steps`, `crop`,
        `pixel_range` and the cropped `images`.

    Example:

    >>> interpolation_grid(np.random.rand(2, 5, 8, 8, 1), [(0, 1), (2, 3)], ".")["png"]
    'interpolations.png'
    """
    images = crop_images(images, crop)
    if images.ndim != 5 or len(images) != len(pairs):
        raise ValueError(
            f"`images` must be (len(pairs), steps, H, W, C). Received: images.shape={images.shape} "
            f"(after cropping), {len(pairs)} pairs"
        )
    steps = images.shape[1]
    width = steps * (images.shape[-2] + 1) + 1
    height = len(images) * (images.shape[-3] + 1) + 1
    figure = new_figure(_inches(width) + 0.4, _inches(height) + 0.5)
    _draw(figure.subplots(), list(images), pixel_range, "one row per pair of images")
    numbers = {
        "pairs": [[int(a), int(b)] for a, b in pairs],
        "steps": int(steps),
        "crop": int(crop),
        "pixel_range": list(pixel_range),
        "images": images,
    }
    caption = (
        f"Interpolations between {len(images)} pairs of images, {steps} steps each, endpoints included: every "
        "layer's latent moves on a straight line from the posterior mean of the first image (left) to that "
        "of the second (right), and each point is decoded (the mean of p(x | z)). Smooth rows mean a smooth "
        "latent space."
    )
    return save_figure(figure, out_dir, name, numbers, "Interpolations", caption)
