"""ELBOModel's fused weight regularisation against a NumPy sum over the weights."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_avae import evaluation
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from tests.models.test_hierarchical_vae import TINY
from tests.models.test_hierarchical_vae import shapes_batch
from tests.test_case import BACKEND
from tests.test_case import TestCase
from tests.test_case import to_numpy

L2 = 1e-3


def _is_l2(regularizer, factor):
    return type(regularizer) is keras.regularizers.L2 and regularizer.l2 == pytest.approx(factor)


def _penalty(model):
    return ops.sum(ops.stack(model._added_losses() + model._regularization_losses()))


def _penalty_gradients(model):
    """Gradients of the fused penalty with respect to `model.trainable_weights`."""
    weights = model.trainable_weights
    if BACKEND == "jax":
        import jax

        def f(values):
            with keras.StatelessScope(state_mapping=list(zip(weights, values))):
                return _penalty(model)

        grads = jax.grad(f)([v.value for v in weights])
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            penalty = _penalty(model)
        grads = tape.gradient(penalty, [v.value for v in weights])
    else:
        import torch

        values = [v.value for v in weights]
        grads = torch.autograd.grad(_penalty(model), values, allow_unused=True)
    return [None if g is None else to_numpy(g) for g in grads]


class TestRegularization(TestCase):
    def _model(self):
        model = HierarchicalVAE(**dict(TINY, l2=L2))
        model.build()
        return model

    def test_penalty_is_l2_times_the_sum_of_squares(self):
        model = self._model()
        regularized = [v for v in model.trainable_weights if v.regularizer is not None]
        # Every weight has the one factor: convs, norms (the attention's
        # output norms too), gates, the constant, the non-local blocks'
        # biases and gammas, the attention logit scales.
        other = [v.path for v in model.trainable_weights if not _is_l2(v.regularizer, L2)]
        assert not other and len(regularized) == len(model.trainable_weights), other
        assert any("nonlocal" in v.path and v.path.endswith("bias") for v in regularized)
        assert any(v.path.endswith("output_norm/gamma") for v in regularized)
        expected = L2 * sum(np.sum(to_numpy(v) ** 2) for v in regularized)
        self.assertAllClose(to_numpy(_penalty(model)), expected, rtol=1e-5)
        # The same sum as Keras' one loss per weight.
        keras_sum = sum(to_numpy(term) for term in model.losses)
        self.assertAllClose(to_numpy(_penalty(model)), keras_sum, rtol=1e-5)

    def test_penalty_gradient_is_two_l2_w(self):
        model = self._model()
        grads = _penalty_gradients(model)
        for variable, grad in zip(model.trainable_weights, grads):
            if variable.regularizer is None:
                assert grad is None or not np.any(grad), variable.path
            else:
                self.assertAllClose(grad, 2 * L2 * to_numpy(variable), atol=1e-9, rtol=1e-5, msg=variable.path)

    def test_compute_loss_adds_the_penalty_once(self):
        model = self._model()
        x = shapes_batch(4)
        y_pred = model(x)
        loss = to_numpy(model.compute_loss(x=x, y_pred=y_pred))
        pred = to_numpy(y_pred)
        expected = pred["nll"].mean() + pred["kl"].mean() + sum(to_numpy(term) for term in model.losses)
        self.assertAllClose(loss, expected, rtol=1e-5)

    def test_other_regularizers_and_added_losses_still_count(self):
        model = self._model()
        model.top_constant.regularizer = keras.regularizers.L1(0.5)
        model.add_loss(ops.convert_to_tensor(3.0))
        expected = sum(to_numpy(term) for term in model.losses)
        self.assertAllClose(to_numpy(_penalty(model)), expected, rtol=1e-5)


class TestTrainFunction(TestCase):
    def test_optimizer_is_built_before_the_first_step_is_traced(self):
        model = HierarchicalVAE(**TINY)
        model.build()
        model.compile(optimizer=keras.optimizers.Adamax(1e-3))
        traces = []
        train_step = model.train_step

        def counted_train_step(*args):  # JAX passes its state first
            traces.append(args)  # once per trace (TF, JAX), once per step (torch)
            return train_step(*args)

        model.train_step = counted_train_step
        x = shapes_batch(4)
        model.train_on_batch(x)
        assert model.optimizer.built
        # Variables created inside the first trace make tf.function trace twice.
        assert len(traces) == 1
        before = [to_numpy(v) for v in model.trainable_variables]
        model.train_on_batch(x)
        assert any(not np.array_equal(a, to_numpy(v)) for a, v in zip(before, model.trainable_variables))


def test_metrics_weigh_each_image_alike_whatever_the_batches():
    # 8 images in batches of 3, 3 and 2. Keras' `loss` tracker weighs each
    # batch mean by its size; with no penalty and KL weight 1 the loss is the
    # negative ELBO, so the two means agree only if `nelbo` counts images too.
    model = HierarchicalVAE(**dict(TINY, l2=0.0, seed=3))
    model.compile(optimizer="adam", jit_compile=False)
    x = (np.random.default_rng(0).random((8, *TINY["image_shape"])) > 0.5).astype("float32")
    x[-1] = 1.0  # an image unlike the others, so the last batch's mean stands out
    logs = model.evaluate(x, batch_size=3, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["nelbo"], logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs["reconstruction"] + logs["kl"], logs["nelbo"], rtol=1e-5)
    layer_kls = [logs[f"kl_{i}"] for i in range(len(model.layer_kl_trackers))]
    np.testing.assert_allclose(sum(layer_kls), logs["kl"], rtol=1e-4)


def test_sample_weight_weighs_loss_and_metrics_per_image():
    # `sample_weight` was ignored: every weighting gave the same loss.
    model = HierarchicalVAE(**dict(TINY, l2=0.0, seed=3))
    model.build()  # building draws once: before the reseeds
    model.compile(optimizer="adam", jit_compile=False)
    x = (np.random.default_rng(0).random((4, *TINY["image_shape"])) > 0.5).astype("float32")
    x[-1] = 1.0

    def scored(weights):
        evaluation._reseed(model, 3, 0)  # the same draws for every weighting
        return model.evaluate(x, x, sample_weight=weights, batch_size=4, verbose=0, return_dict=True)

    plain = scored(None)
    nelbo = [scored(np.eye(4, dtype="float32")[i])["nelbo"] for i in range(4)]
    # One image weighted alone: the metric is that image's NELBO; their mean is the unweighted one.
    np.testing.assert_allclose(np.mean(nelbo), plain["nelbo"], rtol=1e-5)
    assert np.ptp(nelbo) > 1.0
    # The loss is Keras' reduction, mean(w * nelbo): a quarter of the image's NELBO here.
    np.testing.assert_allclose(scored(np.eye(4, dtype="float32")[0])["loss"], nelbo[0] / 4, rtol=1e-5)
    np.testing.assert_allclose(scored(np.zeros(4, "float32"))["loss"], 0.0, atol=1e-6)
    with pytest.raises(ValueError, match=r"one weight per image.*Received: sample_weight with shape \(4, 2\)"):
        scored(np.ones((4, 2), "float32"))
    # Without `y` Keras would drop the weights unseen.
    pattern = r"`sample_weight` needs a `y`.*fit\(x, x, sample_weight=w\).*Received: y=None"
    with pytest.raises(ValueError, match=pattern):
        model.fit(x, sample_weight=np.ones(4, "float32"), verbose=0)
    with pytest.raises(ValueError, match=pattern):  # `evaluate(x, y, batch_size, verbose, sample_weight)`
        model.evaluate(x, None, 4, 0, np.ones(4, "float32"))


def test_fit_evaluate_and_predict_check_array_images():
    # Before: 0-255 pixels and [-1, 1] pixels gave a finite, meaningless
    # NELBO, and 28x28 images failed inside the gradient computation.
    model = HierarchicalVAE(**dict(TINY, seed=3))
    model.compile(optimizer="adam", jit_compile=False)
    x = (np.random.default_rng(0).random((4, *TINY["image_shape"])) > 0.5).astype("float32")
    calls = {
        "fit": lambda bad: model.fit(bad, epochs=1, verbose=0),
        "evaluate": lambda bad: model.evaluate(bad, verbose=0),
        "predict": lambda bad: model.predict(bad, verbose=0),
        "fit(validation_data)": lambda bad: model.fit(x, validation_data=(bad, None), epochs=1, verbose=0),
    }
    for method, call in calls.items():
        name = "validation_data" if "validation" in method else "x"
        for bad, message in (
            (x * 255, rf"pixel values of `{name}` in \[0\.0, 1\.0\].*values in \[0\.0, 255\.0\]"),
            (2 * x - 1, rf"pixel values of `{name}` in \[0\.0, 1\.0\].*values in \[-1\.0, 1\.0\]"),
            (x[:, 2:-2, 2:-2], rf"Expected `{name}` of shape \(batch, 8, 8, 1\).*\(4, 4, 4, 1\)"),
            (x.astype("complex64"), rf"`{name}` must be a numeric array.*complex64"),
        ):
            with pytest.raises(ValueError, match=message):
                call(bad)
    # A NaN pixel passes (the loss shows NaN; NonFiniteGuard skips its step),
    # and grey levels are in range.
    with_nan = x.copy()
    with_nan[0, 0, 0, 0] = np.nan
    assert np.isnan(model.evaluate(with_nan, verbose=0, return_dict=True)["nelbo"])
    assert np.isfinite(model.evaluate(x * 0.5, verbose=0, return_dict=True)["nelbo"])


def test_fit_evaluate_and_predict_check_tf_data_datasets(monkeypatch):
    # Before: a dataset of 0-255 pixels gave a finite NELBO of about 15
    # million nats here, and 4x4 images an error from inside the posterior.
    import tensorflow as tf

    # Under a `*args, **kwargs` wrapper of Keras' fit, as the throughput
    # benchmark's timer is (fit once passed its arguments on as `args=...`).
    keras_fit = keras.Model.fit
    monkeypatch.setattr(keras.Model, "fit", lambda self, *args, **kwargs: keras_fit(self, *args, **kwargs))

    model = HierarchicalVAE(**dict(TINY, seed=3))
    model.compile(optimizer="adam")  # one traced step per loop on JAX: 4x faster to test than eager
    x = (np.random.default_rng(0).random((4, *TINY["image_shape"])) > 0.5).astype("float32")

    def batches(images, pairs=False):
        dataset = tf.data.Dataset.from_tensor_slices(images).batch(2)
        return dataset.map(lambda batch: (batch, batch)) if pairs else dataset

    calls = {
        "fit": lambda data: model.fit(data, epochs=1, verbose=0),
        "evaluate": lambda data: model.evaluate(data, verbose=0),
        "predict": lambda data: model.predict(data, verbose=0),
        "fit(validation_data)": lambda data: model.fit(batches(x), validation_data=data, epochs=1, verbose=0),
    }
    for method, call in calls.items():
        name = "validation_data" if "validation" in method else "x"
        # The element spec is checked before any step runs ...
        with pytest.raises(ValueError, match=rf"`{name}` to hold batches of shape \(batch, 8, 8, 1\).*\(None, 4, 4, 1\)"):
            call(batches(x[:, 2:-2, 2:-2]))
        with pytest.raises(ValueError, match=rf"`{name}` must be a dataset of numeric images.*complex64"):
            call(batches(x.astype("complex64")))
        # ... and the pixels batch by batch as they are read: the second
        # batch is refused after a first step ran on the first.
        second_batch_bad = batches(np.concatenate([x[:2], x[2:] * 255]))
        with pytest.raises(ValueError, match=rf"pixel values of `{name}` in \[0\.0, 1\.0\]\. Received: a batch of {name} .* \[0, 255\]$"):
            call(second_batch_bad)
    # The images are an element's first component.
    with pytest.raises(ValueError, match=r"pixel values of `x`.*\[-1, 1\]$"):
        model.evaluate(batches(2 * x - 1, pairs=True), verbose=0)
    # A refused batch leaves a usable model: on JAX, Keras' evaluate and
    # fit left every variable detached (None) after an error in their first step.
    weights = [np.array(w) for w in model.get_weights()]
    for call in (model.evaluate, model.fit):
        with pytest.raises(ValueError, match="pixel values"):
            call(batches(x * 255), verbose=0)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    assert np.isfinite(model.evaluate(batches(x), verbose=0, return_dict=True)["nelbo"])
    # NaN pixels pass, as for arrays (NonFiniteGuard skips their steps); grey levels are in range.
    with_nan = x.copy()
    with_nan[0, 0, 0, 0] = np.nan
    assert np.isnan(model.evaluate(batches(with_nan), verbose=0, return_dict=True)["nelbo"])
    assert np.isfinite(model.evaluate(batches(x * 0.5, pairs=True), verbose=0, return_dict=True)["nelbo"])


@pytest.mark.skipif(BACKEND == "torch", reason="jit_compile=True is torch.compile there, not a traced-step XLA")
def test_an_unbuilt_model_trains_with_jit_compile():
    # TensorFlow built an unbuilt model inside the first traced step, which
    # XLA refused ("failed to lift variable creations"); the model was then unusable.
    # Two layers and no non-local blocks: any weight shows it, and XLA
    # compiles this step in half the time of TINY's.
    model = HierarchicalVAE(**dict(TINY, num_layers=2, nonlocal_blocks=(), seed=3))
    model.compile(optimizer="adam", jit_compile=True)
    x = (np.random.default_rng(0).random((4, *TINY["image_shape"])) > 0.5).astype("float32")
    history = model.fit(x, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert np.isfinite(model.evaluate(x, batch_size=2, verbose=0, return_dict=True)["nelbo"])


def test_load_weights_builds_an_unbuilt_model(tmp_path):
    source = HierarchicalVAE(**dict(TINY, seed=3))
    source.build()
    path = str(tmp_path / "tiny.weights.h5")
    source.save_weights(path)
    target = HierarchicalVAE(**dict(TINY, seed=3))  # Keras asked to call build() first
    target.load_weights(path)
    for a, b in zip(source.weights, target.weights):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_logged_nelbo_is_unweighted_and_bits_per_dim_is_in_base_2():
    # Protects the metrics: `nelbo` = reconstruction + KL whatever `kl_weight` (only the loss is weighted),
    # and bits/dim = nelbo / (D ln 2) (DESIGN §5).
    model = HierarchicalVAE(**dict(TINY, l2=0.0, seed=3))
    model.build()
    model.compile(optimizer="adam", jit_compile=False)
    model.kl_weight.assign(0.25)
    x = shapes_batch(4)
    logs = model.test_on_batch(x, return_dict=True)
    assert logs["kl"] > 1.0, logs  # a KL large enough for the weight to show
    np.testing.assert_allclose(logs["nelbo"], logs["reconstruction"] + logs["kl"], rtol=1e-5)
    np.testing.assert_allclose(logs["loss"], logs["reconstruction"] + 0.25 * logs["kl"], rtol=1e-5)
    dims = 8 * 8 * 1
    assert model.num_data_dims == dims
    np.testing.assert_allclose(logs["bits_per_dim"], logs["nelbo"] / (dims * np.log(2.0)), rtol=1e-5)


def _jax_x64_enabled():
    import jax

    return jax.config.jax_enable_x64


@pytest.mark.parametrize("model_class", ["HierarchicalVAE", "DiscreteVAE"])
def test_float64_is_refused_only_where_jax_would_compute_in_float32(model_class):
    # Before, JAX truncated every array to float32 with a warning while the
    # variables still reported float64.
    from keras_avae.models.discrete_vae import DiscreteVAE

    make = {
        "HierarchicalVAE": lambda: HierarchicalVAE(**dict(TINY, dtype="float64")),
        "DiscreteVAE": lambda: DiscreteVAE(image_shape=(8, 8, 1), filters=4, hidden_units=8, dtype="float64"),
    }[model_class]
    if BACKEND == "jax" and not _jax_x64_enabled():
        with pytest.raises(ValueError, match=r"`dtype` float64 needs JAX's 64-bit mode.*Received: dtype='float64'"):
            make()
    else:
        model = make()
        assert model.compute_dtype == "float64" and model.variable_dtype == "float64"
