"""Presets the keras-hub way: `from_preset`, `save_to_preset` and `presets`.

A preset is a zoo entry name, a directory written by `save_to_preset`
(`config.json`, `model.weights.h5`, `metadata.json`), or a run folder
written by `keras-avae train` (`run.json` and, once the run has finished,
`model.weights.h5`). `PresetMixin` gives the model classes these methods;
`keras_avae.zoo.load` stays the short way to a zoo entry and decides the
same way which overrides keep the trained weights.
"""

import json
import pathlib

import keras

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.h5"
METADATA_FILE = "metadata.json"
RUN_FILE = "run.json"  # a `keras-avae train` run folder


class _ClassProperty:
    def __init__(self, getter):
        self.getter = getter

    def __get__(self, instance, owner):
        return self.getter(owner)


class PresetMixin:
    """`from_preset`, `save_to_preset` and `presets` for the keras-avae models.

    Example:

    >>> from keras_avae.models import DiscreteVAE
    >>> issubclass(DiscreteVAE, PresetMixin), sorted(DiscreteVAE.presets)
    (True, ['mnist-gumbel', 'mnist-gumbel-small'])
    """

    @_ClassProperty
    def presets(cls):
        """`{name: description}` of the zoo entries of this class (see `keras_avae.zoo`).

        Example:

        >>> from keras_avae.models import HierarchicalVAE
        >>> "mnist-attentive-small" in HierarchicalVAE.presets
        True
        """
        from keras_avae import zoo

        return {
            name: zoo.describe(name)["description"]
            for name in zoo.names()
            if issubclass(zoo._family(zoo.describe(name)["family"]), cls)
        }

    @classmethod
    def from_preset(cls, preset, load_weights=True, **overrides):
        """Builds a model from a zoo entry, a saved preset or a run folder.

        Overrides follow `keras_avae.zoo.load`: those that leave the
        architecture alone (`seed`, `name`, `dtype`, `l2`, ...) or equal the
        preset's value keep the weights; any other one with
        `load_weights=True` is a `ValueError` naming it.

        Args:
            preset: a name from `presets` (or `keras_avae.zoo.names()`), or a
                directory written by `save_to_preset` or `keras-avae train`.
            load_weights: `True` loads the preset's weights (an error when it
                has none); `False` gives fresh weights.
            **overrides: config values to change.

        Returns:
            A built model of this class.

        Raises:
            ValueError: an unknown preset, a preset of another class, a
                preset without weights (`load_weights=True`), an unknown
                override key or one that changes the architecture.

        Example:

        >>> from keras_avae.models import HierarchicalVAE
        >>> model = HierarchicalVAE.from_preset("mnist-baseline-small")
        >>> model.num_layers
        4
        """
        from keras_avae import zoo

        if isinstance(preset, str) and preset in zoo.names():
            family = zoo._family(zoo.describe(preset)["family"])
            _check_class(cls, family, preset)
            if load_weights and not zoo.has_pretrained(preset):
                raise ValueError(
                    f"Zoo entry {preset!r} has no trained weights; pass load_weights=False for a fresh model. "
                    f"Entries with weights: {', '.join(n for n in cls.presets if zoo.has_pretrained(n))}. "
                    f"Received: preset={preset!r}, load_weights=True"
                )
            return zoo.load(preset, weights="pretrained" if load_weights else None, **overrides)
        folder = pathlib.Path(preset)
        if not folder.is_dir():
            raise ValueError(
                f"`preset` must be a zoo entry of {cls.__name__} ({', '.join(cls.presets)}) or a directory "
                f"written by `save_to_preset` or `keras-avae train`. Received: preset={preset!r}"
            )
        family, config = _read_config(folder, cls)
        _check_overrides(family, config, overrides, load_weights, folder)
        model = family.from_config({**config, **overrides})
        model.build()
        if load_weights:
            weights = folder / WEIGHTS_FILE
            if not weights.is_file():
                unfinished = (folder / RUN_FILE).is_file()
                raise ValueError(
                    f"{str(folder)!r} has no {WEIGHTS_FILE}"
                    + (
                        ": the run has not finished (its last checkpoint is in backup/; the same "
                        "`keras-avae train` command resumes it)"
                        if unfinished
                        else ""
                    )
                    + f". Pass load_weights=False for a fresh model. Received: preset={str(preset)!r}"
                )
            model.load_weights(str(weights))
        return model

    def save_to_preset(self, preset_dir):
        """Writes `config.json`, `model.weights.h5` and `metadata.json` to `preset_dir`.

        `from_preset(preset_dir)` builds the same model back. The metadata
        holds the Keras and keras-avae versions, the parameter count and,
        for a model loaded from a trained zoo entry, its model card.

        Example:

        >>> import tempfile
        >>> from keras_avae.models import HierarchicalVAE
        >>> folder = tempfile.mkdtemp()
        >>> HierarchicalVAE.from_preset("mnist-baseline-small").save_to_preset(folder)
        >>> sorted(p.name for p in pathlib.Path(folder).iterdir())
        ['config.json', 'metadata.json', 'model.weights.h5']
        """
        import keras_avae
        from keras_avae.training.atomic_files import _atomic_write
        from keras_avae.training.atomic_files import _atomic_write_text

        folder = pathlib.Path(preset_dir)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"class_name": type(self).__name__, "config": self.get_config()}
        metadata = {
            "keras_version": keras.__version__,
            "keras_avae_version": keras_avae.__version__,
            "parameter_count": int(self.count_params()),
            "model_card": getattr(self, "model_card", None),
        }
        _atomic_write(folder / WEIGHTS_FILE, lambda tmp: self.save_weights(str(tmp)))
        _atomic_write_text(folder / METADATA_FILE, json.dumps(metadata, indent=1, default=_jsonable) + "\n")
        # The config last: a folder with one is complete.
        _atomic_write_text(folder / CONFIG_FILE, json.dumps(config, indent=1, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _check_class(cls, family, preset):
    if not issubclass(family, cls):
        raise ValueError(f"Preset {str(preset)!r} is a {family.__name__}, not a {cls.__name__}. Received: preset={preset!r}")


def _read_config(folder, cls):
    """`(class, config)` of a saved preset or a run folder."""
    from keras_avae import zoo

    if (folder / CONFIG_FILE).is_file():
        saved = json.loads((folder / CONFIG_FILE).read_text())
        families = {family.__name__: family for family in zoo._FAMILIES.values()}
        if saved.get("class_name") not in families:
            raise ValueError(
                f"{str(folder / CONFIG_FILE)!r} names no keras-avae model class. "
                f"Received: class_name={saved.get('class_name')!r}"
            )
        family = families[saved["class_name"]]
        _check_class(cls, family, folder)
        return family, saved["config"]
    if (folder / RUN_FILE).is_file():
        run = json.loads((folder / RUN_FILE).read_text())
        name = run.get("model")
        family = zoo._family(zoo.describe(name)["family"]) if name in zoo.names() else cls
        _check_class(cls, family, folder)
        return family, run["config"]
    raise ValueError(
        f"{str(folder)!r} holds neither {CONFIG_FILE} (`save_to_preset`) nor {RUN_FILE} (`keras-avae train`). "
        f"Received: preset={str(folder)!r}"
    )


def _check_overrides(family, config, overrides, load_weights, folder):
    """Unknown keys always, and architecture changes when weights are loaded, are errors (as in `zoo.load`)."""
    from keras_avae import zoo

    unknown = sorted(set(overrides) - zoo._override_keys(family, config))
    if unknown:
        raise ValueError(f"Unknown config override(s) {unknown} for {family.__name__}. Received: {overrides}")
    changes = zoo._changes(family, config, overrides) if load_weights else {}
    if changes:
        raise ValueError(
            f"The weights in {str(folder)!r} do not fit: these overrides change the architecture they were "
            f"trained for. Drop them, or pass load_weights=False. Received: {zoo._describe_changes(changes, 'preset')}"
        )
