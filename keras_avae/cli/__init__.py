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

The modules (none imports Keras at import time):

- `arguments`: `UsageError`, the value parsers (`--set`, positive numbers), shared help texts;
- `parser`: the argparse tree of every command and flag;
- `checks`: the arguments checked against the zoo and the file system, `_load_model`;
- `backend`: importing Keras and the backend quietly, for the commands that compute;
- `zoo`, `train`, `evaluate`, `sample` (`sample` and `demo`), `report` (its flags too): the commands;
- this package: `main`, which runs one command and turns errors into status 2,
  and `main_exit`, the console script; `__main__` runs it for `python -m keras_avae.cli`.
"""

import os
import sys

from keras_avae.cli.arguments import UsageError
from keras_avae.cli.evaluate import _cmd_evaluate
from keras_avae.cli.parser import _build_parser
from keras_avae.cli.report import _cmd_report
from keras_avae.cli.sample import _cmd_demo
from keras_avae.cli.sample import _cmd_sample
from keras_avae.cli.train import _cmd_train
from keras_avae.cli.zoo import _cmd_zoo

_COMMANDS = {
    "zoo": _cmd_zoo,
    "train": _cmd_train,
    "evaluate": _cmd_evaluate,
    "sample": _cmd_sample,
    "demo": _cmd_demo,
    "report": _cmd_report,
}


def main(argv=None):
    """Runs the command line; returns the exit status.

    `argv` is the list of arguments after `keras-avae` (default:
    `sys.argv[1:]`). A user's mistake prints one line on stderr and
    returns 2.

    >>> main(["zoo"])
    cifar10-attentive ...
    0
    """
    args = _build_parser().parse_args(argv)
    try:
        _COMMANDS[args.command](args)
    except UsageError as error:
        print(f"keras-avae {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        # `training.TrainingInterrupted` (SIGINT/SIGTERM after a checkpoint)
        # says what was saved; a plain one (a second Ctrl-C) only that it stopped.
        print(f"keras-avae {args.command}: {str(stop) or 'interrupted'}", file=sys.stderr)
        return getattr(stop, "exit_status", 130)
    except (ValueError, FileNotFoundError, OSError, RuntimeError, FloatingPointError) as error:
        if os.environ.get("KERAS_AVAE_DEBUG"):
            raise
        # Library errors already name the argument and value; one line each.
        message = " ".join(str(error).split())
        print(f"keras-avae {args.command}: error: {type(error).__name__}: {message}", file=sys.stderr)
        return 2
    return 0


def main_exit():
    """The console script's entry point: `main()` on `sys.argv`, its status as the exit status.

    >>> from unittest import mock
    >>> with mock.patch("sys.argv", ["keras-avae", "zoo"]):
    ...     try:
    ...         main_exit()
    ...     except SystemExit as stop:
    ...         print("exit status", stop.code)
    cifar10-attentive ...
    exit status 0
    """
    sys.exit(main())
