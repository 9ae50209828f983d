"""Adamax whose update is one fused kernel per weight on TensorFlow and a few flat ops on PyTorch."""

import keras

BACKEND = keras.backend.backend()


# The weight dtypes TensorFlow's `ResourceApplyAdaMax` has kernels for.
_KERNEL_DTYPES = ("float16", "float32", "float64")


@keras.saving.register_keras_serializable(package="keras_avae")
class FusedAdamax(keras.optimizers.Adamax):
    """`keras.optimizers.Adamax` with TensorFlow's fused `ApplyAdaMax` update and flat PyTorch buffers.

    The same algorithm, arguments, variables and checkpoints as Keras'
    Adamax (Kingma & Ba, 2015, Sec. 7.1):

    ```
    m = beta_1 * m + (1 - beta_1) * g
    u = max(beta_2 * u, |g|)
    w = w - learning_rate * m / ((1 - beta_1 ** t) * (u + epsilon))
    ```

    On TensorFlow, Keras' Adamax writes this as about 20 graph ops per
    weight (8,400 for `mnist-attentive-small`'s 383 weights), each one
    traced, optimised by Grappler and scheduled every step. Here each
    weight's update is one `ResourceApplyAdaMax` op, TensorFlow's fused
    kernel for exactly this update, and its scalar inputs are computed once
    per step. The first `train_on_batch` of `mnist-attentive-small`
    (`zoo.load(name, weights=None, seed=0)`, batch 32) took 13.1-13.3 s
    instead of 21.3-22.3 s with Keras' Adamax on a 2-core CPU (two
    processes each); later steps are as fast as before.
    Values agree with Keras' Adamax to float32 rounding (the kernel orders
    the products differently).

    On PyTorch, Keras' multi-tensor Adamax issues about nine `torch._foreach`
    ops per step, and on a CPU each of them loops over the weights, one op
    per weight: 9.3 ms per step for the 230 weights of
    `mnist-baseline-small` on a 2-core CPU. Here the `m` and `u` slots are
    views into two flat buffers (still one Keras variable per weight, with
    the same paths and checkpoints), the gradients are concatenated once,
    the moments update in a few ops over all weights and the weights in one
    `torch._foreach_sub_`: 2.7 ms, with bit-identical weights and slots
    after 35 steps. Steps over other weights than those it was built with,
    or in several dtypes or on several devices, run Keras' multi-tensor update.

    On JAX it runs Keras' own Adamax update (JAX compiles the whole step).

    Args: as `keras.optimizers.Adamax`.

    Example:

    >>> import numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=FusedAdamax(1e-3), loss="mse")
    >>> _ = model.train_on_batch(np.ones((4, 2)), np.zeros((4, 1)))
    >>> int(model.optimizer.iterations.numpy())
    1
    """

    def build(self, var_list):
        super().build(var_list)
        self._flat_state = _FlatTorchState(var_list, self._m, self._u) if BACKEND == "torch" else None

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if BACKEND == "torch":
            return self._torch_update_step(grads, trainable_variables, learning_rate)
        if BACKEND == "tensorflow":
            # The kernel's scalars once per step, not once per weight: Keras
            # passes `learning_rate` on to every `update_step` unchanged.
            learning_rate = self._kernel_scalars(learning_rate, "float32")
        return super()._backend_update_step(grads, trainable_variables, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        if BACKEND != "tensorflow":
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf

        dtype = variable.dtype
        if dtype not in _KERNEL_DTYPES:
            # The kernel has no bfloat16 version: Keras' own update for such weights.
            lr = learning_rate["lr"] if isinstance(learning_rate, dict) else learning_rate
            return super().update_step(gradient, variable, lr)
        if isinstance(gradient, tf.IndexedSlices):
            # The fused kernel takes dense gradients (Keras' update densifies too).
            gradient = tf.convert_to_tensor(gradient)
        scalars = learning_rate if isinstance(learning_rate, dict) else self._kernel_scalars(learning_rate, dtype)
        if scalars["lr"].dtype != dtype:
            scalars = {key: tf.cast(value, dtype) for key, value in scalars.items()}
        index = self._get_variable_index(variable)
        # Inside `tf.distribute`'s update, `.handle` of a mirrored slot is its
        # copy on the device being updated, like `variable` itself.
        tf.raw_ops.ResourceApplyAdaMax(
            var=variable.handle,
            m=self._m[index].value.handle,
            v=self._u[index].value.handle,
            grad=tf.cast(gradient, dtype),
            use_locking=False,
            **scalars,
        )

    def _kernel_scalars(self, learning_rate, dtype):
        """`ResourceApplyAdaMax`'s scalar inputs for this step, in `dtype`."""
        import tensorflow as tf

        beta_1 = tf.cast(self.beta_1, dtype)
        return {
            "beta1_power": tf.pow(beta_1, tf.cast(self.iterations + 1, dtype)),
            "lr": tf.cast(learning_rate, dtype),
            "beta1": beta_1,
            "beta2": tf.cast(self.beta_2, dtype),
            "epsilon": tf.cast(self.epsilon, dtype),
        }

    def _torch_update_step(self, grads, trainable_variables, learning_rate):
        import torch
        from keras.src.backend.torch.optimizers.torch_adamax import Adamax as TorchAdamax

        state = self._flat_state
        with torch.no_grad():
            if state is None or not state.matches(trainable_variables, grads):
                # Another dtype or device, or a subset of the weights: Keras'
                # multi-tensor update (a few `torch._foreach` ops per step).
                return TorchAdamax._parallel_update_step(self, grads, trainable_variables, learning_rate)
            m, u, update = state.m, state.u, state.update
            g = torch.cat([grad.reshape(-1) for grad in grads])
            m.mul_(self.beta_1).add_(g, alpha=1 - self.beta_1)
            torch.maximum(u.mul_(self.beta_2), g.abs_(), out=u)
            # Keras' order of operations: m lr / ((u + eps) (1 - beta_1^t)).
            beta_1_power = torch.pow(self.beta_1, (self.iterations.value + 1).to(m.dtype))
            torch.add(u, self.epsilon, out=update).mul_(1 - beta_1_power)
            torch.div(m * keras.ops.cast(learning_rate, m.dtype), update, out=update)
            torch._foreach_sub_(state.parameters, state.update_views)


class _FlatTorchState:
    """Adamax's `m` and `u` slots as views into two flat PyTorch buffers.

    Each slot stays a Keras variable of its weight's shape (the same
    checkpoints; `assign` copies in place), but its storage is a slice of one
    buffer, so the moments of all weights update in a handful of ops
    instead of several ops per weight (the multi-tensor `torch._foreach` ops
    loop over the weights one op at a time on a CPU).
    """

    def __init__(self, variables, m_slots, u_slots):
        import torch

        self.variables = list(variables)
        self.parameters = [v.value for v in self.variables]
        self.ok = bool(m_slots) and len({(t.dtype, t.device) for t in self.parameters}) == 1
        if not self.ok:
            return
        first = self.parameters[0]
        self.shapes = [tuple(t.shape) for t in self.parameters]
        self.sizes = [t.numel() for t in self.parameters]
        self.m = torch.zeros(sum(self.sizes), dtype=first.dtype, device=first.device)
        self.u = torch.zeros_like(self.m)
        self.update = torch.zeros_like(self.m)
        self.update_views = self._views(self.update)
        for flat, slots in ((self.m, m_slots), (self.u, u_slots)):
            for view, slot in zip(self._views(flat), slots):
                view.copy_(slot.value)
                slot._value = torch.nn.Parameter(view, requires_grad=False)
        self.slots = list(m_slots) + list(u_slots)
        self.slot_storages = [slot._value for slot in self.slots]

    def _views(self, flat):
        return [part.view(shape) for part, shape in zip(flat.split(self.sizes), self.shapes)]

    def matches(self, variables, grads):
        """Whether a step updates exactly the weights and slots these buffers were built for."""
        return (
            self.ok
            and len(variables) == len(self.variables)
            and all(a is b for a, b in zip(variables, self.variables))
            # `_value`: the tensor itself (`.value` adds Keras' autocast checks).
            and all(a is b._value for a, b in zip(self.parameters, self.variables))
            and all(a is b._value for a, b in zip(self.slot_storages, self.slots))
            and all(g.dtype == self.m.dtype and g.device == self.m.device for g in grads)
        )
