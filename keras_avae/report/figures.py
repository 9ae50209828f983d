"""The report's plots: training curves, KL per layer, depth-wise and non-local attention.

One function per figure. Each draws with matplotlib (Agg, no pyplot),
writes `NAME.png` and `NAME.json` (the numbers drawn, see
`artifacts.jsonable`) into `out_dir` and returns the figure's record (see
`artifacts.save_figure`). The numbers come from `keras_avae.inspection`
(or a run folder's `history.csv`); these functions only draw and save them.
"""

import numpy as np
from matplotlib.ticker import MaxNLocator

from keras_avae.report.artifacts import new_figure
from keras_avae.report.artifacts import save_figure
from keras_avae.report.history import kl_columns

_LOSSES = ("loss", "nelbo", "reconstruction")


def _floats(values):
    return np.array([np.nan if v is None else v for v in values], "float64")


def training_curves(history, out_dir, name="training_curves"):
    """Loss and negative ELBO, and the KL of every layer, against the epoch.

    Args:
        history: a dict of columns, as `history.read_history` returns:
            `epoch` and any of `loss`, `nelbo`, `reconstruction`, `kl`,
            `kl_0` ... `kl_{L-1}` (lists, `None` for a missing value).
        out_dir: the report folder.
        name: the file stem.

    Returns:
        The figure's record (see `artifacts.save_figure`). The JSON holds
        the columns drawn, as in the CSV.

    Example:

    >>> history = {"epoch": [1, 2], "loss": [90.0, 80.0], "nelbo": [95.0, 82.0],
    ...            "kl": [30.0, 20.0], "kl_0": [20.0, 12.0], "kl_1": [10.0, 8.0]}
    >>> training_curves(history, ".")["json"]
    'training_curves.json'
    """
    if "epoch" not in history or not history["epoch"]:
        raise ValueError(f"`history` must hold an `epoch` column with values. Received columns: {sorted(history)}")
    losses = [key for key in _LOSSES if key in history]
    kls = kl_columns(history) + (["kl"] if "kl" in history else [])
    epoch = _floats(history["epoch"])
    figure = new_figure(10, 3.6)
    left, right = figure.subplots(1, 2)
    for key in losses:
        left.plot(epoch, _floats(history[key]), marker="o", markersize=3, label=key)
    left.set(xlabel="epoch", ylabel="nats per image", title="training objective")
    for key in kls:
        style = dict(color="black", linestyle="--") if key == "kl" else {}
        label = "total" if key == "kl" else f"layer {key[3:]}"
        right.plot(epoch, _floats(history[key]), marker="o", markersize=3, label=label, **style)
    right.set(xlabel="epoch", ylabel="KL (nats per image)", title="KL per stochastic layer")
    for axes in (left, right):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if axes.lines:
            axes.legend(fontsize="small", ncol=2 if len(axes.lines) > 6 else 1)
        axes.grid(alpha=0.3)
    numbers = {key: history[key] for key in ["epoch"] + losses + kls}
    caption = (
        "Training curves from the run folder's history.csv, one point per finished epoch. Left: the training "
        "loss (negative ELBO with the KL warm-up weight, plus L2), the negative ELBO (nelbo) and the "
        "reconstruction term, in nats per image; lower is better. Right: the KL of each stochastic layer "
        "(layer 0 is the top one) and their total. A layer whose KL stays near 0 carries no "
        "information about the image (posterior collapse)."
    )
    return save_figure(figure, out_dir, name, numbers, "Training curves", caption)


