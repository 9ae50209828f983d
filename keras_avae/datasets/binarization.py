"""Bernoulli binarisation of the grey-level sets (MNIST, OMNIGLOT).

`x = 1[u < p]` with `u ~ U[0, 1)`: `"static"` draws once with a seed (test
sets: the same binary set in every run), `"dynamic"` draws afresh for every
batch from a per-batch stateless seed (see `make_dataset`).
"""

import numpy as np


def _static_binarize(grey, scale, seed):
    """One seeded Bernoulli draw of `grey / scale`, as uint8 {0, 1}."""
    rng = np.random.default_rng(seed)
    out = np.empty(grey.shape, np.uint8)
    for start in range(0, grey.shape[0], 4096):
        p = grey[start : start + 4096].astype(np.float32) / np.float32(scale)
        out[start : start + 4096] = rng.random(p.shape, dtype=np.float32) < p
    return out
