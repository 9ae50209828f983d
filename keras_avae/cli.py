"""The `keras-avae` command line: `train`, `evaluate`, `sample`, `zoo`, `demo`, `report`.

    keras-avae demo                      # offline: pretrained model, shipped MNIST sample
    keras-avae zoo
    keras-avae train mnist-attentive-small --data-dir DATA/mnist --output runs/att
    keras-avae evaluate mnist-attentive-small --weights runs/att/model.weights.h5 \\
        --data-dir DATA/mnist --num-samples 100 --limit 1000
    keras-avae sample mnist-attentive-small --weights pretrained --out samples.png
    keras-avae report mnist-attentive-small --weights pretrained --data-dir DATA/mnist --out report

Every error a user can cause (unknown entry, bad flag or value, missing or
corrupt file) ends the program with status 2 and one line on stderr, no
traceback. `--weights pretrained` loads the weights shipped with an entry.

Keras and the backend are imported only by the commands that compute
(`train`, `evaluate`, `sample`, `demo`, `report`), after their arguments are checked,
so `--help`, `zoo` and argument errors answer at once. Their start-up log
lines (TensorFlow's oneDNN and CUDA notices) are hidden unless
`--backend-logs` is given or `TF_CPP_MIN_LOG_LEVEL` is set to 0.
"""

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import sys
import time

_STRATEGIES = ("auto", "mirrored", "multi-worker", "one-device")
_DATA_DIR_HELP = "folder with the original data files, or with your own PNG/JPEG images"
_RESIZE_HELP = (
    "with --data-dir a folder of images: resize images of another size than the entry's (28x28 grey, "
    "32x32 RGB) instead of refusing them"
)


class UsageError(Exception):
    """A mistake on the command line; reported in one line."""


