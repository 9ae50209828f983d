"""Adamax whose TensorFlow update is one fused kernel per weight."""

import keras

BACKEND = keras.backend.backend()


@keras.saving.register_keras_serializable(package="keras_avae")
class FusedAdamax(keras.optimizers.Adamax):
    """`keras.optimizers.Adamax` with TensorFlow's fused `ApplyAdaMax` update.

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

    On JAX and PyTorch it runs Keras' own Adamax update (JAX compiles the
    whole step anyway). On PyTorch prefer `keras.optimizers.Adamax`, which
    Keras swaps for its multi-tensor (`torch._foreach`) version; subclasses
    such as this one do not get that swap. `make_optimizer` picks for you.

    Args: as `keras.optimizers.Adamax`.

    Example:

    >>> import numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=FusedAdamax(1e-3), loss="mse")
    >>> _ = model.train_on_batch(np.ones((4, 2)), np.zeros((4, 1)))
    >>> int(model.optimizer.iterations.numpy())
    1
    """

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if BACKEND == "tensorflow":
            # The kernel's scalars once per step, not once per weight: Keras
            # passes `learning_rate` on to every `update_step` unchanged.
            learning_rate = self._kernel_scalars(learning_rate, "float32")
        return super()._backend_update_step(grads, trainable_variables, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        if BACKEND != "tensorflow":
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf

        if isinstance(gradient, tf.IndexedSlices):
            # The fused kernel takes dense gradients (Keras' update densifies too).
            gradient = tf.convert_to_tensor(gradient)
        dtype = variable.dtype
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
