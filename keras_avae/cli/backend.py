"""Importing Keras and the backend for the commands that compute, quietly unless asked.

Only `train`, `evaluate`, `sample`, `demo` and `report` call
`_import_backend`, after their arguments are checked.
"""

import contextlib
import importlib.util
import logging
import os
import sys


@contextlib.contextmanager
def _stderr_silenced():
    """Sends file descriptor 2 to /dev/null (C++ libraries write there, not to `sys.stderr`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _import_backend(args, tensorflow=False):
    """Imports Keras (and TensorFlow when the command needs it), quietly unless asked.

    TensorFlow prints its oneDNN and CUDA notices while it is imported,
    before `TF_CPP_MIN_LOG_LEVEL` takes effect, so they are hidden by
    silencing stderr for the import; the variable (3 unless the user set it)
    hides the later ones. `--backend-logs`, or `TF_CPP_MIN_LOG_LEVEL=0`,
    shows everything.
    """
    import keras_avae

    if "keras_avae.training" in sys.modules and (not tensorflow or "tensorflow" in sys.modules):
        return  # already imported (a second command in one process, the tests)
    quiet = not args.backend_logs and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3") != "0"
    if quiet:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with _stderr_silenced() if quiet else contextlib.nullcontext():
        import keras  # imports the backend

        if keras.backend.backend() == "jax":
            _keep_compiled_jax_programs()

        if tensorflow and importlib.util.find_spec("tensorflow") is not None:
            import tensorflow  # noqa: F401
        # What `import keras_avae` imports outside the command line: some
        # modules import TensorFlow (or its relatives) on every backend.
        for module in keras_avae._SUBMODULES:
            importlib.import_module(f"keras_avae.{module}")
        from keras_avae.distributions.tfp import has_tfp, tfd

        if has_tfp():
            tfd()  # TFP's JAX substrate imports TensorFlow too
    if quiet:
        if "absl.logging" in sys.modules:
            sys.modules["absl.logging"].set_verbosity("error")
        # "An NVIDIA GPU may be present ... Falling back to cpu" and the like.
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
        logging.getLogger("tensorflow").setLevel(logging.ERROR)


def _keep_compiled_jax_programs():
    """Turns on JAX's persistent compilation cache for the command, unless the user configured it.

    Eager JAX compiles every primitive and weight shape it meets, and every
    jitted pass, in each new process: `keras-avae demo` took 38 s, and 15 s
    when run again with the cache (2.6 MB of programs; 2-core CPU). Called
    before anything is compiled; the folder is
    `$XDG_CACHE_HOME/keras-avae/jax` (`~/.cache/...`). A
    `JAX_COMPILATION_CACHE_DIR` of the user's is used as it is, and
    `JAX_ENABLE_COMPILATION_CACHE=false` turns the cache off.
    """
    import jax

    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_home, "keras-avae", "jax"))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX keeps only programs that took a second to compile by default;
        # the many small eager ones are most of the time.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _backend():
    import keras

    return keras.backend.backend()
