"""`keras-avae report`: its flags and the command, an offline HTML page of figures (`keras_avae.report`)."""

import json
import os
import sys

from keras_avae.cli.arguments import UsageError
from keras_avae.cli.arguments import _DATA_DIR_HELP
from keras_avae.cli.arguments import _parse_sets
from keras_avae.cli.arguments import _positive
from keras_avae.cli.arguments import _seed_below
from keras_avae.cli.arguments import _RESIZE_HELP
from keras_avae.cli.arguments import _set_help
from keras_avae.cli.backend import _import_backend
from keras_avae.cli.checks import _check_dir
from keras_avae.cli.checks import _check_name
from keras_avae.cli.checks import _check_weights
from keras_avae.cli.checks import _load_model


def _add_report_parser(commands, backend):
    report = commands.add_parser(
        "report", parents=[backend], help="offline HTML page of figures: KL, attention, samples, curves"
    )
    report.add_argument("name", help="zoo entry (a hierarchical VAE), see `keras-avae zoo`")
    report.add_argument("--weights", required=True, help="a .weights.h5 file, or 'pretrained'")
    report.add_argument("--data-dir", required=True, help=_DATA_DIR_HELP)
    report.add_argument("--out", required=True, help="report folder: index.html, a PNG and a JSON per figure")
    report.add_argument("--run", metavar="RUN_DIR", help="run folder whose history.csv gives training curves "
                        "(default: no curves)")
    report.add_argument("--split", choices=("test", "train"), default="test", help="data split")
    report.add_argument("--num-images", type=_positive(int), default=500, help="the first N images of the split")
    report.add_argument("--every", type=_positive(int),
                        help="every K-th image of the split, before --num-images: images spread over the whole "
                        "split, as `evaluate --every` (OMNIGLOT's test split is ordered by alphabet) "
                        "(default: all)")
    report.add_argument("--resize-images", action="store_true", help=_RESIZE_HELP)
    report.add_argument("--temperatures", type=_positive(float), nargs="+",
                        help="sampling temperatures (default: 0.6 0.8 1.0)")
    report.add_argument("--num-samples", type=_positive(int), default=25, help="samples per grid")
    report.add_argument("--batch-size", type=_positive(int), default=100,
                        help="images per pass; the KL and attention numbers depend on it (their draws follow the "
                        "batches)")
    report.add_argument(
        "--seed", type=_seed_below(2**31, "2**31"), default=0, help="binarisation and sampling seed, 0 to 2**31 - 1"
    )
    report.add_argument("--set", action="append", metavar="KEY=VALUE", help=_set_help("a model config value"))


def _check_run_entry(args):
    """Refuses a `--run` that trained another zoo entry, before the model and data load.

    A run folder without `run.json` (a `history.csv` alone) is taken as
    given, as before: nothing in it says which model it trained.
    `--weights RUN/model.weights.h5 --run RUN` agrees by construction.
    """
    from keras_avae import zoo

    try:  # without Keras, which the backend import comes before; a damaged file is named after it
        with open(os.path.join(args.run, "run.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return
    entry = record.get("model") if isinstance(record, dict) else None
    if entry in zoo.names() and entry != args.name:  # a Python run of a model object names its class
        raise UsageError(
            f"--run {args.run}: its run.json records a run of {entry!r}, not of {args.name!r}, the model "
            f"reported: its training curves would sit beside another model's figures. Pass a run folder of "
            f"{args.name}, or leave out --run. Received: --run {args.run!r}"
        )


def _cmd_report(args):
    from keras_avae import zoo

    _check_name(args.name)
    if zoo.describe(args.name)["family"] != "hierarchical_vae":
        raise UsageError(f"report needs a hierarchical VAE (KL per layer, attention); {args.name} is a "
                         f"{zoo.describe(args.name)['family']}. Received: {args.name!r}")
    _check_dir(args.data_dir, "--data-dir")
    if args.run is not None and not os.path.isfile(os.path.join(args.run, "history.csv")):
        raise UsageError(f"--run: no history.csv in the run folder: {os.path.join(args.run, 'history.csv')!r}")
    _check_weights(args)
    _parse_sets(args.set)
    if args.run is not None:
        _check_run_entry(args)
    _import_backend(args, tensorflow=True)
    from keras_avae import report
    from keras_avae.report.builder import _check_out_dir
    from keras_avae.report.history import check_run_trained

    try:  # before the model and data load: it failed after them with mkdir's "File exists"
        _check_out_dir(args.out, "--out")
    except ValueError as error:
        raise UsageError(str(error)) from None

    model = _load_model(args)
    if args.run is not None:
        try:  # the architecture (--set), before the data load
            check_run_trained(args.run, model, name="--run")
        except ValueError as error:
            raise UsageError(str(error)) from None
    data = zoo.describe(args.name)["dataset"]
    images, source = report.load_images(
        data, args.data_dir, args.split, args.num_images, seed=args.seed, resize_images=args.resize_images,
        every=args.every,
    )
    pretrained = args.weights == "pretrained"
    weights = f"the zoo's pretrained {zoo.pretrained_path(args.name).name}" if pretrained else args.weights
    info = {"weights": weights, "images": source, "settings": " ".join(args.set or []) or "the entry's"}
    temperatures = args.temperatures or (0.6, 0.8, 1.0)
    written = report.write_report(
        model, images, args.out, run_dir=args.run, name=args.name, temperatures=temperatures,
        num_samples=args.num_samples, seed=args.seed, batch_size=args.batch_size, info=info,
    )
    print(f"Wrote {written['index']}: {len(written['figures'])} figures, {len(written['skipped'])} left out "
          f"({', '.join(written['skipped']) or 'none'}), {written['seconds']:.0f} s", file=sys.stderr)
