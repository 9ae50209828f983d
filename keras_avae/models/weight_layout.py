"""Weight files written before `HierarchicalVAE` had one layer per stochastic layer.

Before commit f7a34c0 (keras-avae 0.1.0.dev0) the prior and posterior layers
were parallel lists on the model (`merge_decoder`, `prior_heads`,
`posterior_heads`, ...); a weight file stores variables by the path of the
attribute that holds them, so those files do not load into the model with
`PriorCell`s and `PosteriorCell`s. Loading one raises an error that says
so; `tools/convert_weights_layout.py` converts it, reading it with the
code of that time (git) and matching variables by `legacy_variable_key`.
"""

import re

# Top-level groups only the old layout has.
LEGACY_GROUPS = frozenset({"merge_decoder", "prior_heads", "posterior_heads", "top_posterior", "merge_encoder_p"})
_CELL = re.compile(r"(prior|posterior)_cell_\d+")


def legacy_variable_key(path, model_name):
    """The variable path without the model's name and the cell, as the old layout named it.

    Example:

    >>> legacy_variable_key("hierarchical_vae/prior_cell_1/merge_decoder_1/kernel", "hierarchical_vae")
    'merge_decoder_1/kernel'
    >>> legacy_variable_key("prior_cell_2/generative_gate_2", "hierarchical_vae")
    'generative_gate_2'
    >>> legacy_variable_key("hierarchical_vae/generative_gate_2", "hierarchical_vae")
    'generative_gate_2'
    """
    parts = path.split("/")
    if parts and parts[0] == model_name:
        parts = parts[1:]
    return "/".join(p for p in parts if not _CELL.fullmatch(p))


def is_legacy_weights_file(filepath):
    """Whether `filepath` is a `.weights.h5` file in the old layout.

    Example:

    >>> is_legacy_weights_file("not-an-h5-file.keras")
    False
    """
    if not str(filepath).endswith(".h5"):
        return False
    import h5py

    try:
        with h5py.File(filepath, "r") as f:
            return bool(LEGACY_GROUPS & set(f.keys()))
    except OSError:
        return False  # not readable as HDF5: Keras reports it


def check_weight_layout(filepath):
    """Raises `ValueError` naming `filepath` when it is in the old layout.

    Example:

    >>> import h5py
    >>> with h5py.File("old.weights.h5", "w") as f:
    ...     _ = f.create_group("prior_heads")
    >>> check_weight_layout("old.weights.h5")
    Traceback (most recent call last):
    ...
    ValueError: old.weights.h5 was written by keras-avae before HierarchicalVAE had one PriorCell ...
    """
    if is_legacy_weights_file(filepath):
        raise ValueError(
            f"{filepath} was written by keras-avae before HierarchicalVAE had one PriorCell and one "
            "PosteriorCell per stochastic layer, so its variables are stored under other paths. Convert it "
            "once with `python tools/convert_weights_layout.py OLD NEW --config CONFIG` from a keras-avae "
            "git checkout. Received: filepath=" + repr(str(filepath))
        )
