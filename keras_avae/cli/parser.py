"""The `keras-avae` argument parser: every command, flag, default and help line.

`report`'s flags are added by `keras_avae.cli.report`, next to the command.
"""

import argparse

from keras_avae.cli.arguments import _DATA_DIR_HELP
from keras_avae.cli.arguments import _positive
from keras_avae.cli.arguments import _seed_below
from keras_avae.cli.arguments import _RESIZE_HELP
from keras_avae.cli.arguments import _save_freq
from keras_avae.cli.arguments import _set_help
from keras_avae.cli.arguments import _STRATEGIES
from keras_avae.cli.report import _add_report_parser


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
    _add_train_parser(commands, backend)
    _add_evaluate_parser(commands, backend)
    _add_sample_parser(commands, backend)
    _add_demo_parser(commands, backend)
    _add_report_parser(commands, backend)
    return parser


def _add_train_parser(commands, backend):
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
    train.add_argument(
        "--seed",
        type=_seed_below(2**31 - 1, "2**31 - 1"),
        default=0,
        help="data and initialisation seed, 0 to 2**31 - 2",
    )
    train.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deterministic kernels, so that the same command and --seed give the same numbers on one machine "
        "(default: on; --no-deterministic may be faster on a GPU)",
    )
    train.add_argument(
        "--save-freq", type=_save_freq, default="epoch", help="'epoch' or N: checkpoint every N steps too"
    )
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model or recipe value "
                       "(repeatable; default: the entry's values)")
    train.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2), help="Keras fit verbosity")


def _add_evaluate_parser(commands, backend):
    evaluate = commands.add_parser(
        "evaluate", parents=[backend], help="importance-sampled test NLL, printed as JSON"
    )
    evaluate.add_argument("name", help="zoo entry, see `keras-avae zoo`")
    evaluate.add_argument("--weights", required=True, help="a .weights.h5 file, or 'pretrained'")
    evaluate.add_argument("--data-dir", required=True, help=_DATA_DIR_HELP)
    evaluate.add_argument("--split", choices=("test", "train"), default="test", help="data split")
    evaluate.add_argument("--num-samples", type=_positive(int), default=100, help="K importance samples")
    evaluate.add_argument("--limit", type=_positive(int), help="the first N examples of the split (default: all)")
    evaluate.add_argument(
        "--every",
        type=_positive(int),
        help="every N-th example of the split, before --limit: a subset spread over the whole split "
        "(default: all)",
    )
    evaluate.add_argument("--resize-images", action="store_true", help=_RESIZE_HELP)
    evaluate.add_argument("--batch-size", type=_positive(int), default=25, help="images per pass")
    evaluate.add_argument(
        "--seed", type=_seed_below(2**20, "2**20"), default=0, help="binarisation and sampling seed, 0 to 2**20 - 1"
    )
    evaluate.add_argument(
        "--chunk-size",
        type=_positive(int),
        help="the most importance samples per top-down pass (default: as many as fit, up to 1024 image-samples "
        "a pass); the passes decide the draws, so the same value gives the same numbers on any machine where "
        "--batch-size x --chunk-size image-samples fit in memory",
    )
    evaluate.add_argument("--set", action="append", metavar="KEY=VALUE", help=_set_help("a model config value"))
    evaluate.add_argument(
        "--progress",
        metavar="FILE.npz",
        help="save per-image results after every batch; run again with the same file to resume, or "
        "with a larger --limit (or none) to score more images of the split (default: no file)",
    )
    evaluate.add_argument("--verbose", type=int, default=0, choices=(0, 1), help="1: a line per batch on stderr")


def _add_sample_parser(commands, backend):
    sample = commands.add_parser("sample", parents=[backend], help="draw images from the prior into a PNG grid")
    sample.add_argument("name", help="zoo entry, see `keras-avae zoo`")
    sample.add_argument("--weights", required=True, help="a .weights.h5 file, or 'pretrained'")
    sample.add_argument("--num", type=_positive(int), default=64, help="number of images")
    sample.add_argument("--temperature", type=_positive(float), default=1.0, help="prior temperature")
    sample.add_argument("--out", required=True, help="output .png file")
    sample.add_argument(
        "--seed", type=_seed_below(2**31 - 1, "2**31 - 1"), default=0, help="sampling seed, 0 to 2**31 - 2"
    )
    sample.add_argument("--set", action="append", metavar="KEY=VALUE", help=_set_help("a model config value"))


def _add_demo_parser(commands, backend):
    demo = commands.add_parser(
        "demo",
        parents=[backend],
        help="offline: score the shipped test sample of a pretrained entry's data set, write PNG grids",
    )
    demo.add_argument("--name", default="mnist-attentive-small", help="a pretrained entry (see `keras-avae zoo`)")
    demo.add_argument("--out", default="keras-avae-demo", help="folder for samples.png and reconstructions.png")
    demo.add_argument("--num-images", type=_positive(int), default=100, help="1 to 100 shipped test images")
    demo.add_argument("--num-samples", type=_positive(int), default=100, help="K importance samples")
    demo.add_argument("--seed", type=_seed_below(2**20, "2**20"), default=0, help="sampling seed, 0 to 2**20 - 1")