def kl_per_layer(kl, active, out_dir, name="kl_per_layer"):
    """Bars of each layer's mean KL (+- one standard error) and its active units.

    Args:
        kl: `(N, L)` KL in nats per image and layer (`inspection.kl_per_layer`).
        active: the dict of `inspection.active_units`: `"active"` (L,),
            `"units"`, `"threshold"`.
        out_dir: the report folder.
        name: the file stem.

    Returns:
        The figure's record. The JSON holds `layers`, `kl_mean`,
        `kl_stderr` (`None` with one image), `num_images`, `active`,
        `units` and `threshold`.

    Example:

    >>> kl = np.array([[3.0, 1.0], [5.0, 1.0]], "float32")
    >>> active = {"active": np.array([4, 0]), "units": 80, "threshold": 0.01}
    >>> kl_per_layer(kl, active, ".")["png"]
    'kl_per_layer.png'
    """
    kl = np.asarray(kl, "float64")
    if kl.ndim != 2 or kl.shape[0] == 0:
        raise ValueError(f"`kl` must be (num_images, num_layers). Received: kl.shape={kl.shape}")
    count, layers = kl.shape
    mean = kl.mean(axis=0)
    stderr = kl.std(axis=0, ddof=1) / np.sqrt(count) if count > 1 else np.full(layers, np.nan)
    counts = np.asarray(active["active"], "int64")
    if counts.shape != (layers,):
        raise ValueError(
            f"`active['active']` must hold one count per layer ({layers}). Received: shape {counts.shape}"
        )
    units = int(active["units"])
    index = np.arange(layers)
    figure = new_figure(10, 3.6)
    left, right = figure.subplots(1, 2)
    left.bar(index, mean, yerr=None if count < 2 else stderr, capsize=3, color="tab:blue")
    left.set(xlabel="stochastic layer (0: top)", ylabel="KL (nats per image)", xticks=index)
    left.set_title(f"KL per layer, mean over {count} images (total {mean.sum():.2f} nats)")
    right.bar(index, counts, color="tab:orange")
    right.axhline(units, color="black", linestyle="--", linewidth=1, label=f"units per layer ({units})")
    right.set(xlabel="stochastic layer (0: top)", ylabel="active units", xticks=index, ylim=(0, units * 1.1))
    right.set_title(f"active units (Var_x E_q[z] > {active['threshold']:g})")
    right.legend(fontsize="small", loc="lower right")
    for axes in (left, right):
        axes.grid(axis="y", alpha=0.3)
    numbers = {
        "layers": index,
        "kl_mean": mean,
        "kl_stderr": stderr,
        "num_images": count,
        "active": counts,
        "units": units,
        "threshold": float(active["threshold"]),
    }
    caption = (
        f"Left: the KL divergence of each stochastic layer's posterior from its prior, in nats, averaged over "
        f"the {count} images, with one standard error. Together the bars are the rate term of the ELBO; "
        "layer 0 is the top of the hierarchy. Right: active units per layer, the latent units (channel and "
        "position) whose posterior mean varies across images by more than the threshold (Burda et al., "
        "2016); a layer with none left is unused."
    )
    return save_figure(figure, out_dir, name, numbers, "KL per layer and active units", caption)


def _attended(kind, attention):
    """Where layers attend: the dict's `"attended"`, else the model's structure.

    Not `matrix != 0`: a mean weight that rounds to 0 in float32 is still a
    weight, and must not be drawn as a cell that cannot be attended.
    """
    matrix = np.asarray(attention["matrix"])
    if "attended" in attention:
        attended = np.asarray(attention["attended"], bool)
        if attended.shape != matrix.shape:
            raise ValueError(
                f"`attention[{kind!r}]['attended']` must have the shape of its matrix, {matrix.shape}. "
                f"Received: shape {attended.shape}"
            )
        return attended
    rows, columns = np.indices(matrix.shape)
    # Prior: layer l over the layers above it; posterior: over itself, the deeper ones and x.
    return columns < rows if kind == "generative" else columns >= rows


def _heatmap(axes, matrix, attended, title, xlabels, ylabel, xlabel):
    masked = np.ma.masked_where(~attended, matrix)
    image = axes.imshow(masked, vmin=0.0, vmax=1.0, cmap="viridis")
    axes.set_facecolor("#dddddd")
    rows, columns = matrix.shape
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel, xticks=range(columns), yticks=range(rows))
    axes.set_xticklabels(xlabels)
    if rows * columns <= 400:
        for (row, column), value in np.ndenumerate(matrix):
            if attended[row, column]:
                color = "white" if value < 0.6 else "black"
                axes.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7, color=color)
    return image