def _parse_value(text):
    """`--set` values: JSON when it parses (numbers, lists, true/null), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_sets(pairs):
    overrides = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects key=value. Received: --set {pair!r}")
        overrides[key.strip()] = _parse_value(value)
    return overrides


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, received {text!r}")
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a finite positive {kind.__name__}, received {text!r}")
        return value

    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: ...)` after every option with a value; `None` defaults say theirs in words."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) with status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _set_help(what):
    from keras_avae import zoo

    neutral = ", ".join(sorted(zoo._NEUTRAL_OVERRIDES))
    return (
        f"override {what} (repeatable; default: the entry's values). With --weights pretrained only "
        f"{neutral} and values equal to the entry's are accepted; other keys change the architecture"
    )


def _build_parser():
    parser = _Parser(
        prog="keras-avae", description="Deep attentive VAEs: train, evaluate and sample zoo models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    # The commands that import Keras and the backend.
    backend = argparse.ArgumentParser(add_help=False)
    backend.add_argument(
        "--backend-logs",
        action="store_true",
        help="show TensorFlow/JAX log lines (hidden by default, as with TF_CPP_MIN_LOG_LEVEL=3)",
    )

    commands.add_parser("zoo", help="list the zoo entries with their descriptions")

    train = commands.add_parser(
        "train", parents=[backend], help="train a zoo entry (resumes a killed run in --output)"
    )
    train.add_argument("name", help="zoo entry, see `keras-avae zoo`")
    train.add_argument("--data-dir", required=True, help=_DATA_DIR_HELP)
    train.add_argument("--output", required=True, help="run folder: checkpoints, logs, PNGs, final model")
    train.add_argument("--epochs", type=_positive(int), help="total epochs (default: the entry's recipe)")
    train.add_argument(
        "--steps-per-epoch", type=_positive(int), help="default: the recipe's, else one pass over the data"
    )
    train.add_argument("--batch-size", type=_positive(int), help="per-replica batch (default: the recipe's)")
    train.add_argument(
        "--strategy",
        choices=_STRATEGIES,
        default="auto",
        help="distribution strategy: tf.distribute on TensorFlow, keras.distribution.DataParallel on JAX",
    )
    train.add_argument(
        "--cpu-devices",
        type=_positive(int),
        help="N CPU devices, to train data-parallel without GPUs: TensorFlow splits the CPU into N logical "
        "devices, JAX sets XLA's host platform device count (default: no split)",
    )
    train.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        help="JAX --strategy multi-worker: process 0's address (default: KERAS_DISTRIBUTION_JOB_ADDRESSES; "
        "TensorFlow workers read TF_CONFIG)",
    )
    train.add_argument(
        "--num-processes",
        type=_positive(int),
        help="JAX --strategy multi-worker: number of processes (default: KERAS_DISTRIBUTION_NUM_PROCESSES)",
    )
    train.add_argument(
        "--process-id",
        type=int,
        help="JAX --strategy multi-worker: this process's id, 0 for the chief "
        "(default: KERAS_DISTRIBUTION_PROCESS_ID)",
    )
    train.add_argument("--limit", type=_positive(int), help="use only the first N training images (default: all)")
    train.add_argument("--resize-images", action="store_true", help=_RESIZE_HELP)
    train.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    train.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deterministic kernels, so that the same command and --seed give the same numbers on one machine "
        "(default: on; --no-deterministic may be faster on a GPU)",
    )
    train.add_argument("--save-freq", default="epoch", help="'epoch' or N: checkpoint every N steps too")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model or recipe value "
                       "(repeatable; default: the entry's values)")
    train.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2), help="Keras fit verbosity")

    evaluate = commands.add_parser(
        "evaluate", parents=[backend], help="importance-sampled test NLL, printed as JSON"
    )
    evaluate.add_argument("name", help="zoo entry, see `keras-avae zoo`")
    evaluate.add_argument("--weights", required=True, help="a .weights.h5 file, or 'pretrained'")
    evaluate.add_argument("--data-dir", required=True, help=_DATA_DIR_HELP)
    evaluate.add_argument("--split", choices=("test", "train"), default="test", help="data split")
    evaluate.add_argument("--num-samples", type=_positive(int), default=100, help="K importance samples")
    evaluate.add_argument("--limit", type=_positive(int), help="the first N examples of the split (default: all)")
    evaluate.add_argument("--resize-images", action="store_true", help=_RESIZE_HELP)
    evaluate.add_argument("--batch-size", type=_positive(int), default=25, help="images per pass")
    evaluate.add_argument("--seed", type=int, default=0, help="binarisation and sampling seed")
    evaluate.add_argument("--set", action="append", metavar="KEY=VALUE", help=_set_help("a model config value"))
    evaluate.add_argument(
        "--progress",
        metavar="FILE.npz",
        help="save per-image results after every batch; run again with the same file to resume "
        "(default: no file)",
    )
    evaluate.add_argument("--verbose", type=int, default=0, choices=(0, 1), help="1: a line per batch on stderr")

    sample = commands.add_parser("sample", parents=[backend], help="draw images from the prior into a PNG grid")
    sample.add_argument("name", help="zoo entry, see `keras-avae zoo`")
    sample.add_argument("--weights", required=True, help="a .weights.h5 file, or 'pretrained'")
    sample.add_argument("--num", type=_positive(int), default=64, help="number of images")
    sample.add_argument("--temperature", type=_positive(float), default=1.0, help="prior temperature")
    sample.add_argument("--out", required=True, help="output .png file")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed")
    sample.add_argument("--set", action="append", metavar="KEY=VALUE", help=_set_help("a model config value"))

    demo = commands.add_parser(
        "demo",
        parents=[backend],
        help="offline: score the shipped MNIST test sample with a pretrained model, write PNG grids",
    )
    demo.add_argument("--name", default="mnist-attentive-small", help="a pretrained MNIST entry")
    demo.add_argument("--out", default="keras-avae-demo", help="folder for samples.png and reconstructions.png")
    demo.add_argument("--num-images", type=_positive(int), default=100, help="1 to 100 shipped test images")
    demo.add_argument("--num-samples", type=_positive(int), default=100, help="K importance samples")
    demo.add_argument("--seed", type=int, default=0, help="sampling seed")
    _add_report_parser(commands, backend)
    return parser


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
    report.add_argument("--resize-images", action="store_true", help=_RESIZE_HELP)
    report.add_argument("--temperatures", type=_positive(float), nargs="+",
                        help="sampling temperatures (default: 0.6 0.8 1.0)")
    report.add_argument("--num-samples", type=_positive(int), default=25, help="samples per grid")
    report.add_argument("--batch-size", type=_positive(int), default=100, help="images per pass")
    report.add_argument("--seed", type=int, default=0, help="binarisation and sampling seed")
    report.add_argument("--set", action="append", metavar="KEY=VALUE", help=_set_help("a model config value"))


@contextlib.contextmanager
def _stderr_silenced():
    """Sends file descriptor 2 to /dev/null (C++ libraries write there, not to `sys.stderr`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _import_backend(args, tensorflow=False):
    """Imports Keras (and TensorFlow when the command uses `tf.data`), quietly unless asked.

    TensorFlow prints its oneDNN and CUDA notices while it is imported,
    before `TF_CPP_MIN_LOG_LEVEL` takes effect, so they are hidden by
    silencing stderr for the import; the variable (3 unless the user set it)
    hides the later ones. `--backend-logs`, or `TF_CPP_MIN_LOG_LEVEL=0`,
    shows everything.
    """
    import keras_avae

    if "keras_avae.training" in sys.modules and (not tensorflow or "tensorflow" in sys.modules):
        return  # already imported (a second command in one process, the tests)
    quiet = not args.backend_logs and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3") != "0"
    if quiet:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with _stderr_silenced() if quiet else contextlib.nullcontext():
        import keras  # noqa: F401  (imports the backend)

        if tensorflow and importlib.util.find_spec("tensorflow") is not None:
            import tensorflow  # noqa: F401
        # What `import keras_avae` imports outside the command line: some
        # modules import TensorFlow (or its relatives) on every backend.
        for module in keras_avae._SUBMODULES:
            importlib.import_module(f"keras_avae.{module}")
        from keras_avae.distributions.tfp import has_tfp, tfd

        if has_tfp():
            tfd()  # TFP's JAX substrate imports TensorFlow too
    if quiet:
        if "absl.logging" in sys.modules:
            sys.modules["absl.logging"].set_verbosity("error")
        # "An NVIDIA GPU may be present ... Falling back to cpu" and the like.
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
        logging.getLogger("tensorflow").setLevel(logging.ERROR)


def _check_name(name):
    from keras_avae import zoo

    if name not in zoo.names():
        raise UsageError(f"unknown zoo entry {name!r}; `keras-avae zoo` lists them ({', '.join(zoo.names())})")


def _check_dir(path, flag):
    if not os.path.isdir(path):
        raise UsageError(f"{flag}: no such directory: {path!r}")


def _check_weights(args):
    if args.weights != "pretrained" and not os.path.isfile(args.weights):
        raise UsageError(f"--weights: no such file: {args.weights!r}")


def _load_model(args):
    """`zoo.load` with `--weights` and `--set`: the same rules as in Python."""
    from keras_avae import zoo

    _check_weights(args)
    return zoo.load(args.name, weights=args.weights, seed=args.seed, **_parse_sets(args.set))


def _cmd_zoo(args):
    from keras_avae import zoo

    width = max(len(name) for name in zoo.names())
    for name in zoo.names():
        entry = zoo.describe(name)
        trained = " [pretrained]" if entry.get("weights") else ""
        print(f"{name:<{width}}  {entry['description']}{trained}")


def _cmd_train(args):
    _check_name(args.name)
    _check_dir(args.data_dir, "--data-dir")
    save_freq = args.save_freq if args.save_freq == "epoch" else _positive(int)(args.save_freq)
    _import_backend(args, tensorflow=True)
    from keras_avae import training

    # The strategy first: TensorFlow must not initialise before the CPU
    # split, nor JAX before its host devices or process group are set.
    strategy = training.make_strategy(
        args.strategy,
        args.cpu_devices,
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    from keras_avae import datasets, zoo

    config_overrides, recipe_overrides = training.split_overrides(args.name, _parse_sets(args.set))
    config_overrides.setdefault("seed", args.seed)
    recipe = training.resolve_recipe(args.name, **recipe_overrides)
    replicas = training.num_replicas(strategy)
    global_batch = (args.batch_size or recipe["batch_size_per_replica"]) * replicas
    data = zoo.describe(args.name)["dataset"]
    examples = len(datasets.load(data, args.data_dir, "train", resize_images=args.resize_images)[0])
    data_info = {"dataset": data, "limit": args.limit, "seed": args.seed}
    if datasets.locate(data, args.data_dir, "train")[0] is datasets.read_image_folder:
        data_info.update(source="image_folder", resize_images=args.resize_images)
    batches = min(examples, args.limit or examples) // global_batch  # full batches only
    steps = args.steps_per_epoch or recipe.get("steps_per_epoch") or max(1, batches)
    _check_enough_data(args.limit, examples, global_batch, steps)
    # Fewer steps than batches: one stream over the epochs (a finite dataset
    # would be cut short in the epoch where it runs out).
    train_data = datasets.make_dataset(
        data,
        "train",
        args.data_dir,
        global_batch,
        seed=args.seed,
        limit=args.limit,
        # tf.distribute shards the pipeline itself; on JAX, Keras splits
        # each global batch over the devices and processes.
        strategy=strategy if training.BACKEND == "tensorflow" else None,
        repeat=steps < batches,
        resize_images=args.resize_images,
    )
    start = time.time()
    training.train(
        args.name,
        train_data,
        args.output,
        epochs=args.epochs,
        steps_per_epoch=steps,
        strategy=strategy,
        batch_size=global_batch,
        config_overrides=config_overrides,
        save_freq=save_freq,
        verbose=args.verbose,
        data_info=data_info,
        seed=args.seed,
        deterministic=args.deterministic,
        **recipe_overrides,
    )
    print(f"Trained {args.name} in {time.time() - start:.0f} s; final model in {args.output}", file=sys.stderr)


def _check_enough_data(limit, examples, batch_size, steps_per_epoch):
    """Refuses, before training, data that cannot fill one batch or one epoch."""
    used = min(examples, limit or examples)
    batches = used // batch_size
    source = f"limit={limit} keeps {used}" if limit else f"the split has {used}"
    if batches == 0:
        raise ValueError(
            f"`limit` too small: {source} training images, fewer than one batch of {batch_size}. "
            f"Received: limit={limit}, batch_size={batch_size} (global)"
        )
    if batches < steps_per_epoch:
        raise ValueError(
            f"`steps_per_epoch`={steps_per_epoch} needs {steps_per_epoch * batch_size} images per epoch "
            f"({steps_per_epoch} batches of {batch_size}) but {source}: {batches} batches. Use a smaller "
            f"--steps-per-epoch or a larger --limit. Received: steps_per_epoch={steps_per_epoch}, limit={limit}"
        )


def _cmd_evaluate(args):
    _check_name(args.name)
    _check_dir(args.data_dir, "--data-dir")
    _check_weights(args)
    _parse_sets(args.set)
    _import_backend(args, tensorflow=True)
    import hashlib

    from keras_avae import datasets, evaluation, zoo

    model = _load_model(args)
    data = zoo.describe(args.name)["dataset"]
    # Static binarisation with a fixed seed: the same binary test set every run.
    test = datasets.make_dataset(
        data,
        args.split,
        args.data_dir,
        args.batch_size,
        shuffle=False,
        seed=args.seed,
        limit=args.limit,
        resize_images=args.resize_images,
    )
    weights = zoo.pretrained_path(args.name) if args.weights == "pretrained" else args.weights
    with open(weights, "rb") as f:
        weights_sha256 = hashlib.sha256(f.read()).hexdigest()
    # What a progress file must match to be resumed: the same model, weights and images.
    run_info = {
        "name": args.name,
        "weights_sha256": weights_sha256,
        "set": sorted(args.set or []),
        "split": args.split,
        "limit": args.limit,
        "batch_size": args.batch_size,
    }

    def report(images, log_px, seconds):
        print(
            f"evaluate: {images} images, NLL so far {-log_px.mean():.2f} nats, {seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    scores = evaluation.score_batches(
        model,
        test,
        num_samples=args.num_samples,
        seed=args.seed,
        progress_path=args.progress,
        run_info=run_info,
        report=report if args.verbose else None,
    )
    result = {
        "name": args.name,
        "weights": args.weights,
        "split": args.split,
        "num_samples": args.num_samples,
        **evaluation.summarize(scores["log_px"], scores["elbo"], model.num_data_dims),
        "seconds": round(scores["seconds"], 1),
        "resumed_images": scores["resumed_images"],
    }
    print(json.dumps(result))


def _cmd_sample(args):
    _check_name(args.name)
    if not args.out.lower().endswith(".png"):
        raise UsageError(f"--out must name a .png file. Received: --out {args.out!r}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    _check_dir(out_dir, "--out (its folder)")
    _check_weights(args)
    _parse_sets(args.set)
    _import_backend(args)
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
    """Scores the shipped MNIST test sample with a pretrained model and draws PNGs."""
    from keras_avae import zoo

    _check_name(args.name)
    entry = zoo.describe(args.name)
    if entry["dataset"] != "mnist" or not zoo.has_pretrained(args.name):
        trained = [n for n in zoo.names() if zoo.has_pretrained(n) and zoo.describe(n)["dataset"] == "mnist"]
        raise UsageError(f"the demo needs a pretrained MNIST entry ({', '.join(trained)}). Received: {args.name!r}")
    os.makedirs(args.out, exist_ok=True)
    _import_backend(args)
    import numpy as np
    from keras import ops

    from keras_avae import datasets, evaluation

    start = time.time()
    model = zoo.load(args.name, weights="pretrained", seed=args.seed)
    x = datasets.mnist_test_sample(args.num_images, seed=0)
    scores = evaluation.score_batches(model, [x], num_samples=args.num_samples, seed=args.seed)
    figures = evaluation.summarize(scores["log_px"], scores["elbo"], model.num_data_dims)
    card = (entry.get("results") or {}).get("test_nll_nats")

    samples = np.asarray(ops.convert_to_numpy(model.sample(64)))
    _save_grid(os.path.join(args.out, "samples.png"), model, [samples[i : i + 8] for i in range(0, 64, 8)])
    shown = x[:32]
    recon = np.asarray(ops.convert_to_numpy(model.reconstruct(shown)))
    rows = [r for i in range(0, len(shown), 8) for r in (shown[i : i + 8], recon[i : i + 8])]
    _save_grid(os.path.join(args.out, "reconstructions.png"), model, rows)

    print(f"{args.name}: pretrained weights, {model.count_params():,} parameters, backend {_backend()}")
    print(
        f"{len(x)} MNIST test images shipped with keras-avae (LeCun et al., 1998), "
        f"K={args.num_samples} importance samples:"
    )
    print(
        f"  test NLL   {figures['nll_nats']:.2f} nats (+- {figures['nll_stderr'] or float('nan'):.2f} s.e.), "
        f"{figures['bits_per_dim']:.4f} bits/dim"
    )
    print(f"  ELBO      {figures['elbo_nats']:.2f} nats")
    if card is not None:
        print(f"  model card: {card:.2f} nats on {entry['results']['test_images']} test images")
    print(f"Wrote {os.path.join(args.out, 'samples.png')} (64 samples) and")
    print(f"      {os.path.join(args.out, 'reconstructions.png')} (rows: test images, their reconstructions)")
    print(f"Done in {time.time() - start:.0f} s")


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
    _import_backend(args, tensorflow=True)
    from keras_avae import report

    model = _load_model(args)
    data = zoo.describe(args.name)["dataset"]
    images, source = report.load_images(
        data, args.data_dir, args.split, args.num_images, seed=args.seed, resize_images=args.resize_images
    )
    info = {"weights": args.weights, "images": source, "settings": " ".join(args.set or []) or "the entry's"}
    temperatures = args.temperatures or (0.6, 0.8, 1.0)
    written = report.write_report(
        model, images, args.out, run_dir=args.run, name=args.name, temperatures=temperatures,
        num_samples=args.num_samples, seed=args.seed, batch_size=args.batch_size, info=info,
    )
    print(f"Wrote {written['index']}: {len(written['figures'])} figures, {len(written['skipped'])} left out "
          f"({', '.join(written['skipped']) or 'none'}), {written['seconds']:.0f} s", file=sys.stderr)


def _backend():
    import keras

    return keras.backend.backend()


_COMMANDS = {
    "zoo": _cmd_zoo,
    "train": _cmd_train,
    "evaluate": _cmd_evaluate,
    "sample": _cmd_sample,
    "demo": _cmd_demo,
    "report": _cmd_report,
}


def main(argv=None):
    """Runs the command line; returns the exit status."""
    args = _build_parser().parse_args(argv)
    try:
        _COMMANDS[args.command](args)
    except UsageError as error:
        print(f"keras-avae {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        # `training.TrainingInterrupted` (SIGINT/SIGTERM after a checkpoint)
        # says what was saved; a plain one (a second Ctrl-C) only that it stopped.
        print(f"keras-avae {args.command}: {stop or 'interrupted'}", file=sys.stderr)
        return getattr(stop, "exit_status", 130)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        if os.environ.get("KERAS_AVAE_DEBUG"):
            raise
        # Library errors already name the argument and value; one line each.
        message = " ".join(str(error).split())
        print(f"keras-avae {args.command}: error: {type(error).__name__}: {message}", file=sys.stderr)
        return 2
    return 0


def main_exit():
    """The console script's entry point."""
    sys.exit(main())


if __name__ == "__main__":
    main_exit()
