"""Peak GPU memory of the Keras backend's framework, for the benchmarks' figures."""


def gpu_peak_bytes(backend):
    """The framework's peak GPU memory in bytes, or None without a GPU.

    Args:
        backend: the Keras backend's name: `"jax"`, `"tensorflow"` or `"torch"`.
    """
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        return device.memory_stats().get("peak_bytes_in_use") if device.platform == "gpu" else None
    if backend == "tensorflow":
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            return None
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