def depthwise_attention(attention, out_dir, name="depthwise_attention"):
    """Heatmaps of the depth-wise attention weights, and the learned gates.

    Args:
        attention: the dict of `inspection.depthwise_attention`, holding
            `"generative"` and/or `"inference"`, each with `"matrix"`,
            `"gates"` and optionally `"attended"` (default: the model's
            structure, the layers above for the prior, the layer itself, the
            deeper ones and the image for the posterior). Cells not attended
            are grey.
        out_dir: the report folder.
        name: the file stem.

    Returns:
        The figure's record. The JSON holds, per kind present, `matrix`
        (rows: the attending layer), `attended` and `gates`.

    Example:

    >>> matrix = np.array([[0, 0, 0], [1, 0, 0], [0.3, 0.7, 0]], "float32")
    >>> attention = {"generative": {"matrix": matrix, "gates": np.zeros(3, "float32")}}
    >>> depthwise_attention(attention, ".")["name"]
    'depthwise_attention'
    """
    kinds = [kind for kind in ("generative", "inference") if kind in attention]
    if not kinds:
        raise ValueError(f"`attention` must hold 'generative' or 'inference'. Received keys: {sorted(attention)}")
    figure = new_figure(5.2 * len(kinds) + 4, 4.2)
    panels = figure.subplots(1, len(kinds) + 1, gridspec_kw={"width_ratios": [1.25] * len(kinds) + [1]})
    numbers, image = {}, None
    for axes, kind in zip(panels, kinds):
        matrix = np.asarray(attention[kind]["matrix"], "float32")
        attended = _attended(kind, attention[kind])
        layers = matrix.shape[0]
        if kind == "generative":
            labels = [str(m) for m in range(matrix.shape[1])]
            titles = ("prior (generative)", "attending layer l", "context of layer m < l")
        else:
            labels = [str(m) for m in range(layers)] + ["x"]
            titles = ("posterior (inference)", "attending layer l", "feature h_m (m >= l)")
        image = _heatmap(axes, matrix, attended, titles[0], labels, titles[1], titles[2])
        gates = np.asarray(attention[kind]["gates"], "float32")
        numbers[kind] = {"matrix": matrix, "attended": attended, "gates": gates}
    figure.colorbar(image, ax=list(panels[:-1]), shrink=0.8, label="mean attention weight")
    gates_axes = panels[-1]
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        gates = numbers[kind]["gates"]
        gates_axes.bar(np.arange(len(gates)) + (k - (len(kinds) - 1) / 2) * width, gates, width, label=kind)
    gates_axes.axhline(0, color="black", linewidth=0.8)
    gates_axes.set(title="attention gates", xlabel="layer", ylabel="gate value", xticks=range(layers))
    gates_axes.legend(fontsize="small")
    caption = (
        "Depth-wise attention, averaged over the images and pixels. Each row is one stochastic layer l "
        "(0: top) and shows how it splits its attention, so every row that attends sums to 1. Prior: "
        "layer l attends over the contexts of the layers above it (m < l; layer 0 has nothing to attend). "
        "Posterior: layer l attends over its own bottom-up feature (m = l), the deeper ones (m > l) and "
        "the pre-processed image (column x). Grey cells cannot be attended. Right: the learned scalar gate "
        "through which each layer's attention enters; a gate near 0 means that attention is hardly used, "
        "whatever its weights."
    )
    return save_figure(figure, out_dir, name, numbers, "Depth-wise attention", caption)


