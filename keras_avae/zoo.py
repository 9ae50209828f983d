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
import hashlib
import importlib
import inspect
import json
import os
import pathlib
import warnings

# Model classes by the entries' "family", imported when first needed: listing
# and describing entries (`keras-avae zoo`, argument checks) needs no Keras.
_FAMILY_CLASSES = {
    "hierarchical_vae": ("keras_avae.models.hierarchical_vae", "HierarchicalVAE"),
    "discrete_vae": ("keras_avae.models.discrete_vae", "DiscreteVAE"),
}

# Characters of a weights-loading error quoted in ours.
_MAX_ERROR_DETAIL = 500


def _family(family):
    module, name = _FAMILY_CLASSES[family]
    return getattr(importlib.import_module(module), name)


def __getattr__(name):
    # `zoo._FAMILIES`, the family -> class dict, for modules that use it.
    if name == "_FAMILIES":
        return {family: _family(family) for family in _FAMILY_CLASSES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    # `isinstance` first: an unhashable name (a list) raised a bare TypeError from the lookup.
    if not isinstance(name, str) or name not in entries:
        raise ValueError(f"Unknown zoo entry. Valid names: {', '.join(sorted(entries))}. Received: name={name!r}")
    return entries[name]


def describe(name):
    """The whole entry (a dict: description, config, training recipe, results).

    Example:

    >>> describe("cifar10-baseline")["config"]["generative_attention"]
    False
    """
    return copy.deepcopy(_get(name))


def _valid_keys(entry):
    """Override keys: the entry's config and its family's constructor arguments."""
    return _override_keys(_family(entry["family"]), entry["config"])


def _override_keys(family, config):
    """The keys a model of class `family` with `config` accepts as overrides."""
    arguments = inspect.signature(family.__init__).parameters
    accepted = {key for key, p in arguments.items() if key != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}
    return set(config) | accepted | {"name", "dtype"}


def config(name, /, **overrides):
    """The architecture config of an entry with `overrides` applied.

    Example:

    >>> config("mnist-attentive", num_layers=4)["num_layers"]
    4
    """
    entry = _get(name)
    cfg = copy.deepcopy(entry["config"])
    valid = _valid_keys(entry)
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"Unknown config override(s) {unknown} for zoo entry {name!r}. "
            f"Valid keys: {', '.join(sorted(valid))}. Received: {overrides}"
        )
    cfg.update(overrides)
    return cfg


# Overrides that keep pretrained weights: they change neither the weights'
# shapes nor the function the model computes at inference (`log_likelihood`,
# `sample`, `reconstruct`, `encode`, the ELBO of `model(x, training=False)`).
# The one list: `load` (and so the CLI's `--set`) decides with it, and
# other modules import it rather than keep their own. Every other constructor argument counts as an
# architecture change when its value differs from the entry's: shapes
# (`num_layers`, filters, attention dims, `image_shape`...), or the function
# with the same shapes (`nonlocal_feature_seed` and
# `nonlocal_num_random_features`: the FAVOR+ features; `crop`,
# `likelihood`, `reference_edge_bug`, the log-scale bounds, `bn_epsilon`;
# DiscreteVAE's `temperature`, a weight the file overwrites, and
# `straight_through`).
_NEUTRAL_OVERRIDES = frozenset(
    {
        "seed",  # sampling only; the entries with weights fix `nonlocal_feature_seed`
        "name",  # the model's name; weights load by structure
        "dtype",  # the dtype policy; the same float32 weights load into it
        "l2",  # weight regularisation: a training loss term
        "log_scale_noise",  # noise on log sigmas with `training=True` only
        "bn_momentum",  # batch-norm moving-statistics updates, training only
        "synchronized_batch_norm",  # batch statistics across replicas, training only
    }
)


def _normalized(value):
    """JSON-like form for comparing values: tuples as lists (`(32, 32, 1) == [32, 32, 1]`).

    NumPy arrays and scalars, which the models accept (`image_shape=np.array([32, 32, 1])`), as Python
    values: compared raw, an array gave an elementwise result that `!=` could not test.
    """
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # no NumPy import: `keras-avae zoo` stays light
        return _normalized(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items()}
    return value


