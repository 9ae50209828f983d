"""KerasTuner search over the zoo's hierarchical VAEs.

`VAEHyperModel` turns a zoo entry into a search space: the number of
stochastic layers, latent channels, filters, the paper's three attention
switches and the learning rate. `build(hp)` returns a compiled, built model
whose weights depend only on `hp` and `seed`; `fit` adds the recipe's KL
warm-up. Minimise `OBJECTIVE`, the validation negative ELBO (unweighted by
the KL warm-up, so trials are comparable at any epoch).

Needs `keras-tuner` (`pip install "keras-avae[tuning]"`).

Example:

>>> import keras_tuner
>>> from keras_avae.tuning import OBJECTIVE, VAEHyperModel
>>> hypermodel = VAEHyperModel("mnist-attentive-small", steps_per_epoch=10,
...     search_space={"num_layers": [2], "filters": [4]})
>>> model = hypermodel.build(keras_tuner.HyperParameters())
>>> model.num_layers, model.preprocess_filters
(2, 4)
"""

import copy
import json
import math
import numbers

import keras
import keras_tuner

from keras_avae import training
from keras_avae import zoo
from keras_avae._validation import check_positive_int
from keras_avae.training.optimizers import check_guard_policy

OBJECTIVE = keras_tuner.Objective("val_nelbo", direction="min")

DEFAULT_SEARCH_SPACE = {
    "num_layers": [2, 4, 6],
    "latent_channels": [8, 20],
    "filters": [8, 16, 32],
    "generative_attention": [False, True],
    "inference_attention": [False, True],
    "nonlocal_blocks": [False, True],
    "learning_rate": (1e-3, 1e-2),
}

_SWITCHES = ("generative_attention", "inference_attention", "nonlocal_blocks")
# The config (and recipe) keys each search-space key sets: `overrides` may not
# also set them, or the tuner would record one value while the model gets another.
_SETS = {key: (key,) for key in DEFAULT_SEARCH_SPACE}
_SETS["filters"] = ("filters", "preprocess_filters", "decoder_filters")
# Where non-local blocks go when the switch turns them on (the paper's places).
_NONLOCAL_PLACES = ["merge", "postprocess"]
# A fixed hyperparameter recording the `entry` and `overrides` a search was
# started with; the oracle keeps it, beside the search space, in oracle.json.
_FIXED_CONFIG = "keras_avae/fixed_config"