def nonlocal_maps(image, blocks, query_pixels, out_dir, crop=0, pixel_range=(0.0, 1.0), name="nonlocal_attention"):
    """Non-local attention maps of a few query pixels, drawn over an input image.

    Args:
        image: `(H, W, C)` the input image (uncropped).
        blocks: the dict of `inspection.nonlocal_attention` for this one
            image: block name -> `"query_pixels"` (at the block's
            resolution), `"maps"` `(1, Q, h_b, w_b)` or `(Q, h_b, w_b)`,
            `"gamma"`, `"attention"`.
        query_pixels: the Q `(row, col)` query pixels, in image coordinates.
        out_dir: the report folder.
        crop: pixels of padding left out of the display on each side.
        pixel_range: `(low, high)` of the pixel values.
        name: the file stem.

    Returns:
        The figure's record. The JSON holds `image`, `crop`,
        `query_pixels` and, per block, `query_pixels`, `maps` `(Q, h_b,
        w_b)`, `gamma` and `attention`.

    Example:

    >>> maps = np.full((1, 2, 4, 4), 1 / 16, "float32")
    >>> blocks = {"merge": {"query_pixels": [(0, 0), (2, 2)], "maps": maps,
    ...                     "gamma": 0.5, "attention": "softmax"}}
    >>> nonlocal_maps(np.zeros((8, 8, 1)), blocks, [(1, 1), (5, 5)], ".")["png"]
    'nonlocal_attention.png'
    """
    image = np.asarray(image, "float32")
    if image.ndim != 3:
        raise ValueError(f"`image` must be one image (H, W, C). Received: image.shape={image.shape}")
    if not blocks:
        raise ValueError("`blocks` must hold at least one non-local block. Received: blocks={}")
    height, width = image.shape[:2]
    low, high = pixel_range
    shown = np.clip((image - low) / (high - low), 0.0, 1.0)
    shown = shown[..., 0] if shown.shape[-1] == 1 else shown
    query_pixels = [tuple(int(v) for v in q) for q in query_pixels]
    rows, columns = len(blocks), len(query_pixels)
    figure = new_figure(1.9 * columns + 1.6, 1.9 * rows + 0.6)
    panels = np.asarray(figure.subplots(rows, columns, squeeze=False))
    extent = (-0.5, width - 0.5, height - 0.5, -0.5)
    numbers = {"image": image, "crop": int(crop), "query_pixels": query_pixels, "blocks": {}}
    for row, (block, result) in enumerate(blocks.items()):
        maps = np.asarray(result["maps"], "float32")
        maps = maps[0] if maps.ndim == 4 else maps
        if maps.shape[0] != columns:
            raise ValueError(
                f"`blocks[{block!r}]['maps']` must hold one map per query pixel ({columns}). "
                f"Received: maps.shape={maps.shape}"
            )
        for column, (axes, (qr, qc)) in enumerate(zip(panels[row], query_pixels)):
            axes.imshow(shown, cmap="gray", vmin=0.0, vmax=1.0, extent=extent, interpolation="nearest")
            axes.imshow(
                maps[column], cmap="inferno", alpha=0.65, extent=extent, interpolation="nearest",
                vmin=0.0, vmax=float(maps[column].max()),
            )
            axes.plot(qc, qr, marker="+", color="cyan", markersize=10, markeredgewidth=2)
            axes.set(xlim=(crop - 0.5, width - crop - 0.5), ylim=(height - crop - 0.5, crop - 0.5))
            axes.set_xticks([])
            axes.set_yticks([])
            if row == 0:
                axes.set_title(f"query ({qr}, {qc})", fontsize=9)
        gamma = float(result["gamma"])
        label = block.split("/", 1)[-1]  # the path without the model's name
        panels[row, 0].set_ylabel(f"{label}\n{result['attention']}, gamma {gamma:.3g}", fontsize=7)
        numbers["blocks"][block] = {
            "query_pixels": [[int(v) for v in q] for q in result["query_pixels"]],
            "maps": maps,
            "gamma": gamma,
            "attention": result["attention"],
        }
    caption = (
        "Non-local attention: for each block (row) and query pixel (column, the cyan cross, in image "
        "coordinates) the weights with which that pixel of the block's feature map attends to every other "
        "position, drawn over the input image at the block's resolution (each map sums to 1 and is coloured "
        "from 0, black, to its own maximum, bright). gamma is the block's learned output scale: near 0 the "
        "block hardly changes its input. "
        "Performer blocks show the implicit FAVOR+ weights."
    )
    return save_figure(figure, out_dir, name, numbers, "Non-local attention maps", caption)