def _architecture_changes(name, overrides):
    """The overrides that change the model the entry's weights fit.

    Returns `{key: (override, entry_value)}`.

    An override is no change when it is neutral (`_NEUTRAL_OVERRIDES`) or
    equals the entry's value (or, for a key the entry does not list, the
    family's default).
    """
    entry = _get(name)
    config(name, **overrides)  # unknown keys: the error that lists the valid ones
    return _changes(_family(entry["family"]), entry["config"], overrides)


def _config_differences(recorded, built, ignore=()):
    """The keys of a recorded config (a run's `run.json`) whose values differ in `built`, a model's config.

    Keys that only one of them holds, the neutral ones (`_NEUTRAL_OVERRIDES`)
    and those of `ignore` are not compared; values are compared in their
    JSON-like form (`_normalized`).
    """
    return [
        key
        for key, value in recorded.items()
        if key in built
        and key not in _NEUTRAL_OVERRIDES
        and key not in ignore
        and _normalized(value) != _normalized(built[key])
    ]


def _changes(family, config, overrides):
    """`{key: (override, current)}` for the overrides that change a `family` model with `config`."""
    defaults = {
        key: p.default for key, p in inspect.signature(family.__init__).parameters.items() if p.default is not p.empty
    }
    changes = {}
    for key, value in overrides.items():
        if key in _NEUTRAL_OVERRIDES:
            continue
        current = config[key] if key in config else defaults.get(key)
        if _normalized(value) != _normalized(current):
            changes[key] = (value, current)
    return changes


def has_pretrained(name):
    """Whether entry `name` ships trained weights (`load(name, "pretrained")`).

    Example:

    >>> has_pretrained("mnist-attentive-small"), has_pretrained("mnist-attentive")
    (True, False)
    """
    return bool(_get(name).get("weights"))


def _trained_names():
    """The entries with trained weights, comma-separated, for messages."""
    return ", ".join(n for n in names() if has_pretrained(n)) or "none"


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
        raise ValueError(
            f"Zoo entry {name!r} has no pretrained weights. Entries with weights: "
            f"{_trained_names()}. Received: name={name!r}, weights='pretrained'"
        )
    return _entry_dir() / entry["weights"]["file"]


