"""Seeds and deterministic kernels: the same `train` call gives the same numbers.

Issue 14 item 5. What varies between two runs of one command, and what
`_make_reproducible` does about it:

- Weight initialisation: Keras initializers and `SeedGenerator`s built with
  `seed=None` draw their seeds from Python's `random`, unseeded in a fresh
  process; so do the FAVOR+ features of layers built with `seed=None`.
  `keras.utils.set_random_seed` seeds Python's `random`, NumPy (`fit`'s
  shuffling of arrays), TensorFlow's global seed, torch's generator and
  Keras's global `SeedGenerator`.
- Latent sampling, dropout and the Gumbel noise go through the models'
  `SeedGenerator(seed)`: reproducible from the model's `seed`.
- `make_dataset` fixes its shuffle and binarisation seeds when the dataset
  is built, from its `seed` and TensorFlow's global seed at that moment (a
  fixed default when none is set, as in a fresh `keras-avae train`). Seeding
  afterwards, as `train` does, leaves the data order of a dataset built
  before it unchanged.
- Kernels: TensorFlow's `enable_op_determinism` (GPU kernels, tf.data
  parallelism); torch's `use_deterministic_algorithms`; JAX on a GPU needs
  `--xla_gpu_deterministic_ops` in `XLA_FLAGS` before it initialises the GPU.
  JAX on a CPU is deterministic. On a CPU, TensorFlow's kernels gave the
  same numbers run to run once seeded, and op determinism cost little (the
  README's "Reproducible" gives the measurement); on a GPU it can cost more:
  `keras-avae train --no-deterministic` turns it off.
"""

import os

import keras


def _make_reproducible(seed, deterministic=True):
    """Seeds every random number generator a run draws from; optionally asks for deterministic kernels.

    Args:
        seed: non-negative int, passed to `keras.utils.set_random_seed`.
        deterministic: bool, also make the backend's kernels deterministic
            (process-wide; `False` leaves the backend's setting as it is).

    Example:

    >>> _make_reproducible(0, deterministic=False)
    >>> a = keras.layers.Dense(2); a.build((None, 3))
    >>> _make_reproducible(0, deterministic=False)
    >>> b = keras.layers.Dense(2); b.build((None, 3))
    >>> bool((a.get_weights()[0] == b.get_weights()[0]).all())
    True
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"`seed` must be a non-negative int or None. Received: seed={seed!r}")
    keras.utils.set_random_seed(seed)
    if not deterministic:
        return
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    elif backend == "torch":
        import torch

        # cuBLAS reads this when it initialises; without it deterministic
        # matmuls on CUDA raise. `warn_only`: an op without a deterministic
        # kernel warns instead of stopping the run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif backend == "jax":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_deterministic_ops" not in flags:
            # Read when JAX initialises a GPU; no effect on a CPU.
            os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_deterministic_ops=true".strip()