class VAEHyperModel(keras_tuner.HyperModel):
    """A KerasTuner `HyperModel` over a hierarchical zoo entry.

    Args:
        entry: the zoo entry the search starts from (its config and recipe
            fill in everything the search space does not set).
        steps_per_epoch: optimizer steps per epoch (the learning-rate
            schedule is laid out over `epochs * steps_per_epoch`).
        epochs: epochs per trial for the schedule; defaults to the recipe's.
        search_space: dict overriding `DEFAULT_SEARCH_SPACE`; keys missing
            from it keep the defaults, a key mapped to `None` is not searched
            (the entry's config and recipe, or `overrides`, set it). `num_layers`,
            `latent_channels` and `filters` take a non-empty list of positive
            ints to choose from (`filters` sets the encoder and decoder
            filters); the three switches take a non-empty list of bools
            (both values search the switch, one value fixes it); a repeated
            value counts once; `learning_rate` takes a `(low, high)` range,
            `min_learning_rate <= low <= high` (the recipe's floor, 1e-4 in
            the zoo's recipes), sampled on a log scale. Anything else raises a
            `ValueError` here, at construction.
        seed: weight-initialisation seed, an int in `[0, 2**32)`, the same
            for every trial (`build` reseeds Keras' global generator with it).
        overrides: further fixed config values, e.g. `{"image_shape": ...}`.
            They may not set what a searched key sets (`filters` sets
            `preprocess_filters` and `decoder_filters`): map that key to
            `None` in `search_space` to fix it instead. Nor `seed` (the
            `seed` argument sets it); a key the entry's config does not
            have raises a `ValueError` listing the valid ones.
        jit_compile: `True`, `False` or `"auto"`, passed to `model.compile`.

    Example:

    >>> hypermodel = VAEHyperModel(search_space={"learning_rate": None})
    >>> sorted(hypermodel.search_space)[:2]
    ['filters', 'generative_attention']
    """

    def __init__(
        self,
        entry="mnist-attentive-small",
        steps_per_epoch=100,
        epochs=None,
        search_space=None,
        seed=0,
        overrides=None,
        jit_compile="auto",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if zoo.describe(entry)["family"] != "hierarchical_vae":
            raise ValueError(f"`entry` must be a hierarchical VAE zoo entry. Received: entry={entry!r}")
        steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch")
        if epochs is not None:
            epochs = check_positive_int(epochs, "epochs")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 2**32:
            # `build` reseeds Keras' global generator with it, which takes [0, 2**32).
            raise ValueError(f"`seed` must be an int in [0, 2**32). Received: seed={seed!r}")
        if not (isinstance(jit_compile, bool) or jit_compile == "auto"):
            raise ValueError(f"`jit_compile` must be True, False or 'auto'. Received: jit_compile={jit_compile!r}")
        if search_space is not None and not isinstance(search_space, dict):
            raise ValueError(f"`search_space` must be a dict or None. Received: search_space={search_space!r}")
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError(f"`overrides` must be a dict or None. Received: overrides={overrides!r}")
        space = dict(DEFAULT_SEARCH_SPACE)
        unknown = sorted(set(search_space or {}) - set(space), key=repr)
        if unknown:
            raise ValueError(
                f"Unknown search-space key(s) {unknown}. Valid keys: {', '.join(sorted(space))}. "
                f"Received: search_space={search_space!r}"
            )
        space.update(search_space or {})
        self.search_space = {k: _checked(k, v) for k, v in space.items() if v is not None}
        floor = training.resolve_recipe(entry).get("min_learning_rate")
        if "learning_rate" in self.search_space and floor and self.search_space["learning_rate"][0] < floor:
            # The schedule decays from the sampled peak to the recipe's floor:
            # a trial sampling below it failed in `build`.
            raise ValueError(
                f"`search_space['learning_rate']` must not reach below the recipe's min_learning_rate ({floor}), "
                f"the floor the schedule decays to. Received: {self.search_space['learning_rate']!r}"
            )
        self.overrides = dict(overrides or {})
        if "seed" in self.overrides:
            # `build` passes its own `seed` to the model (zoo.load(..., seed=...)).
            raise ValueError(
                "`overrides` may not set 'seed': every trial's model is seeded with the hypermodel's `seed`. "
                f"Pass VAEHyperModel(..., seed={self.overrides['seed']!r}) instead. "
                f"Received: overrides={self.overrides!r}"
            )
        # Unknown keys (`weights` included) named here, not at the tuner's first build.
        zoo.config(entry, **self.overrides)
        clashes = [
            f"overrides[{name!r}]={self.overrides[name]!r} vs search_space[{key!r}]={self.search_space[key]!r}"
            for key in self.search_space
            for name in _SETS[key]
            if name in self.overrides
        ]
        if clashes:
            raise ValueError(
                "`overrides` may not set what the search space searches (the tuner would record one value "
                "and build the model with another); map the key to None in `search_space` to fix it. "
                f"Received: {'; '.join(clashes)}"
            )
        self.entry = entry
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self.seed = int(seed)
        self.jit_compile = jit_compile

    def _config(self, hp):
        space, config = self.search_space, {}
        for key in ("num_layers", "latent_channels"):
            if key in space:
                config[key] = hp.Choice(key, list(space[key]))
        if "filters" in space:
            filters = hp.Choice("filters", list(space["filters"]))
            config.update(preprocess_filters=filters, decoder_filters=filters)
        base = zoo.config(self.entry)
        for key in _SWITCHES:
            if key not in space:
                continue
            choices = space[key]  # [False, True] or one of them (see `_checked`)
            on = hp.Boolean(key) if len(choices) == 2 else hp.Fixed(key, choices[0])
            if key == "nonlocal_blocks":
                config[key] = (copy.copy(base[key]) or list(_NONLOCAL_PLACES)) if on else []
            else:
                config[key] = on
        config.update(self.overrides)
        return config

    def _recipe(self, hp):
        overrides = {}
        if self.epochs is not None:
            overrides["epochs"] = self.epochs
        if "learning_rate" in self.search_space:
            low, high = self.search_space["learning_rate"]
            overrides["learning_rate"] = hp.Float("learning_rate", low, high, sampling="log")
        return training.resolve_recipe(self.entry, **overrides)

    def build(self, hp):
        """A compiled, built model for `hp` (deterministic given `hp` and `seed`).

        Raises `keras_tuner.errors.FatalValueError` (which stops the search)
        when `hp` comes from a search started with another search space,
        `entry` or `overrides`: a tuner resumed from its `directory` and
        `project_name` goes on with the space its oracle recorded, so its new
        trials would draw values from the old space (KerasTuner does not
        compare them).
        """
        self._record_search(hp)
        # Initialisers without their own seed draw from Keras' global
        # generator: reseed it so every trial of one `hp` starts alike.
        keras.utils.set_random_seed(self.seed)
        model = zoo.load(self.entry, weights=None, seed=self.seed, **self._config(hp))
        recipe = self._recipe(hp)
        check_guard_policy(model)
        model.compile(
            optimizer=training.make_optimizer(recipe, self.steps_per_epoch, recipe["epochs"]),
            jit_compile=self.jit_compile,
        )
        # Built now, so that KerasTuner's `load_weights` (Hyperband's next
        # round, `get_best_models`) restores the optimizer too: unbuilt, its
        # state was skipped with a warning and the schedule restarted at step 0.
        model.optimizer.build(model.trainable_variables)
        return model

    def _fixed_config(self):
        """What the search space leaves fixed (`entry`, `overrides`), as canonical JSON."""
        return json.dumps({"entry": self.entry, "overrides": self.overrides}, sort_keys=True, default=_plain)

    def _record_search(self, hp):
        """Refuses `hp` from a search started with another space, `entry` or `overrides`; records them otherwise.

        A tuner's hyperparameters carry its search space and, from its first
        `build` (on the empty space), `_FIXED_CONFIG`. Hand-made ones that
        disagree with the search space (e.g. `Fixed` values) get no record.
        """
        recorded = {p.name: p for p in hp.space}
        declared = keras_tuner.HyperParameters()
        self._config(declared)
        self._recipe(declared)
        declared = {p.name: p for p in declared.space}
        # A search's record holds every key it searched; a hand-made `hp` may hold only some.
        keys = [key for key in DEFAULT_SEARCH_SPACE if _FIXED_CONFIG in recorded or key in recorded]
        differences = [
            f"search_space[{key!r}] was {_as_searched(recorded.get(key))!r}, now {_as_searched(declared.get(key))!r}"
            for key in keys
            if _definition(recorded.get(key)) != _definition(declared.get(key))
        ]
        fixed_config = self._fixed_config()
        if _FIXED_CONFIG not in recorded:
            # Record the search from here on where `hp` agrees with this
            # hypermodel (the tuner's first, empty space, or a project started
            # before the record existed); hand-made `Fixed` values do not.
            if not differences:
                hp.Fixed(_FIXED_CONFIG, fixed_config)
                hp.values[_FIXED_CONFIG] = fixed_config  # not a value copied from another search's
            return
        differences += _fixed_config_differences(recorded[_FIXED_CONFIG].value, fixed_config)
        if differences:
            raise keras_tuner.errors.FatalValueError(
                "These hyperparameters come from a search started with another search space or fixed config: "
                "a tuner resumed from its `directory` and `project_name` keeps the space that search recorded, "
                "so its new trials would draw values from the old space and mix two searches in one project. "
                f"Differences: {'; '.join(differences)}. Start a new search with another `project_name` (or "
                "`overwrite=True`, which deletes this project's trials), or resume this one with the arguments "
                "it was started with. To build a configuration that search found with this hypermodel, pass its "
                "values alone: `hp = keras_tuner.HyperParameters(); hp.values = dict(best.values)`. "
                f"Received: entry={self.entry!r}, search_space={self.search_space!r}, overrides={self.overrides!r}"
            )

    def fit(self, hp, model, *args, callbacks=None, **kwargs):
        """`model.fit` with the recipe's per-epoch KL warm-up added.

        Raises `keras_tuner.errors.FatalValueError` (which stops the search)
        when `fit` would run other epochs or steps per epoch than the
        learning-rate schedule was laid out for.
        """
        recipe = self._recipe(hp)
        self._check_schedule(hp, recipe["epochs"], args[0] if args else kwargs.get("x"), kwargs)
        warmup = training.KLWarmup(recipe.get("kl_warmup_epochs") or 0, recipe.get("kl_min", 1.0))
        return model.fit(*args, callbacks=list(callbacks or []) + [warmup], **kwargs)

    def _check_schedule(self, hp, schedule_epochs, x, kwargs):
        """Refuses a `fit` whose epochs or steps per epoch differ from the schedule's."""
        epochs = kwargs.get("epochs", 1)
        # Hyperband's trials run `tuner/epochs` <= its max_epochs, the schedule's length.
        short_ok = "tuner/epochs" in hp.values
        if epochs > schedule_epochs or (epochs < schedule_epochs and not short_ok):
            raise keras_tuner.errors.FatalValueError(
                f"`fit` runs epochs={epochs} but the learning-rate schedule is laid out over "
                f"{schedule_epochs} epochs (the hypermodel's `epochs`, or the recipe's when None), so it would "
                f"{'end early' if epochs > schedule_epochs else 'never decay'}. Pass "
                f"VAEHyperModel(..., epochs={epochs}). Received: epochs={epochs}"
            )
        steps = _steps_per_epoch(x, kwargs)
        if steps is not None and steps != self.steps_per_epoch:
            raise keras_tuner.errors.FatalValueError(
                f"`fit` runs {steps} steps per epoch but the learning-rate schedule is laid out for "
                f"steps_per_epoch={self.steps_per_epoch}. Pass VAEHyperModel(..., steps_per_epoch={steps}) "
                f"(math.ceil(len(x) / batch_size) for arrays). Received: steps_per_epoch={self.steps_per_epoch}"
            )


def _steps_per_epoch(x, kwargs):
    """The steps per epoch `model.fit(x, **kwargs)` runs, or None where it cannot be told."""
    if kwargs.get("steps_per_epoch") is not None:
        return kwargs["steps_per_epoch"]
    if hasattr(x, "shape") and len(x.shape) > 0 and not hasattr(x, "cardinality"):
        # Arrays: Keras' split keeps the first floor(n * (1 - validation_split)).
        n = int(x.shape[0])
        if kwargs.get("validation_split"):
            n = int(math.floor(n * (1.0 - kwargs["validation_split"])))
        return math.ceil(n / (kwargs.get("batch_size") or 32))
    if isinstance(x, keras.utils.PyDataset):
        return len(x)
    if hasattr(x, "cardinality"):  # tf.data: its batches, when finite and known
        batches = int(x.cardinality())
        return batches if batches >= 0 else None
    return None


def _definition(hp):
    """A recorded hyperparameter's type and config, comparable across a save and reload."""
    return None if hp is None else (type(hp).__name__, hp.get_config())


def _as_searched(hp):
    """The `search_space` value `VAEHyperModel` declares `hp` for (None: not searched)."""
    if hp is None:
        return None
    config = hp.get_config()
    if "values" in config:  # Choice
        return list(config["values"])
    if "value" in config:  # Fixed: a switch fixed to one value
        return [config["value"]]
    if "min_value" in config:  # Float, the learning rate's range
        return (config["min_value"], config["max_value"])
    return [False, True]  # Boolean: a searched switch


def _fixed_config_differences(recorded, current):
    """`entry` and `overrides` values that differ between two `_fixed_config` records."""
    try:
        old = json.loads(recorded)
    except (TypeError, ValueError):
        old = None
    new = json.loads(current)
    if not isinstance(old, dict):
        return [f"the fixed config was {recorded!r}, now {current!r}"]
    differences = []
    if old.get("entry") != new["entry"]:
        differences.append(f"entry was {old.get('entry')!r}, now {new['entry']!r}")
    old_overrides, new_overrides = old.get("overrides") or {}, new["overrides"]
    for name in sorted(set(old_overrides) | set(new_overrides)):
        if (name in old_overrides, old_overrides.get(name)) != (name in new_overrides, new_overrides.get(name)):
            was, now = (repr(o[name]) if name in o else "not set" for o in (old_overrides, new_overrides))
            differences.append(f"overrides[{name!r}] was {was}, now {now}")
    return differences


def _plain(value):
    """JSON for what `json` cannot write: NumPy values as numbers or lists, Keras objects as their config."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "get_config"):
        return keras.saving.serialize_keras_object(value)
    return repr(value)


def _checked(key, value):
    """`search_space[key]` in its canonical form, or a `ValueError` naming the key."""
    if key == "learning_rate":
        form = "a (low, high) range of numbers, 0 < low <= high"
        ok = (
            isinstance(value, (tuple, list))
            and len(value) == 2
            and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            and 0 < value[0] <= value[1]
        )
        value_out = (float(value[0]), float(value[1])) if ok else None
    elif key in _SWITCHES:
        form = "a non-empty list of bools, e.g. [False, True]"
        ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, bool) for v in value)
        value_out = sorted(set(value)) if ok else None
    else:
        form = "a non-empty list of positive ints to choose from"
        ok = (
            isinstance(value, (list, tuple))
            and len(value) > 0
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in value)
        )
        # Each value once: a repeated one would be drawn more often.
        value_out = list(dict.fromkeys(int(v) for v in value)) if ok else None
    if not ok:
        raise ValueError(f"`search_space[{key!r}]` must be {form} (or None, not to search it). Received: {value!r}")
    return value_out
