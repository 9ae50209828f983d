"""Shared checks every keras-avae layer must pass, on whichever backend runs.

Modelled on keras-hub's `TestCase.run_layer_test`: one call checks the config
round trip, build, symbolic and eager calls, a `fit` step, mixed precision,
XLA compilation (TensorFlow and JAX) and a `.keras` save/load round trip.
"""

import os
import socket
import subprocess
import sys
import tempfile

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()


def backend_independent(reason):
    """Runs a test on TensorFlow only: what it tests is the same on every backend, so once is enough.

    `reason` says why, and where each backend's own part is tested.
    """
    import pytest

    return pytest.mark.skipif(BACKEND != "tensorflow", reason=f"backend-independent: {reason}")


def to_numpy(x):
    """Converts a tensor (or nested structure of tensors) to NumPy float64."""
    return keras.tree.map_structure(
        lambda t: np.asarray(ops.convert_to_numpy(ops.cast(t, "float32")), dtype=np.float64),
        x,
    )


def _shape_of(x):
    return keras.tree.map_structure(lambda t: tuple(t.shape), x)


def _symbolic_like(x):
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(tuple(t.shape), dtype=keras.backend.standardize_dtype(t.dtype)),
        x,
    )


def _inputs_like(x, name="input"):
    """Functional `keras.Input`s with the same structure as the data `x`."""
    if isinstance(x, dict):
        return {k: _inputs_like(v, name=k) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_inputs_like(v, name=f"{name}_{i}") for i, v in enumerate(x)]
    return keras.Input(
        batch_shape=tuple(x.shape),
        dtype=keras.backend.standardize_dtype(x.dtype),
        name=name,
    )


def _call(layer, data, call_kwargs):
    if isinstance(data, dict):
        return layer(**data, **call_kwargs)
    return layer(data, **call_kwargs)


