"""`keras-avae sample` and `keras-avae demo`: PNG grids of prior samples (and, in the demo, reconstructions)."""

import math
import os
import sys
import time

from keras_avae.cli.arguments import UsageError
from keras_avae.cli.arguments import _parse_sets
from keras_avae.cli.backend import _backend
from keras_avae.cli.backend import _import_backend
from keras_avae.cli.checks import _check_dir
from keras_avae.cli.checks import _check_name
from keras_avae.cli.checks import _check_weights
from keras_avae.cli.checks import _load_model


def _cmd_sample(args):
    _check_name(args.name)
    if not args.out.lower().endswith(".png"):
        raise UsageError(f"--out must name a .png file. Received: --out {args.out!r}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _check_dir(out_dir, "--out (its folder)")
    _check_weights(args)
    _parse_sets(args.set)
    # A weights file is checked against its run folder's run.json through
    # the model's config, which Keras serialises with TensorFlow when it is
    # installed: imported here, its start-up lines stay hidden on every backend.
    _import_backend(args, tensorflow=args.weights != "pretrained")
    import inspect

    import numpy as np
    from keras import ops

    model = _load_model(args)
    kwargs = {"temperature": args.temperature} if "temperature" in inspect.signature(model.sample).parameters else {}
    if "temperature" not in kwargs and args.temperature != 1.0:
        raise UsageError(f"{args.name} has no sampling temperature. Received: --temperature {args.temperature}")
    images = np.asarray(ops.convert_to_numpy(model.sample(args.num, **kwargs)))
    per_row = max(1, int(math.ceil(math.sqrt(args.num))))
    _save_grid(args.out, model, [images[i : i + per_row] for i in range(0, len(images), per_row)])
    print(f"Wrote {args.num} samples to {args.out}", file=sys.stderr)


def _save_grid(path, model, rows):
    """A PNG grid of image rows, cropped to the data (no padding), blanks filling short rows."""
    import numpy as np

    from keras_avae import training

    crop, width = model.crop, max(len(row) for row in rows)
    rows = [np.asarray(row)[:, crop : row.shape[1] - crop, crop : row.shape[2] - crop] for row in rows]
    for i, row in enumerate(rows):
        if len(row) < width:
            blank = np.full((width - len(row),) + row.shape[1:], model.pixel_range[0], row.dtype)
            rows[i] = np.concatenate([row, blank])
    training.save_image_grid(path, rows, value_range=model.pixel_range)


def _cmd_demo(args):
    """Scores the shipped test sample of the entry's data set with its pretrained weights and draws PNGs."""
    from keras_avae import zoo

    _check_name(args.name)
    entry = zoo.describe(args.name)
    if not zoo.has_pretrained(args.name):
        trained = [n for n in zoo.names() if zoo.has_pretrained(n)]
        raise UsageError(f"the demo needs a pretrained entry ({', '.join(trained)}). Received: {args.name!r}")
    os.makedirs(args.out, exist_ok=True)
    _import_backend(args)
    import numpy as np
    from keras import ops

    from keras_avae import datasets
    from keras_avae import evaluation

    start = time.time()
    model = zoo.load(args.name, weights="pretrained", seed=args.seed)
    x = datasets.shipped_sample(entry["dataset"], args.num_images, seed=0)
    scores = evaluation.score_batches(model, [x], num_samples=args.num_samples, seed=args.seed)
    figures = evaluation.summarize(scores["log_px"], scores["elbo"], model.num_data_dims)
    card = entry.get("results")

    samples = np.asarray(ops.convert_to_numpy(model.sample(64)))
    _save_grid(os.path.join(args.out, "samples.png"), model, [samples[i : i + 8] for i in range(0, 64, 8)])
    shown = x[:32]
    recon = np.asarray(ops.convert_to_numpy(model.reconstruct(shown)))
    rows = [r for i in range(0, len(shown), 8) for r in (shown[i : i + 8], recon[i : i + 8])]
    _save_grid(os.path.join(args.out, "reconstructions.png"), model, rows)

    print(f"{args.name}: pretrained weights, {model.count_params():,} parameters, backend {_backend()}")
    print(
        f"{len(x)} {datasets.SAMPLE_SOURCES[entry['dataset']]}, shipped with keras-avae, "
        f"K={args.num_samples} importance samples:"
    )
    print(
        f"  test NLL   {figures['nll_nats']:.2f} nats (+- {figures['nll_stderr'] or float('nan'):.2f} s.e.), "
        f"{figures['bits_per_dim']:.4f} bits/dim"
    )
    print(f"  ELBO      {figures['elbo_nats']:.2f} nats")
    if card:
        print(
            f"  model card: {card['test_nll_nats']:.2f} nats on {card['test_images']} test images with "
            f"K={card['importance_samples']}; negative ELBO "
            f"{card['shipped_sample_nelbo_nats']:.2f} nats on the 100 shipped images"
        )
    print(f"Wrote {os.path.join(args.out, 'samples.png')} (64 samples) and")
    print(f"      {os.path.join(args.out, 'reconstructions.png')} (rows: test images, their reconstructions)")
    print(f"Done in {time.time() - start:.0f} s")
