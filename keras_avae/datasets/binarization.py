"""Bernoulli binarisation of the grey-level sets (MNIST, OMNIGLOT).

`x = 1[u < p]` with `u ~ U[0, 1)`: `"static"` draws once with a seed (test
sets: the same binary set in every run), `"dynamic"` draws afresh for every
batch from a per-batch stateless seed (see `make_dataset`).
"""

import numpy as np


def _check_binarize(name, binarize):
    """Raises a `ValueError` for a `binarize` mode `make_dataset` does not take."""
    if binarize not in ("auto", "dynamic", "static", None):
        raise ValueError(f"`binarize` must be 'auto', 'dynamic', 'static' or None. Received: binarize={binarize!r}")
    if name == "cifar10" and binarize not in ("auto", None):
        raise ValueError(f"CIFAR-10 is not binarised; pass binarize=None or 'auto'. Received: binarize={binarize!r}")


def _resolve_binarize(name, split, binarize):
    """`"auto"` as a mode: dynamic for train, static for test, None for CIFAR-10."""
    if binarize == "auto":
        binarize = None if name == "cifar10" else ("dynamic" if split == "train" else "static")
    return binarize


def _fixed_binarize(name):
    """The `binarize` mode of one seeded draw whatever the split (scoring, reports): none for CIFAR-10."""
    return "auto" if name == "cifar10" else "static"


def _grey_scale(name, images):
    """The value of full ink in a split as the readers return it: 255 for uint8 (MNIST), else 1."""
    return 255.0 if images.dtype == np.uint8 and name != "cifar10" else 1.0


def _static_binarize(grey, scale, seed):
    """One seeded Bernoulli draw of `grey / scale`, as uint8 {0, 1}."""
    rng = np.random.default_rng(seed)
    out = np.empty(grey.shape, np.uint8)
    for start in range(0, grey.shape[0], 4096):
        p = grey[start : start + 4096].astype(np.float32) / np.float32(scale)
        out[start : start + 4096] = rng.random(p.shape, dtype=np.float32) < p
    return out


def _dynamic_binarize(tf, grey, seed):
    """A fresh draw for one batch of grey levels in [0, 1], from a stateless seed pair."""
    u = tf.random.stateless_uniform(tf.shape(grey), seed=seed)
    return tf.cast(u < grey, tf.float32)
