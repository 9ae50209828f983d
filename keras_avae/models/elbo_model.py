"""What every keras-avae VAE shares: the negative-ELBO loss and its metrics."""

import contextlib
import functools
import inspect
import math

import keras
import numpy as np
from keras import ops

from keras_avae import host_memory
from keras_avae._validation import check_images
from keras_avae.evaluation import importance_sampled_log_likelihood
from keras_avae.keras_compat import portable_compile_config
from keras_avae.models import dataset_checks
from keras_avae.models.presets import PresetMixin


class ELBOModel(PresetMixin, keras.Model):
    """Base class: `call` returns per-example `nll`, `kl` and `kl_per_layer`.

    `compute_loss` forms the training loss `mean(nll) + kl_weight * mean(kl)`
    (plus the weights' regularisation) and tracks the negative ELBO, its two
    terms, bits per dimension and the KL of every latent group (so posterior
    collapse is visible in the logs). `kl_weight` is a non-trainable variable,
    so a callback can anneal it (KL warm-up). Loss terms leave `call` as
    outputs, so `fit` works on every backend without a custom `train_step`.
    The trackers are ordinary metric attributes, so Keras lists them after
    its own `loss` tracker and resets them every epoch. `fit(x, x,
    sample_weight=w)` (one weight per image; any `y`, which the ELBO does
    not read, since Keras drops `sample_weight` when `y` is `None`) weighs
    the loss as Keras does, `mean(w * nll) + kl_weight * mean(w * kl)`, and
    the trackers' means by `w`.

    Subclasses call `_build_elbo_state(num_kl_terms)`, set `image_shape`
    and `crop`, and override `pixel_range` when their inputs are not in
    [0, 1].

    Example:

    >>> import keras_avae
    >>> model = keras_avae.zoo.load("mnist-baseline", num_layers=2,
    ...     preprocess_filters=4, decoder_filters=4)
    >>> isinstance(model, ELBOModel), model.num_data_dims  # 28x28 after the crop
    (True, 784)
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Before any variable exists: JAX would already have truncated it.
        _check_float64_is_available(self.dtype_policy)

    def _build_elbo_state(self, num_kl_terms):
        self.kl_weight = self.add_weight(
            name="kl_weight", shape=(), initializer="ones", trainable=False, dtype="float32"
        )
        self.nelbo_tracker = keras.metrics.Mean(name="nelbo")
        self.reconstruction_tracker = keras.metrics.Mean(name="reconstruction")
        self.kl_tracker = keras.metrics.Mean(name="kl")
        self.bits_per_dim_tracker = keras.metrics.Mean(name="bits_per_dim")
        self.layer_kl_trackers = [keras.metrics.Mean(name=f"kl_{i}") for i in range(num_kl_terms)]

    def build(self, input_shape=None):
        """Builds every sublayer with its real shape by running `call` once.

        On JAX the pass is traced (`compute_output_spec`, no computation):
        eager JAX compiles each new primitive it meets, so tracing the pass
        is faster than running it (what remains is mostly compiling the
        initialisers of each new weight shape). The other backends run a zero batch
        eagerly. `input_shape` is ignored: the model's `image_shape` fixes it.
        """
        if self.built:
            return
        shape = (1, *self.image_shape)
        if keras.backend.backend() == "jax":
            self.compute_output_spec(keras.KerasTensor(shape, dtype=self.input_dtype), training=False)
        else:
            self.call(ops.zeros(shape, self.input_dtype), training=False)
        self.built = True

    def fit(self, x=None, y=None, *args, **kwargs):
        bound = _arguments("fit", self, x, y, args, kwargs)
        arguments = bound.arguments
        _check_sample_weight(arguments.get("sample_weight"), y)
        arguments["x"] = self._checked_images(x, "x")
        validation = arguments.get("validation_data")
        if isinstance(validation, (tuple, list)):
            self._checked_images(validation[0], "validation_data")
        elif validation is not None:
            arguments["validation_data"] = self._checked_images(validation, "validation_data")
        with self._loop_errors():
            return super().fit(*bound.args[1:], **bound.kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        _check_sample_weight(_arguments("evaluate", self, x, y, args, kwargs).arguments.get("sample_weight"), y)
        x = self._checked_images(x, "x")
        with self._loop_errors():
            return super().evaluate(x, y, *args, **kwargs)

    def predict(self, x, *args, **kwargs):
        x = self._checked_images(x, "x")
        with self._loop_errors():
            return super().predict(x, *args, **kwargs)

    def _checked_images(self, x, name):
        """`x` after the inference methods' image checks, for `fit`, `evaluate` and `predict`.

        Without them, pixels outside the likelihood's range gave a finite,
        meaningless loss, and a wrong image shape an error from inside the
        gradient computation. Arrays and tensors are checked whole; a
        `tf.data.Dataset` comes back checking each batch as it is read
        (`dataset_checks`). Non-finite pixels pass: they give a NaN loss in
        plain view, and `NonFiniteGuard` skips their steps. Generators and
        `PyDataset`s are not read ahead.
        """
        if isinstance(x, np.ndarray) or (x is not None and ops.is_tensor(x)):
            check_images(x, self.image_shape, self.pixel_range, name=name, allow_non_finite=True)
        elif dataset_checks.is_tf_dataset(x):
            return dataset_checks.checked_image_dataset(x, self.image_shape, self.pixel_range, name=name)
        return x

    @contextlib.contextmanager
    def _loop_errors(self):
        """A failed dataset batch check as a `ValueError`; on JAX, the weights kept through any error.

        Keras' JAX loops detach the variables' values while they run and
        reattach them at the end; `evaluate` and `predict` (and `fit` on an
        error before its first step ends) skip that on an error, which left
        every variable `None`: the model was unusable ("'NoneType' object is
        not callable") after, say, a refused batch. The values held before
        the loop are restored where no step's state replaced them.
        """
        before = []
        if keras.backend.backend() == "jax":
            before = [(variable, variable.value) for variable in self._jax_loop_variables()]
        with dataset_checks.readable_pixel_errors():
            try:
                yield
            except BaseException:
                if getattr(self, "_jax_state", None):
                    self.jax_state_sync()
                    self._jax_state = None
                for variable, value in before:
                    if variable._value is None and not value.is_deleted():
                        variable.assign(value)
                raise

    def _jax_loop_variables(self):
        """The variables Keras' JAX loops detach: the model's, the optimizer's and the metrics'."""
        optimizer = getattr(self, "optimizer", None)
        optimizer_variables = optimizer.variables if optimizer is not None and optimizer.built else []
        return [*self.trainable_variables, *self.non_trainable_variables, *optimizer_variables, *self.metrics_variables]

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights`, building an unbuilt model first (its `image_shape` is known)."""
        self._build_if_needed()
        return super().load_weights(filepath, *args, **kwargs)

    def compile_from_config(self, config):
        """`keras.Model.compile_from_config` on a config saved by any backend (`portable_compile_config`)."""
        super().compile_from_config(portable_compile_config(config))

    def make_train_function(self, force=False):
        """Keras' training function, with the optimizer built before it is traced.

        Without a `tf.distribute` strategy, Keras' TensorFlow trainer builds
        the optimizer inside the first traced step; creating its variables
        there makes `tf.function` trace the whole step a second time, and
        each of its variables (two per weight for Adamax) is created through
        the tracing machinery. Built here, eagerly, the first step traces once: about
        half the first-step time of `mnist-attentive-small`
        (`benchmarks/train_throughput.py`). The other backends build it
        before tracing anyway.

        On PyTorch without CUDA, the first call also keeps freed host
        memory in the process (`keras_avae.host_memory`): eager PyTorch
        frees and re-allocates every activation each step, and glibc gave
        those pages back to the system and faulted them in again (an
        `mnist-baseline-small` step on the 2-core CPU ran 1-5.5% faster
        with the setting in three paired processes). Not in `compile`:
        Keras' `load_model` skips a model's overridden `compile`.
        """
        if getattr(self, "train_function", None) is None or force:
            _keep_freed_host_memory_on_a_cpu()
        self._build_if_needed()
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            with self._variable_scope():
                optimizer.build(self.trainable_variables)
        return super().make_train_function(force=force)

    def make_test_function(self, force=False):
        self._build_if_needed()
        return super().make_test_function(force=force)

    def make_predict_function(self, force=False):
        self._build_if_needed()
        return super().make_predict_function(force=force)

    def _build_if_needed(self):
        """Builds an unbuilt model eagerly (its `image_shape` is known).

        Left to Keras, TensorFlow creates the weights inside the first traced
        step, which XLA refuses (`jit_compile=True`, the default "auto" on a
        GPU): "We failed to lift variable creations out of this tf.function",
        and the model stayed unusable.
        """
        if not self.built:
            with self._variable_scope():
                self.build()

    def _variable_scope(self):
        """TensorFlow: the strategy's scope (variables mirrored like the model's); else nothing."""
        if keras.backend.backend() == "tensorflow":
            return self.distribute_strategy.scope()
        return contextlib.nullcontext()

    @property
    def input_dtype(self):
        """float32 under any dtype policy: the likelihood scores the exact pixel values.

        Keras casts a model's inputs to the compute dtype; bfloat16 cannot
        hold the 256 levels of an 8-bit image (and float16 rounds some), so
        a mixed-precision model would score other images than it was given.
        The encoders cast their own copy to the compute dtype.
        """
        return "float32"

    @property
    def num_data_dims(self):
        """Dimensions D of the modelled image (for bits/dim)."""
        h, w, c = self.image_shape
        return (h - 2 * self.crop) * (w - 2 * self.crop) * c

    @property
    def pixel_range(self):
        """`(low, high)` of the pixel values the model takes."""
        return (0.0, 1.0)

    @property
    def pixel_levels(self):
        """How many pixel values, spread evenly over `pixel_range`, the likelihood scores (2: binary)."""
        return 2

    def _check_images(self, x, name="x", single_image=False):
        """Eager check of user images (shape, empty batch, NaN/inf, pixel range); a float32 tensor of them.

        Runs on a NumPy copy of the concrete values, before any compiled
        function, and raises `ValueError` naming `name` (see
        `keras_avae._validation.check_images`; `single_image`: `x` is one
        image, returned as a batch of one). bfloat16 images are taken as
        their float32 values.
        """
        checked = check_images(x, self.image_shape, self.pixel_range, name=name, single_image=single_image)
        return ops.convert_to_tensor(checked)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        weights = _per_image_weights(sample_weight)
        per_image_nll, per_image_kl = y_pred["nll"], y_pred["kl"]
        if weights is not None:
            # Keras' loss reduction: the mean over the batch of weight x loss.
            per_image_nll, per_image_kl = weights * per_image_nll, weights * per_image_kl
        nll = ops.mean(per_image_nll)
        kl = ops.mean(per_image_kl)
        loss = nll + ops.cast(self.kl_weight, "float32") * kl
        extra = self._added_losses() + self._regularization_losses()
        if extra:
            loss = loss + ops.sum(ops.stack([ops.cast(term, "float32") for term in extra]))
        # The trackers take per-image values: a smaller last batch counts
        # for its images, not as much as a full batch (Keras' `loss` tracker
        # weighs batch means by the batch size likewise).
        # With `sample_weight`, weighted means (Keras' metrics' rule).
        nelbo = y_pred["nll"] + y_pred["kl"]
        self.nelbo_tracker.update_state(nelbo, sample_weight=weights)
        self.reconstruction_tracker.update_state(y_pred["nll"], sample_weight=weights)
        self.kl_tracker.update_state(y_pred["kl"], sample_weight=weights)
        self.bits_per_dim_tracker.update_state(nelbo / (self.num_data_dims * math.log(2.0)), sample_weight=weights)
        for i, tracker in enumerate(self.layer_kl_trackers):
            tracker.update_state(y_pred["kl_per_layer"][:, i], sample_weight=weights)
        return _scale_loss_for_distribution(loss)

    def _added_losses(self):
        """The `add_loss` terms of the model and its layers (`self.losses` less the regularizers)."""
        losses = self._get_own_losses()
        for layer in self._flatten_layers(include_self=False):
            losses.extend(layer._get_own_losses())
        return losses

    def _regularization_losses(self):
        """The weight regularizers' penalties, the same sum as Keras' but in fewer ops.

        Keras adds one `l2 * sum(w ** 2)` per weight (303 for
        `mnist-attentive-small`, each several ops, and again in the backward
        pass). The weights that share an `L2` factor get one penalty here,
        `l2 * sum_w sum(w ** 2)`: the same value and gradients. Other
        regularizers are called as Keras calls them.
        """
        l2_groups, losses = {}, []
        for variable in self.trainable_weights:
            regularizer = variable.regularizer
            if regularizer is None:
                continue
            # `.value`, as Keras: the traced value inside a stateless (JAX) scope.
            value = variable.value
            if type(regularizer) is keras.regularizers.L2:
                # No cast when there is nothing to cast: casts cost on torch.
                if variable.dtype != "float32":
                    value = ops.cast(value, "float32")
                l2_groups.setdefault(float(regularizer.l2), []).append(value)
            else:
                losses.append(regularizer(value))
        for factor, values in l2_groups.items():
            losses.append(factor * _sum_of_squares(values))
        return losses

    def log_likelihood(self, x, num_samples=100, chunk_size=None):
        """Importance-sampled marginal log-likelihood `log p(x)` in nats, `(B,)`.

        The deterministic encoder pass runs once per pass of samples; see
        `keras_avae.evaluation.importance_sampled_log_likelihood` (which
        also splits batches too large for the free memory).

        Args:
            x: images `(B, H, W, C)` in the model's pixel range; NaN or
                infinite values, an empty batch, a wrong shape, values out
                of range or between the likelihood's `pixel_levels` (grey
                pixels for a Bernoulli model) raise `ValueError`.
            num_samples: K, a positive int.
            chunk_size: `None` or a positive int, the most samples drawn
                per pass.

        Returns:
            NumPy float64 array `(B,)`, like every inference method
            (`sample`, `reconstruct`, `encode`) returns NumPy arrays.
        """
        # It checks `x` (the same message) before any pass runs.
        return importance_sampled_log_likelihood(self, x, num_samples=num_samples, chunk_size=chunk_size)


# Keras' signatures, read at import: a wrapper patched over `keras.Model.fit`
# later (the throughput benchmark's timer) takes `*args, **kwargs`.
_SIGNATURES = {name: inspect.signature(getattr(keras.Model, name)) for name in ("fit", "evaluate")}


def _arguments(method, model, x, y, args, kwargs):
    """A call of `keras.Model.<method>` bound to its parameter names, those given by position too."""
    return _SIGNATURES[method].bind_partial(model, x, y, *args, **kwargs)


def _check_sample_weight(sample_weight, y):
    """Refuses `sample_weight` that Keras would drop (no `y`) or that is not one weight per image."""
    if sample_weight is None:
        return
    if y is None:
        raise ValueError(
            "`sample_weight` needs a `y` to reach the loss (Keras drops it when `y` is None); the ELBO does not "
            "read `y`, so pass the images again: `fit(x, x, sample_weight=w)`. Received: y=None"
        )
    shape = np.shape(sample_weight)
    if len(shape) > 1 and any(size != 1 for size in shape[1:]):
        raise ValueError(
            "`sample_weight` must hold one weight per image, shape (B,) or (B, 1): the ELBO is a sum over the "
            f"pixels and latents of each image. Received: sample_weight with shape {shape}"
        )


def _per_image_weights(sample_weight):
    """`sample_weight` as float32 `(B,)` (checked by `fit`/`evaluate`), or `None`."""
    if sample_weight is None:
        return None
    return ops.reshape(ops.cast(sample_weight, "float32"), (-1,))


def _sum_of_squares(values):
    """`sum_w sum(w ** 2)` over float32 tensors of any shapes.

    On PyTorch, as one autograd node (`_torch_sum_of_squares`): a few ops
    instead of two per weight forward and more backward, where each op
    costs Python and dispatch time (TensorFlow and JAX graphs gain nothing).
    """
    if keras.backend.backend() == "torch":
        return _torch_sum_of_squares()(*values)
    return ops.sum(ops.stack([ops.sum(value * value) for value in values]))


def _keep_freed_host_memory_on_a_cpu():
    """`keep_freed_host_memory` on PyTorch without CUDA; nothing elsewhere."""
    if keras.backend.backend() != "torch":
        return
    import torch

    if not torch.cuda.is_available():
        host_memory.keep_freed_host_memory()


def _scale_loss_for_distribution(loss):
    """Divides the per-replica loss by the replicas of a `tf.distribute` strategy.

    Each replica's gradients are summed across replicas, so, as Keras' own
    compiled losses do, the loss of a replica's share of the global batch is
    scaled by `1 / num_replicas_in_sync` (Keras' loss tracker undoes it for
    the logs). The identity without a strategy and on the other backends.
    """
    if keras.backend.backend() != "tensorflow":
        return loss
    import tensorflow as tf

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        loss = loss * (1.0 / replicas)
    return loss


@functools.cache
def _torch_sum_of_squares():
    """`sum_w sum(w ** 2)` on torch as one autograd node over all the weights.

    Forward one multi-tensor norm, backward one multi-tensor product
    `2 g w`: no concatenation of the weights, whose gradient would be
    split back into a view per weight (two autograd nodes each).
    """
    import torch

    class SumOfSquares(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *values):
            ctx.save_for_backward(*values)
            norms = torch._foreach_norm(values)
            return torch.stack(norms).square().sum()

        @staticmethod
        def backward(ctx, grad):
            return tuple(torch._foreach_mul(ctx.saved_tensors, 2.0 * grad))

    return SumOfSquares.apply


def _check_float64_is_available(policy):
    """Raises if the model asks for float64 on JAX without its 64-bit mode.

    JAX then truncates every float64 array to float32 with a warning, while
    the model's variables still report float64: a float64 model in name only.
    """
    if keras.backend.backend() != "jax" or "float64" not in (policy.compute_dtype, policy.variable_dtype):
        return
    import jax

    if not jax.config.jax_enable_x64:
        raise ValueError(
            "`dtype` float64 needs JAX's 64-bit mode, which is off: JAX would compute in float32. Set "
            "`JAX_ENABLE_X64=1` (or `jax.config.update('jax_enable_x64', True)`) before creating the model, or "
            f"use float32. Received: dtype={policy.name!r}"
        )

