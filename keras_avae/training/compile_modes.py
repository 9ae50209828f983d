"""How a compiled training step runs on this machine, in words (for logs, `run.json` and cards)."""

import keras

BACKEND = keras.backend.backend()


def compile_mode(model):
    """How a compiled model's training step runs, in words (for logs and cards).

    Keras's `jit_compile="auto"` uses XLA on TensorFlow only when an
    accelerator is visible and no `tf.distribute` strategy is in use: on a
    CPU, XLA's convolutions are 2-3x slower than oneDNN's graph kernels.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(loss="mse", jit_compile=False)
    >>> compile_mode(model).startswith(keras.backend.backend())
    True
    """
    devices = "GPU" if _gpu_visible() else "CPU"
    if BACKEND == "jax":
        return f"jax, jax.jit (XLA) on {devices}"
    if BACKEND == "torch":
        return f"torch, {'torch.compile' if model.jit_compile else 'eager'} on {devices}"
    return f"tensorflow, tf.function graph {'with' if model.jit_compile else 'without'} XLA on {devices}"



def _gpu_visible():
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    if BACKEND == "jax":
        import jax

        return jax.default_backend() == "gpu"
    if BACKEND == "torch":
        import torch

        return torch.cuda.is_available()
    return False
