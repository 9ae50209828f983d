"""What the command line reads from its arguments: value parsers, shared help texts, `UsageError`.

Standard library only: the parser is built from these without importing
Keras or a backend.
"""

import argparse
import json
import math

_STRATEGIES = ("auto", "mirrored", "multi-worker", "one-device")
_DATA_DIR_HELP = "folder with the original data files, or with your own PNG/JPEG images"
_RESIZE_HELP = (
    "with --data-dir a folder of images: resize images of another size than the entry's (28x28 grey, "
    "32x32 RGB) instead of refusing them"
)


class UsageError(Exception):
    """A mistake on the command line; reported in one line.

    `keras_avae.cli.main` prints it as `keras-avae COMMAND: error: ...`
    and returns status 2.

    >>> _parse_sets(["epochs"])
    Traceback (most recent call last):
    ...
    keras_avae.cli.arguments.UsageError: --set expects key=value. Received: --set 'epochs'
    """


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


def _seed_below(limit, limit_text):
    """An argparse type: an int in `[0, limit)`."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not 0 <= value < limit:
            raise argparse.ArgumentTypeError(f"expected an int in [0, {limit_text}), received {text!r}")
        return value

    return parse


def _save_freq(text):
    """`--save-freq`: "epoch" or a positive number of steps."""
    if text == "epoch":
        return text
    try:
        return _positive(int)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'epoch' or a positive int, received {text!r}")


def _set_help(what):
    from keras_avae import zoo

    neutral = ", ".join(sorted(zoo._NEUTRAL_OVERRIDES))
    return (
        f"override {what} (repeatable; default: the entry's values). With --weights pretrained only "
        f"{neutral} and values equal to the entry's are accepted; other keys change the architecture"
    )
