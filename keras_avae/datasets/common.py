"""Argument checks and helpers shared by the readers, discovery and the pipeline."""

import numpy as np

#: The dataset names `load` and `make_dataset` accept.
NAMES = ("mnist", "omniglot", "cifar10")

#: The splits `load` and `make_dataset` accept.
SPLITS = ("train", "test")


def _check_name(name):
    if name not in NAMES:
        raise ValueError(f"`name` must be one of {NAMES}. Received: name={name!r}")


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}. Received: split={split!r}")


def _is_int(value, minimum):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum


def _open_npz(path):
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except Exception as e:
        raise ValueError(f"{path}: not a readable .npz file ({type(e).__name__}: {e}).") from e


def _npz_get(npz, key, path):
    try:
        return npz[key]
    except Exception as e:
        raise ValueError(f"{path}: array {key!r} is truncated or corrupt ({type(e).__name__}: {e}).") from e


_TF_CONFIGURED = False


def _tf():
    """Imports TensorFlow; on the JAX/PyTorch backends hides the GPUs from it."""
    global _TF_CONFIGURED
    import tensorflow as tf

    if not _TF_CONFIGURED:
        _TF_CONFIGURED = True
        import keras

        if keras.backend.backend() != "tensorflow":
            try:
                tf.config.set_visible_devices([], "GPU")
            except RuntimeError:  # Devices already initialised: leave them.
                pass
    return tf
