"""The training recipe: the paper's values, a zoo entry's, and overrides.

`resolve_recipe` gives the dict every other part of training reads
(`make_optimizer`, `KLWarmup`, `train`); `split_overrides` routes the CLI's
`--set key=value` pairs to the model config or to the recipe.
"""

import numpy as np

from keras_avae import zoo
from keras_avae._validation import check_finite_number
from keras_avae._validation import is_int


#: The paper's recipe, used when `train` gets a model object rather than a zoo name.
REFERENCE_RECIPE = {
    "optimizer": "adamax",
    "learning_rate": 1e-2,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-3,
    "warmup_epochs": 5,
    "initial_learning_rate": 1e-4,
    "min_learning_rate": 1e-4,
    "epochs": 400,
    "restart_epochs": None,
    "kl_warmup_epochs": 16,
    "kl_min": 0.1,
    "batch_size_per_replica": 16,
    "global_clipnorm": None,
    "max_nonfinite_steps": 100,
}

# Keys a zoo entry may leave out take these values: "off", not the
# reference recipe (mnist-gumbel has no KL or learning-rate warm-up).
_NEUTRAL_RECIPE = {
    "optimizer": "adamax",
    "learning_rate": 1e-3,
    "warmup_epochs": 0,
    "initial_learning_rate": None,
    "min_learning_rate": None,
    "epochs": 1,
    "restart_epochs": None,
    "kl_warmup_epochs": 0,
    "kl_min": 1.0,
    "batch_size_per_replica": 16,
    "global_clipnorm": None,
    "max_nonfinite_steps": 100,
}


# Keys of a zoo entry's recipe that describe it rather than set a run:
# overriding them would be recorded and do nothing. Where to set them.
_DESCRIPTIVE_KEYS = {
    "dataset": "the data are `train`'s `dataset` (keras-avae train --data-dir)",
    "replicas": "the replicas are the strategy's (--strategy, --cpu-devices)",
    "evaluation_importance_samples": "K is set when scoring (keras-avae evaluate --num-samples)",
}

#: Augmentations a recipe may list; `keras-avae train` applies them in `make_dataset`.
AUGMENTATIONS = ("horizontal_flip",)


def resolve_recipe(name=None, **overrides):
    """The training recipe of zoo entry `name` (or the paper's) with overrides.

    Args:
        name: a zoo entry name, or `None` for `REFERENCE_RECIPE`.
        **overrides: recipe values to change, e.g. `learning_rate=2e-3`.

    Returns:
        A dict with every key `make_optimizer` and `train` read.

    Raises:
        ValueError: for an override key the recipe does not have.

    Example:

    >>> resolve_recipe("mnist-baseline", epochs=3)["epochs"]
    3
    """
    if name is None:
        recipe = dict(REFERENCE_RECIPE)
    else:
        recipe = dict(_NEUTRAL_RECIPE)
        recipe.update(zoo.describe(name)["training"])
    unknown = sorted(set(overrides) - set(recipe))
    if unknown:
        raise ValueError(
            f"Unknown training recipe key(s) {unknown}. Valid keys: {', '.join(sorted(recipe))}. "
            f"Received: {overrides}"
        )
    descriptive = sorted(set(overrides) & set(_DESCRIPTIVE_KEYS))
    if descriptive:
        key = descriptive[0]
        raise ValueError(
            f"`{key}` describes the entry and is not a training setting: {_DESCRIPTIVE_KEYS[key]}. "
            f"Received: {key}={overrides[key]!r}"
        )
    recipe.update(overrides)
    _check_augmentation(recipe.get("augmentation", []))
    _positive_int("batch_size_per_replica", recipe["batch_size_per_replica"])
    _check_numbers(recipe)
    return recipe


# The recipe's numbers: (condition, what it asks, whether None is allowed).
# Before, `beta_1=1.0` wrote NaN weights unseen (the gradients were finite),
# and several keys were refused under another name or with a TypeError.
_NUMBER_RULES = {
    "learning_rate": (lambda v: v > 0, "> 0", False),
    "initial_learning_rate": (lambda v: v >= 0, ">= 0", True),
    "min_learning_rate": (lambda v: v >= 0, ">= 0", True),
    "beta_1": (lambda v: 0 <= v < 1, "in [0, 1)", True),
    "beta_2": (lambda v: 0 <= v < 1, "in [0, 1)", True),
    "epsilon": (lambda v: v > 0, "> 0", True),  # 0: a zero gradient divides 0 by 0
    "warmup_epochs": (lambda v: v >= 0, ">= 0", True),
    "restart_epochs": (lambda v: v > 0, "> 0", True),
    "kl_min": (lambda v: 0 <= v <= 1, "in [0, 1]", False),
    "global_clipnorm": (lambda v: v > 0, "> 0", True),
}


def _check_numbers(recipe):
    """Refuses a recipe number out of its range, naming the recipe key.

    Here, before `train` records the recipe: a value refused only when
    training starts would be recorded first, and the run folder would then
    refuse the corrected value as a change.
    """
    for key, (condition, wanted, optional) in _NUMBER_RULES.items():
        if key not in recipe or (optional and recipe[key] is None):
            continue
        check_finite_number(recipe[key], key, condition, wanted + (" (or None)" if optional else ""))
    for key in ("kl_warmup_epochs", "max_nonfinite_steps"):
        value = recipe.get(key)
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"`{key}` must be a non-negative int. Received: {key}={value!r}")


def _check_augmentation(augmentation):
    if not isinstance(augmentation, (list, tuple)) or not set(augmentation) <= set(AUGMENTATIONS):
        raise ValueError(
            f"`augmentation` must be a list of names from {list(AUGMENTATIONS)}, or []. "
            f"Received: augmentation={augmentation!r}"
        )


def split_overrides(name, overrides):
    """Routes `key=value` overrides (the CLI's `--set`) to config or recipe.

    Args:
        name: a zoo entry name.
        overrides: dict of overrides.

    Returns:
        `(config_overrides, recipe_overrides)`.

    Raises:
        ValueError: for a key that is neither.

    Example:

    >>> split_overrides("mnist-baseline", {"num_layers": 2, "epochs": 3})
    ({'num_layers': 2}, {'epochs': 3})
    """
    config_keys = set(zoo.describe(name)["config"]) | {"seed", "synchronized_batch_norm", "dtype"}
    recipe_keys = set(resolve_recipe(name))
    config, recipe = {}, {}
    for key, value in overrides.items():
        if key in config_keys:
            config[key] = value
        elif key in recipe_keys:
            recipe[key] = value
        else:
            raise ValueError(
                f"Unknown override {key!r} for zoo entry {name!r}. Model keys: "
                f"{', '.join(sorted(config_keys))}. Training keys: {', '.join(sorted(recipe_keys))}. "
                f"Received: {key}={value!r}"
            )
    return config, recipe



def _positive_int(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
    return int(value)