class TestCase:
    """Mix-in with the shared layer checks; use as a plain pytest base class."""

    def assertAllClose(self, actual, desired, atol=1e-6, rtol=1e-6, msg=""):
        np.testing.assert_allclose(to_numpy(actual), to_numpy(desired), atol=atol, rtol=rtol, err_msg=msg)

    def assertAllFinite(self, x, msg=""):
        for t in keras.tree.flatten(to_numpy(x)):
            assert np.all(np.isfinite(t)), msg or "non-finite values"

    def run_serialization_test(self, layer):
        """`get_config` round-trips through `from_config` and Keras' registry."""
        config = layer.get_config()
        revived = layer.__class__.from_config(config)
        assert revived.get_config() == config
        serialized = keras.saving.serialize_keras_object(layer)
        assert serialized["registered_name"].startswith("keras_avae>"), serialized["registered_name"]
        revived = keras.saving.deserialize_keras_object(serialized)
        assert isinstance(revived, layer.__class__)
        assert revived.get_config() == config

    def run_layer_test(
        self,
        cls,
        init_kwargs,
        input_data,
        expected_output_shape=None,
        expected_num_trainable_weights=None,
        expected_num_non_trainable_weights=None,
        call_kwargs=None,
        run_training_check=True,
        run_precision_checks=True,
        run_jit_check=True,
        run_saving_check=True,
        output_to_tensor=None,
        training_atol=None,
    ):
        """Runs the standard battery of checks on one layer class.

        Args:
            cls: the layer class.
            init_kwargs: dict of constructor arguments.
            input_data: the call's inputs, one array or a dict of keyword
                arguments (e.g. `{"query": q, "value": v}`).
            expected_output_shape: the output shape (or structure of shapes).
            expected_num_trainable_weights: number of trainable weights.
            expected_num_non_trainable_weights: number of non-trainable weights.
            call_kwargs: extra keyword arguments for every call.
            run_training_check: run one `fit` step on a functional model.
            run_precision_checks: check `mixed_float16` and `mixed_bfloat16`.
            run_jit_check: compare eager and XLA-compiled outputs (TF, JAX).
            run_saving_check: `.keras` round trip of a functional model.
            output_to_tensor: maps the layer output to one tensor (for layers
                that return distributions or structures); default identity.
        """
        call_kwargs = call_kwargs or {}
        output_to_tensor = output_to_tensor or (lambda y: y)

        # Config round trip, before and after build.
        layer = cls(**init_kwargs)
        self.run_serialization_test(layer)

        # Symbolic call gives the same shapes as compute_output_shape.
        layer = cls(**init_kwargs)
        symbolic_out = _call(layer, _symbolic_like(input_data), call_kwargs)
        if expected_output_shape is not None:
            assert _shape_of(output_to_tensor(symbolic_out)) == expected_output_shape, (
                _shape_of(output_to_tensor(symbolic_out)),
                expected_output_shape,
            )

        # Eager call.
        layer = cls(**init_kwargs)
        output = _call(layer, input_data, call_kwargs)
        assert layer.built
        for sub in layer._flatten_layers(include_self=False):
            assert sub.built, f"sublayer {sub.name} of {layer.name} was not built"
        tensor_out = output_to_tensor(output)
        if expected_output_shape is not None:
            assert _shape_of(tensor_out) == expected_output_shape, (
                _shape_of(tensor_out),
                expected_output_shape,
            )
        self.assertAllFinite(tensor_out)
        if expected_num_trainable_weights is not None:
            assert len(layer.trainable_weights) == expected_num_trainable_weights, len(layer.trainable_weights)
        if expected_num_non_trainable_weights is not None:
            assert len(layer.non_trainable_weights) == expected_num_non_trainable_weights, len(
                layer.non_trainable_weights
            )
        self.run_serialization_test(layer)

        if run_training_check:
            self._run_training_check(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        if run_precision_checks:
            self._run_precision_checks(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        if run_jit_check and BACKEND in ("tensorflow", "jax"):
            self._run_jit_check(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        if run_saving_check:
            self._run_saving_check(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        return output

    def _functional_model(self, cls, init_kwargs, input_data, call_kwargs, output_to_tensor, **extra):
        inputs = _inputs_like(input_data)
        layer = cls(**init_kwargs, **extra)
        outputs = output_to_tensor(_call(layer, inputs, call_kwargs))
        return keras.Model(inputs, outputs), layer

    def _run_training_check(self, cls, init_kwargs, input_data, call_kwargs, output_to_tensor):
        model, layer = self._functional_model(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        target = keras.tree.map_structure(lambda t: np.zeros(t.shape, "float32"), model.outputs)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
        before = [np.array(w) for w in layer.trainable_weights]
        model.fit(input_data, target, batch_size=_batch_size(input_data), epochs=1, verbose=0, shuffle=False)
        after = [np.array(w) for w in layer.trainable_weights]
        for w, b, a in zip(layer.trainable_weights, before, after):
            assert np.all(np.isfinite(a)), f"weight {w.path} became non-finite after one fit step"

    def _run_precision_checks(self, cls, init_kwargs, input_data, call_kwargs, output_to_tensor):
        for policy in ("mixed_float16", "mixed_bfloat16"):
            compute_dtype = policy.split("_")[1]
            layer = cls(**init_kwargs, dtype=policy)
            data = keras.tree.map_structure(
                lambda t: ops.cast(t, compute_dtype)
                if keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype))
                else t,
                input_data,
            )
            out = output_to_tensor(_call(layer, data, call_kwargs))
            for t in keras.tree.flatten(out):
                if keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype)):
                    assert keras.backend.standardize_dtype(t.dtype) == compute_dtype, (
                        policy,
                        t.dtype,
                    )
            self.assertAllFinite(out, msg=f"non-finite output under {policy}")
            for w in layer.weights:
                assert keras.backend.standardize_dtype(w.dtype) == "float32" or not keras.backend.is_float_dtype(
                    w.dtype
                ), (w.path, w.dtype)

    def _run_jit_check(self, cls, init_kwargs, input_data, call_kwargs, output_to_tensor):
        model, _ = self._functional_model(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        eager = model.predict(input_data, batch_size=_batch_size(input_data), verbose=0)
        model.compile(jit_compile=True)
        compiled = model.predict(input_data, batch_size=_batch_size(input_data), verbose=0)
        self.assertAllClose(compiled, eager, atol=1e-4, rtol=1e-4)

    def _run_saving_check(self, cls, init_kwargs, input_data, call_kwargs, output_to_tensor):
        model, _ = self._functional_model(cls, init_kwargs, input_data, call_kwargs, output_to_tensor)
        self.run_model_saving_test(model, input_data)

    def run_model_saving_test(self, model, input_data, atol=1e-6):
        """`.keras` round trip: same class, same outputs on the same inputs."""
        expected = model.predict(input_data, batch_size=_batch_size(input_data), verbose=0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            restored = keras.saving.load_model(path)
        assert isinstance(restored, model.__class__)
        actual = restored.predict(input_data, batch_size=_batch_size(input_data), verbose=0)
        self.assertAllClose(actual, expected, atol=atol, rtol=atol)
        return restored


    def run_vae_model_test(self, cls, init_kwargs, input_data, mixed_precision_atol=None):
        """The model-level checks every keras-avae VAE must pass (keras-hub's model tests, for ELBO models).

        Config round trip, `.keras` save and load, `save_to_preset` /
        `from_preset`, one `fit` step, and mixed precision. Outputs are
        compared at the same seed-generator state (the forward pass samples
        the posterior).
        """
        model = cls(**init_kwargs)
        model.build()
        def seed_states(m):  # the model's and its layers' (e.g. a Gumbel sampler's)
            return [v for v in m.variables if v.path.endswith("seed_generator_state")]

        states = [np.array(ops.convert_to_numpy(v.value)) for v in seed_states(model)]
        assert states

        def outputs(m):
            for variable, state in zip(seed_states(m), states, strict=True):
                variable.assign(state)
            out = to_numpy(m(input_data, training=False))
            return np.concatenate([out["kl"][:, None], out["kl_per_layer"], out["nll"][:, None]], axis=1)

        assert sorted(model(input_data, training=False)) == ["kl", "kl_per_layer", "nll"]
        expected = outputs(model)
        assert all(np.isfinite(v).all() for v in expected)

        # Config round trip: the same config, and the same function once
        # the weights are copied.
        config = model.get_config()
        clone = cls.from_config(config)
        assert clone.get_config() == config
        clone.build()
        clone.set_weights(model.get_weights())
        self.assertAllClose(outputs(clone), expected, atol=1e-5, rtol=1e-5)

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            restored = keras.saving.load_model(path)
            assert type(restored) is cls
            self.assertAllClose(outputs(restored), expected, atol=1e-5, rtol=1e-5)

            preset = os.path.join(tmp, "preset")
            model.save_to_preset(preset)
            from_preset = cls.from_preset(preset)
            assert type(from_preset) is cls and from_preset.get_config() == config
            self.assertAllClose(outputs(from_preset), expected, atol=1e-5, rtol=1e-5)

        # One training step changes the weights and keeps the loss finite.
        before = [ops.convert_to_numpy(w) for w in model.trainable_weights]
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
        history = model.fit(input_data, epochs=1, batch_size=_batch_size(input_data), verbose=0)
        assert np.isfinite(history.history["loss"][0])
        after = [ops.convert_to_numpy(w) for w in model.trainable_weights]
        assert sum(not np.allclose(a, b) for a, b in zip(before, after)) > len(before) // 2

        # Mixed precision (bfloat16 compute): float32 ELBO terms and, with
        # `mixed_precision_atol`, per-image KLs and NLL close to the float32
        # model's with the same weights.
        mixed = cls(**{**init_kwargs, "dtype": "mixed_bfloat16"})
        mixed.build()
        mixed.set_weights(clone.get_weights())
        result = outputs(mixed)
        for key, value in mixed(input_data, training=False).items():
            assert keras.backend.standardize_dtype(value.dtype) == "float32", key
        if mixed_precision_atol is not None:
            self.assertAllClose(result, expected, atol=mixed_precision_atol, rtol=0.05)


def _batch_size(data):
    return int(keras.tree.flatten(data)[0].shape[0])


def gradients(layer, loss_fn, inputs):
    """Gradients of `loss_fn(layer(**inputs))` on the current backend.

    Args:
        layer: a built layer.
        loss_fn: maps the layer output to a scalar, with `keras.ops`.
        inputs: dict of call keyword arguments (arrays or lists of arrays).

    Returns:
        `(input_grads, weight_grads)`: NumPy arrays, the first with the
        structure of `inputs`, the second one per `layer.trainable_weights`.
    """
    inputs = keras.tree.map_structure(ops.convert_to_tensor, inputs)
    weights = layer.trainable_weights
    if BACKEND == "jax":
        import jax

        def f(trainable, xs):
            out, _ = layer.stateless_call(trainable, [v.value for v in layer.non_trainable_variables], **xs)
            return loss_fn(out)

        grad_w, grad_x = jax.jit(jax.grad(f, argnums=(0, 1)))([v.value for v in weights], inputs)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(inputs)
            loss = loss_fn(layer(**inputs))
        grad_x, grad_w = tape.gradient(loss, (inputs, [v.value for v in weights]))
    elif BACKEND == "torch":
        import torch

        inputs = keras.tree.map_structure(lambda t: t.detach().requires_grad_(True), inputs)
        loss = loss_fn(layer(**inputs))
        flat = keras.tree.flatten(inputs)
        grads = torch.autograd.grad(loss, flat + [v.value for v in weights], allow_unused=True)
        grad_x = keras.tree.pack_sequence_as(inputs, list(grads[: len(flat)]))
        grad_w = list(grads[len(flat) :])
    else:
        raise NotImplementedError(BACKEND)
    to_np = lambda g: None if g is None else to_numpy(g)  # noqa: E731
    return keras.tree.map_structure(to_np, grad_x), [to_np(g) for g in grad_w]


def largest_intermediate_size(fn, *args):
    """Most elements in any tensor that `fn(*args)` creates (TF, JAX, torch).

    Traces `fn` (JAX jaxpr, TensorFlow graph) or records every torch op's
    output, so a test can check that a computation never materialises a
    tensor of a given size (e.g. an (HW x HW) attention matrix).
    """
    args = keras.tree.map_structure(ops.convert_to_tensor, args)
    if BACKEND == "jax":
        import jax

        def walk(jaxpr):
            largest = 0
            for eqn in jaxpr.eqns:
                for var in eqn.outvars:
                    largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
                for param in keras.tree.flatten(list(eqn.params.values())):
                    inner = getattr(param, "jaxpr", param)
                    if hasattr(inner, "eqns"):
                        largest = max(largest, walk(inner))
            return largest

        return walk(jax.make_jaxpr(fn)(*args).jaxpr)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        graph = tf.function(fn).get_concrete_function(*args).graph
        largest = 0
        for op in graph.get_operations():
            for t in op.outputs:
                if t.shape.rank is not None and t.shape.is_fully_defined():
                    largest = max(largest, t.shape.num_elements())
        return largest
    if BACKEND == "torch":
        import torch
        from torch.overrides import TorchFunctionMode

        sizes = [0]

        class Recorder(TorchFunctionMode):
            def __torch_function__(self, func, types, func_args=(), kwargs=None):
                out = func(*func_args, **(kwargs or {}))
                for t in keras.tree.flatten(out) if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        sizes[0] = max(sizes[0], t.numel())
                return out

        with Recorder(), torch.no_grad():
            fn(*args)
        return sizes[0]
    raise NotImplementedError(BACKEND)


def input_gradient(fn, x):
    """Gradient of `sum(fn(x))` with respect to the array `x` (any backend)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.sum(fn(x))
        return tape.gradient(y, x)
    if BACKEND == "jax":
        import jax

        def loss(t):
            # The seed generator's update stays inside the trace.
            with keras.StatelessScope():
                return ops.sum(fn(t))

        return jax.jit(jax.grad(loss))(jax.numpy.asarray(x))
    import torch

    x = torch.tensor(x, requires_grad=True)
    ops.sum(fn(x)).backward()
    return x.grad


def free_ports(count):
    """`count` TCP ports free on 127.0.0.1 now, for local tf.distribute workers."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def exited_pid():
    """The PID of a process that has ended (what a killed writer leaves in its temporaries' names)."""
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(process.stdout)
