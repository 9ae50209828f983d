"""Checks of the arguments against the zoo and the file system, before Keras is imported."""

import os

from keras_avae.cli.arguments import UsageError
from keras_avae.cli.arguments import _parse_sets


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
