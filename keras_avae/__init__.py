"""keras-avae: deep attentive variational autoencoders for Keras 3."""

import importlib
import os
import sys

__version__ = "0.1.0.dev0"

_SUBMODULES = ("datasets", "distributions", "evaluation", "layers", "models", "ops", "training", "zoo")
# Imported on first use only: they register nothing with Keras, and the
# report pulls in matplotlib.
_ON_USE = ("inspection", "report")
__all__ = list(_SUBMODULES + _ON_USE)


def __getattr__(name):
    # `keras_avae.layers` etc. import on first use where they were not
    # imported eagerly (the command line, below).
    if name in _SUBMODULES + _ON_USE:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES + _ON_USE))


def _started_as_the_command_line():
    """Whether this process is the `keras-avae` command.

    The console script runs as `.../keras-avae`; `python -m keras_avae.cli`
    imports this package while `sys.argv[0]` is still `"-m"`. The command
    imports Keras and the backend only in the commands that need them, so
    that `--help` and argument errors answer at once.
    """
    argv = getattr(sys, "argv", None) or [""]
    return argv[0] == "-m" or os.path.basename(argv[0]).removesuffix(".exe") == "keras-avae"


if not _started_as_the_command_line():
    # Every module registers its layers and models with Keras on import:
    # `keras.models.load_model` of a `.keras` file works after `import keras_avae`.
    for _name in _SUBMODULES:
        importlib.import_module(f"{__name__}.{_name}")
    del _name
