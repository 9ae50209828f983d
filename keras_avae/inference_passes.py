"""Inference passes through a model: compiled once per shape on JAX, without autograd on PyTorch.

Eager JAX compiles every primitive the first time it meets its shapes: the
first eager `reconstruct` of 32 images by `mnist-attentive-small` compiles
about a thousand of them and takes several times longer than one `jax.jit`
of the whole pass, which is also faster on every later call. Eager
TensorFlow runs precompiled kernels, and tracing a `tf.function` costs
more than a one-off pass gains, so passes stay eager there unless they ask
for XLA (importance sampling, which runs its pass thousands of times).
Eager PyTorch would record an autograd graph that keeps every activation
alive, so the passes run under `torch.no_grad()`.
`benchmarks/inference_speed.py` prints the figures.
"""

import contextlib

import keras


def inference_pass(model, name, fn, static_argnums=(), xla_on_tensorflow=False):
    """`fn` for `model` as a pass without gradients, compiled on JAX.

    Args:
        model: the Keras model whose variables `fn` reads.
        name: the cache key: the compiled function is kept on the model, so
            calls with the same `name` and shapes reuse one compilation.
        fn: a function of positional arguments that calls `model` (or its
            parts) and returns tensors (or lists/tuples/dicts of them).
        static_argnums: the positions of the arguments that are Python
            values (ints, strings, bools), hashed into the compiled
            function; the other arguments are arrays.
        xla_on_tensorflow: compile on TensorFlow too, with XLA (for passes
            run many times, such as importance sampling's).

    Returns:
        A callable with `fn`'s arguments. On JAX, `jax.jit` over the
        model's variables (see `_jax_stateless_jit`); on PyTorch, `fn`
        under `torch.no_grad()`; on TensorFlow, `fn` itself, or its XLA
        `tf.function` with `xla_on_tensorflow`.

    Example:

    >>> import numpy as np, keras
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> double = inference_pass(model, "double", lambda x: 2 * model(x))
    >>> tuple(double(np.ones((1, 3), "float32")).shape)
    (1, 2)
    """
    backend = keras.backend.backend()
    if backend == "tensorflow" and not xla_on_tensorflow:
        return fn
    # Every variable must exist before the pass is compiled: XLA cannot create
    # one inside its function (an unbuilt model's `log_likelihood` failed with
    # "We failed to lift variable creations out of this tf.function"), and
    # one created inside a JAX trace would hold a tracer once the trace ends.
    if not model.built:
        model.build()
    cache = model.__dict__.get("_keras_avae_inference_passes")
    if cache is None:
        cache = {}
        # `object.__setattr__` keeps it out of Keras' attribute tracking.
        object.__setattr__(model, "_keras_avae_inference_passes", cache)
    if name not in cache:
        if backend == "jax":
            cache[name] = _jax_stateless_jit(model, fn, static_argnums)
        elif backend == "tensorflow":
            import tensorflow as tf

            cache[name] = tf.function(fn, jit_compile=True, reduce_retracing=True)
        else:

            def without_gradients(*args):
                with _no_gradients():
                    return fn(*args)

            cache[name] = without_gradients
    return cache[name]


def _no_gradients():
    """`torch.no_grad()` on PyTorch, where eager ops record an autograd graph; no-op elsewhere.

    A recorded graph keeps every activation of a pass alive: the paper-size
    OMNIGLOT model ran out of an 80 GB GPU at 1,000 image-samples per pass
    before evaluation ran without it.
    """
    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _jax_stateless_jit(model, fn, static_argnums=()):
    """`jax.jit` of `fn(*args)` with the model's variables passed as values.

    JAX traces pure functions, so, as Keras' own JAX trainer does, the
    variables go in through a `keras.StatelessScope` and the non-trainable
    ones come back out and are assigned: the seed states the call advanced,
    so successive calls draw fresh samples (the same ones an eager call
    draws), and any statistics the pass updates.
    """
    import jax

    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    offset = 2  # the two lists of variable values come first

    def pure(trainable_values, non_trainable_values, *args):
        mapping = list(zip(trainable, trainable_values)) + list(zip(non_trainable, non_trainable_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            out = fn(*args)
        return out, [scope.get_current_value(v) for v in non_trainable]

    jitted = jax.jit(pure, static_argnums=tuple(offset + i for i in static_argnums))

    def call(*args):
        out, updated = jitted([v.value for v in trainable], [v.value for v in non_trainable], *args)
        for variable, value in zip(non_trainable, updated):
            variable.assign(value)
        return out

    return call
