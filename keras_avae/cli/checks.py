"""Checks of the arguments against the zoo and the file system, before Keras is imported."""

import json
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
    """`zoo.load` with `--weights` and `--set`: the same rules as in Python.

    A weights file in a `keras-avae train` run folder is checked against the
    configuration its `run.json` records: a model that differs from it where
    the weights' shapes do not show (the FAVOR+ features' seed, the kind of
    non-local attention, ...) would load the weights silently and compute
    another function.
    """
    from keras_avae import zoo

    _check_weights(args)
    overrides = _parse_sets(args.set)
    if "seed" in overrides:
        raise UsageError(f"--set seed: the sampling seed is --seed. Received: --set seed={overrides['seed']!r}")
    try:
        model = zoo.load(args.name, weights=args.weights, seed=args.seed, **overrides)
    except ValueError:
        if args.weights != "pretrained":
            # Weights of a run trained with architecture --set do not fit
            # without them: its run.json names them, Keras's error does not.
            fresh = zoo.load(args.name, weights=None, seed=args.seed, **overrides)
            _check_against_run_record(args.weights, fresh, weights_fit=False)
        raise
    if args.weights != "pretrained":
        _check_against_run_record(args.weights, model)
    return model


def _check_against_run_record(weights, model, weights_fit=True):
    from keras_avae import zoo
    from keras_avae.training.run_folder import _read_record

    record = _read_record(os.path.join(os.path.dirname(os.path.abspath(weights)), "run.json"))
    if record is None:
        return
    recorded = record.get("config", {})
    built = model.get_config()
    differing = zoo._config_differences(recorded, built)
    if differing:
        trained = ", ".join(f"{key}={recorded[key]!r} (this model: {built[key]!r})" for key in differing)
        sets = " ".join(f"--set {key}={json.dumps(recorded[key])}" for key in differing)
        hint = " (or the run's --seed)" if differing == ["nonlocal_feature_seed"] else ""
        silently = ", which these weights would load into without error" if weights_fit else ""
        raise UsageError(
            f"--weights {weights}: its run folder's run.json records another configuration{silently}: "
            f"{trained}. Load it as trained with {sets}{hint}"
        )
