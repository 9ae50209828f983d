"""The model zoo: named, documented configurations in `zoo/*.json`.

Each entry is a readable data file (name, description, architecture config,
training recipe, the paper's figures and, for trained entries, weights and a
model card). The files live in the top-level `zoo/` folder of the repository
and are installed inside the wheel as `keras_avae/zoo_data/`.

Example:

>>> import keras_avae
>>> "cifar10-attentive" in keras_avae.zoo.names()
True
>>> model = keras_avae.zoo.load("mnist-attentive", num_layers=2,
...     preprocess_filters=4, decoder_filters=4)
>>> model.num_layers
2
"""

import copy
import functools
import json
import pathlib

from keras_avae.models.discrete_vae import DiscreteVAE
from keras_avae.models.hierarchical_vae import HierarchicalVAE

_FAMILIES = {"hierarchical_vae": HierarchicalVAE, "discrete_vae": DiscreteVAE}


def _entry_dir():
    installed = pathlib.Path(__file__).parent / "zoo_data"
    if installed.is_dir():
        return installed
    return pathlib.Path(__file__).resolve().parents[1] / "zoo"


@functools.cache
def _entries():
    entries = {}
    for path in sorted(_entry_dir().glob("*.json")):
        with open(path) as f:
            entry = json.load(f)
        entries[entry["name"]] = entry
    return entries


def names():
    """The names of all zoo entries, sorted.

    Example:

    >>> names()[:3]
    ['cifar10-attentive', 'cifar10-attentive-small', 'cifar10-baseline']
    """
    return sorted(_entries())


def _get(name):
    entries = _entries()
    if name not in entries:
        raise ValueError(f"Unknown zoo entry. Valid names: {', '.join(sorted(entries))}. Received: name={name!r}")
    return entries[name]


def describe(name):
    """The whole entry (a dict: description, config, training recipe, results).

    Example:

    >>> describe("cifar10-baseline")["config"]["generative_attention"]
    False
    """
    return copy.deepcopy(_get(name))


def config(name, **overrides):
    """The architecture config of an entry with `overrides` applied.

    Example:

    >>> config("mnist-attentive", num_layers=4)["num_layers"]
    4
    """
    entry = _get(name)
    cfg = copy.deepcopy(entry["config"])
    unknown = sorted(set(overrides) - set(cfg) - {"seed", "name", "dtype"})
    if unknown:
        raise ValueError(
            f"Unknown config override(s) {unknown} for zoo entry {name!r}. "
            f"Valid keys: {', '.join(sorted(cfg))}, seed, name, dtype. Received: {overrides}"
        )
    cfg.update(overrides)
    return cfg


# Overrides that do not change the architecture, so pretrained weights fit.
_NEUTRAL_OVERRIDES = {"seed", "name", "dtype"}


def has_pretrained(name):
    """Whether entry `name` ships trained weights (`load(name, "pretrained")`).

    Example:

    >>> has_pretrained("mnist-attentive-small"), has_pretrained("mnist-attentive")
    (True, False)
    """
    return bool(_get(name).get("weights"))


def pretrained_path(name):
    """The installed `.weights.h5` file of a trained entry.

    Raises:
        ValueError: when the entry has no trained weights (the message lists
            the entries that do).

    Example:

    >>> pretrained_path("mnist-attentive-small").name
    'mnist-attentive-small.weights.h5'
    """
    entry = _get(name)
    if not entry.get("weights"):
        trained = [n for n in names() if has_pretrained(n)]
        raise ValueError(
            f"Zoo entry {name!r} has no pretrained weights. Entries with weights: "
            f"{', '.join(trained) or 'none'}. Received: name={name!r}, weights='pretrained'"
        )
    return _entry_dir() / entry["weights"]["file"]


def load(name, weights="default", **overrides):
    """Builds the model of zoo entry `name`.

    Args:
        name: a name from `names()`.
        weights: `"default"`: the entry's pretrained weights when it has
            them and no override changes the architecture, else fresh
            weights; `"pretrained"`: the entry's weights (an error if it has
            none); `None`: fresh weights; or a path to a `.weights.h5` file.
        **overrides: config values to change, e.g. `num_layers=8`.

    Returns:
        A built `keras.Model`.

    Raises:
        ValueError: for an unknown name or override key (the message lists
            the valid ones) or a weights file that does not match.

    Example:

    >>> model = load("mnist-baseline-small")  # the shipped, trained weights
    >>> fresh = load("mnist-baseline-small", num_layers=2)  # new architecture: fresh weights
    >>> model.num_layers, fresh.num_layers
    (4, 2)
    """
    entry = _get(name)
    model = _FAMILIES[entry["family"]](**config(name, **overrides))
    model.build()
    if weights == "default":
        architecture_changed = bool(set(overrides) - _NEUTRAL_OVERRIDES)
        weights = "pretrained" if has_pretrained(name) and not architecture_changed else None
    if weights == "pretrained":
        weights = pretrained_path(name)
    if weights is not None:
        path = pathlib.Path(weights)
        if not path.is_file():
            raise ValueError(f"Weights file not found. Received: weights={str(weights)!r}")
        try:
            model.load_weights(str(path))
        except Exception as error:  # h5py/keras raise many kinds on bad files.
            raise ValueError(
                f"Could not load weights into zoo entry {name!r} (corrupt file or another "
                f"architecture): {error}. Received: weights={str(weights)!r}"
            ) from error
    return model