def load(name, /, weights="default", **overrides):
    """Builds the model of zoo entry `name`.

    Overrides that leave the architecture alone (`seed`, `name`, `dtype`,
    `l2`, `log_scale_noise`, `bn_momentum`, `synchronized_batch_norm`), and
    overrides equal to the entry's own value, keep the pretrained weights.
    Any other override changes the model the entry's weights were trained
    for: with `weights="default"` the model gets fresh weights and a
    `UserWarning` names the keys; with `weights="pretrained"` it is an error.
    A path is loaded into the model the overrides describe (a file trained
    with the same overrides fits), except the entry's own pretrained file,
    which is treated as `"pretrained"`.

    Args:
        name: a name from `names()`.
        weights: `"default"`: the entry's pretrained weights when it has
            them and no override changes the architecture, else fresh
            weights (with a warning when the entry has weights, and when
            it has none and no override changes the architecture);
            `"pretrained"`: the entry's weights (an error if it has none or
            an override changes the architecture); `None`: fresh weights; or
            a path to a `.weights.h5` file.
        **overrides: config values to change, e.g. `num_layers=8`.

    Returns:
        A built `keras.Model`.

    Raises:
        ValueError: for an unknown name or override key (the message lists
            the valid ones), an architecture override with
            `weights="pretrained"` (the message names the keys and values),
            or a weights file that does not match.

    Example:

    >>> model = load("mnist-baseline-small")  # the shipped, trained weights
    >>> same = load("mnist-baseline-small", l2=0.0, num_layers=4)  # no change: still trained
    >>> fresh = load("mnist-baseline-small", weights=None, num_layers=2)  # new architecture
    >>> model.num_layers, same.num_layers, fresh.num_layers
    (4, 4, 2)
    """
    entry = _get(name)
    if weights is not None and not isinstance(weights, (str, os.PathLike)):
        raise ValueError(
            "`weights` must be 'default', 'pretrained', None (fresh weights) or the path of a .weights.h5 file. "
            f"Received: weights={weights!r}"
        )
    if overrides.get("dtype") is not None:
        _check_float_dtype(overrides["dtype"])
    changes = _architecture_changes(name, overrides)
    if weights is not None and weights not in ("default", "pretrained") and has_pretrained(name):
        path = pathlib.Path(weights)
        if path.is_file() and path.samefile(pretrained_path(name)):
            weights = "pretrained"  # the shipped file, named by its path
    if weights == "default":
        weights = "pretrained" if has_pretrained(name) else None
        if weights is None and not changes:
            # `load(name)` reads as "the zoo's model": say so when the entry
            # has none (a custom architecture is fresh by nature: no warning).
            warnings.warn(
                f"zoo.load({name!r}): this entry has no trained weights yet, so the model has fresh, untrained "
                f"weights. Entries with trained weights: {_trained_names()}. Pass weights=None to ask "
                "for fresh weights without this warning, or weights='pretrained' to make this an error.",
                UserWarning,
                stacklevel=2,
            )
        if weights and changes:
            warnings.warn(
                f"zoo.load({name!r}): these overrides change the architecture the pretrained weights were "
                f"trained for: {_describe_changes(changes)}. The model has fresh, untrained weights. Pass "
                "weights=None to ask for fresh weights without this warning, or weights='pretrained' "
                "to make this an error.",
                UserWarning,
                stacklevel=2,
            )
            weights = None
    if weights == "pretrained":
        weights = pretrained_path(name)
        _check_sha256(weights, entry["weights"].get("sha256"))
        if changes:
            raise ValueError(
                f"The pretrained weights of zoo entry {name!r} do not fit: these overrides change the "
                f"architecture they were trained for: {_describe_changes(changes)}. Drop them, or ask for "
                f"fresh weights (weights=None). Received: {', '.join(f'{k}={v!r}' for k, (v, _) in changes.items())}"
            )
    model = _family(entry["family"])(**config(name, **overrides))
    model.build()
    if weights is not None and entry.get("weights") and pathlib.Path(weights) == pretrained_path(name):
        # What `save_to_preset` writes into metadata.json.
        model.model_card = {"name": name, "description": entry["description"], "results": entry.get("results")}
    if weights is not None:
        path = pathlib.Path(weights)
        if not path.is_file():
            raise ValueError(f"Weights file not found. Received: weights={str(weights)!r}")
        try:
            model.load_weights(str(path))
        except Exception as error:  # h5py/keras raise many kinds on bad files.
            overridden = f" with {_describe_changes(changes)}" if changes else ""
            # Keras's shape errors print whole variables: its first sentences say enough.
            detail = str(error)
            if len(detail) > _MAX_ERROR_DETAIL:
                detail = detail[:_MAX_ERROR_DETAIL] + " ..."
            raise ValueError(
                f"Could not load weights into zoo entry {name!r}{overridden} (corrupt file or another "
                f"architecture): {detail}. Received: weights={str(weights)!r}"
            ) from error
    return model


def _check_float_dtype(dtype):
    """Refuses a `dtype` override that is not a float dtype or policy (an int model fails deep inside)."""
    import keras

    try:
        compute_dtype = keras.dtype_policies.get(dtype).compute_dtype
    except (ValueError, TypeError):
        compute_dtype = None
    if compute_dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(
            "`dtype` must be a float dtype or policy, e.g. 'float32' or 'mixed_bfloat16'. "
            f"Received: dtype={dtype!r}"
        )


def _describe_changes(changes, source="entry"):
    """`num_layers=2 (entry: 4), crop=0 (entry: 2)` for messages."""
    return ", ".join(f"{key}={value!r} ({source}: {current!r})" for key, (value, current) in changes.items())


def _check_sha256(path, expected):
    """Refuses a shipped weights file that is not the one the entry's card describes."""
    if expected is None or not path.is_file():
        return  # a missing file gets its own error where it is opened
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"The weights file {str(path)!r} is not the one the zoo entry records (sha256 "
            f"{digest.hexdigest()}, expected {expected}): it was changed or damaged. Reinstall keras-avae. "
            f"Received: weights={str(path)!r}"
        )
