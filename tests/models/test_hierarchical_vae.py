"""The hierarchical attentive VAE: ELBO bookkeeping, attention gates,
training, importance sampling and saving, on tiny configs."""

import json
import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_avae._validation import check_images
from keras_avae.distributions.gaussian import DiagonalGaussian
from keras_avae.evaluation import _compiled_log_weights
from keras_avae.layers.depthwise_attend import DepthwiseAttend
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from tests.test_case import TestCase
from tests.test_case import to_numpy

TINY = dict(
    image_shape=(8, 8, 1),
    num_layers=3,
    latent_channels=2,
    preprocess_filters=4,
    decoder_filters=4,
    preprocess_cells=1,
    postprocess_cells=1,
    cells_per_layer=1,
    generative_attention_dim=2,
    inference_attention_dim=2,
    nonlocal_blocks=("encoder", "decoder", "merge"),
    nonlocal_key_dim=2,
    likelihood="bernoulli",
    seed=7,
)


def shapes_batch(n=16, size=8, seed=0):
    """Binary images with structure: a random filled rectangle and a bar each."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, size, size, 1), "float32")
    for i in range(n):
        r0, c0 = rng.integers(0, size // 2, 2)
        h, w = rng.integers(2, size // 2 + 1, 2)
        x[i, r0 : r0 + h, c0 : c0 + w] = 1.0
        x[i, rng.integers(0, size), :] = 1.0
    return x


def as_bfloat16(x, library):
    """A bfloat16 copy of the NumPy array `x` as `library` makes it (skips where it is not installed)."""
    if library == "numpy":
        return x.astype(ml_dtypes.bfloat16)
    if library == "tensorflow":
        import tensorflow as tf

        return tf.cast(x, tf.bfloat16)
    if library == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return jnp.asarray(x, jnp.bfloat16)
    torch = pytest.importorskip("torch")
    return torch.tensor(x).to(torch.bfloat16)


def reset_seed(model, seed=7):
    model.seed_generator.state.assign(np.array([seed, 0]))


def run(model, x, training=False):
    model.build()  # building draws random numbers: do it before seeding
    reset_seed(model)
    return to_numpy(model(x, training=training))


class TestHierarchicalVAE(TestCase):
    def test_outputs_are_per_example_and_consistent(self):
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(4)
        out = run(model, x)
        assert out["nll"].shape == (4,) and out["kl"].shape == (4,)
        assert out["kl_per_layer"].shape == (4, TINY["num_layers"])
        np.testing.assert_allclose(out["kl_per_layer"].sum(-1), out["kl"], rtol=1e-5)
        assert np.all(out["kl_per_layer"] >= -1e-4)
        # The reconstruction term of binary images is positive and finite.
        assert np.all(out["nll"] > 0) and np.all(np.isfinite(out["nll"]))

    def test_compute_loss_is_nll_plus_weighted_kl(self):
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(4)
        reset_seed(model)
        y_pred = model(x)
        model.kl_weight.assign(0.25)
        loss = float(to_numpy(model.compute_loss(x=x, y_pred=y_pred)))
        pred = to_numpy(y_pred)
        regularization = float(sum(to_numpy(l) for l in model.losses))
        expected = pred["nll"].mean() + 0.25 * pred["kl"].mean() + regularization
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        assert regularization > 0  # L2 on every weight

    def test_zero_gates_make_attention_weights_irrelevant(self):
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(4)
        before = run(model, x)
        rng = np.random.default_rng(1)
        attention_layers = [
            layer
            for layer in model._flatten_layers()
            if isinstance(layer, (DepthwiseAttend, NonLocalBlock))
        ]
        assert attention_layers
        perturbed = 0
        for layer in attention_layers:
            for w in layer.trainable_weights:
                if w.path.endswith("gamma") and isinstance(layer, NonLocalBlock):
                    continue  # the gate itself stays zero
                w.assign(rng.normal(size=w.shape).astype("float32"))
                perturbed += 1
        assert perturbed > 0
        after = run(model, x)
        for key in before:
            np.testing.assert_allclose(after[key], before[key], rtol=1e-5, atol=1e-5)
        # The test can fail: opening one gate does change the ELBO.
        model.prior_cells[1].gate.assign(1.0)  # layer 2
        opened = run(model, x)
        assert np.max(np.abs(opened["kl"] - before["kl"])) > 1e-3

    def test_tiny_model_overfits_a_batch(self):
        config = dict(TINY, num_layers=2, preprocess_filters=8, decoder_filters=8, latent_channels=4)
        model = HierarchicalVAE(**dict(config, nonlocal_blocks=("merge",)))
        x = shapes_batch(16)
        model.compile(optimizer=keras.optimizers.Adamax(2e-2))
        history = model.fit(x, batch_size=16, epochs=60, verbose=0)
        nelbo = history.history["nelbo"]
        assert np.isfinite(nelbo).all()
        # 64 structured binary pixels: ~50 nats at initialisation, ~26 after
        # 60 steps on every backend (measured); a broken gradient path stalls
        # near 44 (independent pixels at their mean).
        assert nelbo[-1] < nelbo[0] / 1.6, (nelbo[0], nelbo[-1])
        assert set(history.history) >= {"loss", "nelbo", "reconstruction", "kl", "bits_per_dim", "kl_0", "kl_1"}

    def test_importance_sampling_tightens_the_bound(self):
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(8)
        draws = 8
        elbos = []
        for s in range(draws):
            reset_seed(model, s)
            out = to_numpy(model(x))
            elbos.append(-(out["nll"] + out["kl"]))
        elbos = np.stack(elbos)  # (draws, images)
        runs = {
            k: np.stack([to_numpy(model.log_likelihood(x, num_samples=k, chunk_size=32)) for _ in range(n)])
            for k, n in ((1, draws), (8, 2), (64, 2))
        }
        elbo = elbos.mean()
        ll = {k: r.mean() for k, r in runs.items()}
        # K=1 is an unbiased estimate of the ELBO: the two means differ by
        # sampling noise only, bounded here by 4 standard errors of the
        # difference (per image, then over the images).
        se = np.sqrt(np.sum(elbos.var(0, ddof=1) / draws + runs[1].var(0, ddof=1) / draws)) / x.shape[0]
        assert abs(ll[1] - elbo) < 4 * se + 0.05, (ll[1], elbo, se)
        # Larger K tighten the bound.
        assert ll[8] > elbo and ll[64] > ll[8], (elbo, ll)
        # ... and converge: two independent estimates agree better as K grows.
        spread = {k: np.mean(np.abs(r[0] - r[1])) for k, r in runs.items()}
        assert spread[64] < spread[1], spread

    @pytest.mark.skipif(
        keras.backend.backend() == "torch", reason="PyTorch evaluates eagerly: there is no compiled path to compare"
    )
    def test_compiled_importance_weights_match_eager(self):
        # Evaluation compiles the top-down passes (XLA on TensorFlow, jax.jit
        # with the variables passed in on JAX).
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(4)
        model.build()
        reset_seed(model, 3)
        eager = to_numpy(model.log_weights(x, model.bottom_up(x, training=False), 64))
        reset_seed(model, 3)
        compiled_fn = _compiled_log_weights(model)
        compiled = to_numpy(compiled_fn(x, 64))
        if keras.backend.backend() == "tensorflow":
            # XLA draws other random numbers from the same seed than eager
            # TensorFlow: the two agree in distribution, per image mean
            # within 4 standard errors.
            se = np.sqrt((eager.var(1, ddof=1) + compiled.var(1, ddof=1)) / 64)
            assert np.all(np.abs(compiled.mean(1) - eager.mean(1)) < 4 * se), (compiled.mean(1), eager.mean(1), se)
        else:
            # Same seed state, same samples.
            self.assertAllClose(compiled, eager, atol=1e-3, rtol=1e-4)
        # The seed state advances, so the next call draws other samples.
        assert not np.allclose(to_numpy(compiled_fn(x, 64)), compiled)

    def test_methods(self):
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(3)
        latents = model.encode(x)
        assert [tuple(z.shape) for z in latents] == [(3, 4, 4, 2)] * 3
        recon = to_numpy(model.reconstruct(x))
        assert recon.shape == x.shape and recon.min() >= 0 and recon.max() <= 1
        samples = to_numpy(model.sample(5, mode="sample"))
        assert samples.shape == (5, 8, 8, 1) and set(np.unique(samples)) <= {0.0, 1.0}
        with pytest.raises(ValueError, match="x.shape"):
            model.reconstruct(np.zeros((2, 9, 9, 1), "float32"))
        with pytest.raises(ValueError, match="values in"):
            model.reconstruct(np.full((2, 8, 8, 1), 3.0, "float32"))
        with pytest.raises(ValueError, match="temperature"):
            model.sample(2, temperature=0.0)

    def test_inference_methods_draw_what_their_eager_passes_draw(self):
        # On JAX the methods run one `jax.jit` of each pass (`inference_passes`):
        # from the same seed state it must draw the samples the eager pass
        # draws, and leave the state where the eager pass leaves it.
        model = HierarchicalVAE(**TINY)
        model.build()
        x = shapes_batch(3)
        calls = {
            "encode": (lambda: model.encode(x, sample=True), lambda: model._encode_pass(x, True)),
            "reconstruct": (lambda: model.reconstruct(x), lambda: model._reconstruct_pass(x, "mean")),
            "sample": (lambda: model.sample(4, temperature=0.7), lambda: model._sample_pass(4, 0.7, "mean")),
        }
        for name, (method, eager) in calls.items():
            reset_seed(model, 5)
            actual, state = method(), to_numpy(model.seed_generator.state)
            reset_seed(model, 5)
            expected = to_numpy(eager())
            self.assertAllClose(actual, expected, atol=1e-5, rtol=1e-5, msg=name)
            np.testing.assert_array_equal(state, to_numpy(model.seed_generator.state), err_msg=name)

    def test_one_sampling_pass_serves_every_temperature(self, monkeypatch):
        model = HierarchicalVAE(**TINY)
        model.build()
        passes = []
        top_down = model.top_down

        def counting(*args, **kwargs):
            passes.append(kwargs.get("batch_size"))
            return top_down(*args, **kwargs)

        monkeypatch.setattr(model, "top_down", counting)
        drawn = {}
        for temperature in (0.5, 0.9, 0.5):
            reset_seed(model, 5)
            drawn[temperature] = model.sample(2, temperature=temperature)
        model.sample(3, temperature=0.9)
        # JAX traces the pass once per number of images, whatever the
        # temperature; the other backends run it eagerly every call.
        assert passes == ([2, 3] if keras.backend.backend() == "jax" else [2, 2, 2, 3]), passes
        reset_seed(model, 5)
        eager = to_numpy(top_down(batch_size=2, training=False, temperature=0.9)["decoded"])
        self.assertAllClose(drawn[0.9], to_numpy(ops.sigmoid(model.data_distribution_params(eager))), atol=1e-5)
        assert not np.allclose(drawn[0.5], drawn[0.9])

    def test_logistic_mixture_model(self):
        config = dict(TINY, image_shape=(8, 8, 3), likelihood="logistic_mixture", num_mixtures=2)
        model = HierarchicalVAE(**config)
        x = (np.round(np.random.default_rng(0).random((2, 8, 8, 3)) * 255) / 127.5 - 1).astype("float32")
        out = run(model, x)
        # Per-image NLL of 192 8-bit values is near 192 * log(256) at init.
        assert np.all(np.isfinite(out["nll"])) and np.all(out["nll"] > 0)
        sample = to_numpy(model.sample(2))
        assert sample.shape == (2, 8, 8, 3) and sample.min() >= -1 and sample.max() <= 1

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="num_layers"):
            HierarchicalVAE(**dict(TINY, num_layers=0))
        with pytest.raises(ValueError, match="nonlocal_blocks"):
            HierarchicalVAE(**dict(TINY, nonlocal_blocks=("everywhere",)))
        with pytest.raises(ValueError, match="image_shape"):
            HierarchicalVAE(**dict(TINY, image_shape=(7, 8, 1)))
        with pytest.raises(ValueError, match="likelihood"):
            HierarchicalVAE(**dict(TINY, likelihood="gaussian"))

    @pytest.mark.parametrize(
        "name, value, message",
        [
            # Each was accepted (and silently changed or used) or named another argument.
            ("preprocess_cells", -1, "non-negative int"),
            ("postprocess_cells", 1.5, "non-negative int"),
            ("image_shape", (8.9, 8, 1), "three positive ints"),
            ("image_shape", (0, 8, 1), "three positive ints"),
            ("image_shape", (8, 8, 0), "three positive ints"),
            ("image_shape", 8, "three positive ints"),
            ("generative_attention", "no", "a bool"),
            ("reference_edge_bug", 1, "a bool"),
            ("generative_attention_layer_norm", np.True_, "a bool"),  # a layer refused it as `normalize_output`
            ("bn_momentum", 10**400, r"finite number in \[0, 1\]"),  # OverflowError before
            ("bn_epsilon", -1.0, r"finite number > 0"),
            ("bn_momentum", 2.0, r"finite number in \[0, 1\]"),
            ("log_scale_noise", -1.0, "finite number >= 0"),
            ("l2", float("nan"), "finite number >= 0"),
            ("crop", True, "non-negative int smaller than half"),
            ("prior_log_scale_bounds", (1.0,), r"\(low, high\) with low < high"),
            ("nonlocal_feature_seed", 2**33, r"an integer in \[0, 2147483646\] or None"),
        ],
    )
    def test_bad_config_values_name_their_argument(self, name, value, message):
        with pytest.raises(ValueError, match=rf"`{name}` must be .*{message}.*Received: {name}="):
            HierarchicalVAE(**dict(TINY, **{name: value}))

    def test_config_takes_numpy_ints_for_the_image_shape(self):
        model = HierarchicalVAE(**dict(TINY, image_shape=np.array([8, 8, 1])))
        assert model.image_shape == (8, 8, 1) and all(type(s) is int for s in model.image_shape)

    def test_numpy_ints_make_the_model_python_ints_make(self):
        # A sweep over `np.arange` gave NumPy ints, refused before as "must be a positive int".
        sizes = ("num_layers", "latent_channels", "preprocess_filters", "cells_per_layer", "crop")
        sizes += ("preprocess_cells", "nonlocal_key_dim", "nonlocal_num_random_features")
        config = dict(TINY, crop=1, nonlocal_num_random_features=8, nonlocal_attention="performer")
        model = HierarchicalVAE(**dict(config, **{name: np.int64(config[name]) for name in sizes}))
        reference = HierarchicalVAE(**config)
        stored = model.get_config()
        assert all(type(stored[name]) is int for name in sizes)
        assert json.loads(json.dumps(stored)) == json.loads(json.dumps(dict(reference.get_config(), name=stored["name"])))
        x = shapes_batch(2)
        expected = run(reference, x)
        model.build()
        model.set_weights(reference.get_weights())
        for key, value in run(model, x).items():
            np.testing.assert_allclose(value, expected[key], rtol=1e-6)

    def test_save_and_load_round_trip(self, tmp_path):
        model = HierarchicalVAE(**TINY)
        x = shapes_batch(4)
        model.build()
        expected = run(model, x)
        path = str(tmp_path / "vae.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        assert isinstance(restored, HierarchicalVAE)
        actual = run(restored, x)
        for key in expected:
            np.testing.assert_allclose(actual[key], expected[key], rtol=1e-5, atol=1e-5)

    def test_mixed_precision_keeps_the_elbo_in_float32(self):
        model = HierarchicalVAE(**dict(TINY, dtype="mixed_bfloat16"))
        out = model(shapes_batch(2))
        for value in out.values():
            assert keras.backend.standardize_dtype(value.dtype) == "float32"
        self.assertAllFinite(out)

    def test_mixed_precision_scores_the_exact_pixel_values(self):
        # bfloat16 cannot hold the 256 levels: Keras' input cast would hand
        # the likelihood 0.984375 for the level 251/127.5 - 1 (0.96862...).
        config = dict(TINY, image_shape=(8, 8, 3), likelihood="logistic_mixture", num_mixtures=2)
        model = HierarchicalVAE(**config, dtype="mixed_bfloat16")
        x = (np.arange(192).reshape(1, 8, 8, 3) % 256 + 60) / 127.5 - 1.0
        x = x.astype("float32")
        scored = []
        original = model._log_likelihood

        def recording(params, images):
            scored.append(images)
            return original(params, images)

        model._log_likelihood = recording
        out = model(x)
        assert keras.backend.standardize_dtype(scored[-1].dtype) == "float32"
        np.testing.assert_array_equal(to_numpy(scored[-1]), x)
        self.assertAllFinite(out)
        # The inference methods return float32 arrays under the policy too (they were bfloat16).
        for images in (model.sample(2), model.reconstruct(x), model.interpolate(x, x, steps=2)):
            assert images.dtype == np.float32, images.dtype


class TestInferenceInputs(TestCase):
    """`log_likelihood`, `reconstruct`, `encode` and `sample` check what they get, eagerly."""

    @pytest.fixture(scope="class")
    def model(self):
        model = HierarchicalVAE(**TINY)
        model.build()
        return model

    @pytest.mark.parametrize("value, count", [(np.nan, 3), (np.inf, 1), (-np.inf, 2)])
    def test_non_finite_images_name_the_argument(self, model, value, count):
        x = shapes_batch(2)
        x.reshape(-1)[:count] = value  # before this check, NaN gave NaN log-likelihoods
        pattern = rf"`x` contains {count} non-finite values \(NaN or inf\), in images \[0\]\. Received: x with shape \(2, 8, 8, 1\)"
        for method in (model.log_likelihood, model.reconstruct, model.encode):
            with pytest.raises(ValueError, match=pattern):
                method(x)

    def test_empty_batch_names_the_argument(self, model):
        # Before: a TensorFlow internal error (a reduction over no elements).
        x = np.zeros((0, 8, 8, 1), "float32")
        for method in (model.log_likelihood, model.reconstruct, model.encode):
            with pytest.raises(ValueError, match=r"`x` is an empty batch.*Received: x.shape=\(0, 8, 8, 1\)"):
                method(x)

    def test_a_dataset_or_generator_of_batches_is_named_as_such(self, model):
        # Before: "`x` must be a numeric array of images. Received: x of dtype object with shape ()"
        # (NumPy's 0-d object array around the dataset), naming neither it nor what to do.
        import tensorflow as tf

        from keras_avae import inspection

        x = shapes_batch(2)
        streams = {
            "_BatchDataset": lambda: tf.data.Dataset.from_tensor_slices(x).batch(1),
            "generator": lambda: (b for b in [x]),
            "list_iterator": lambda: iter([x]),
        }
        methods = {
            "x": [model.log_likelihood, model.reconstruct, model.encode, lambda s: inspection.kl_per_layer(model, s)],
            "x_a": [lambda s: model.interpolate(s, x)],
        }
        for kind, stream in streams.items():
            for name, calls in methods.items():
                for method in calls:
                    pattern = rf"`{name}` must be one batch of images.*Received: {name} of type {kind}, a stream of batches"
                    with pytest.raises(ValueError, match=pattern):
                        method(stream())
        # A batch read from the dataset is scored as the array it holds.
        batch = next(iter(tf.data.Dataset.from_tensor_slices(x).batch(2)))
        assert model.reconstruct(batch).shape == x.shape

    def test_wrong_rank_and_dtype_name_the_argument(self, model):
        with pytest.raises(ValueError, match=r"Received: x.shape=\(8, 8, 1\)"):
            model.encode(np.zeros((8, 8, 1), "float32"))
        with pytest.raises(ValueError, match=r"`x` must be a numeric array.*dtype <U1"):
            model.reconstruct(np.full((1, 8, 8, 1), "a"))

    def test_a_float64_value_too_large_for_float32_is_out_of_range_not_non_finite(self, model):
        # Before: "`x` contains 1 non-finite values (NaN or inf), in images [1]" (the float32 copy held
        # inf for 1e300), with an overflow RuntimeWarning; `fit`'s check, which lets non-finite pixels
        # through, passed it as inf.
        x = shapes_batch(2).astype("float64")
        x[1, 0, 0, 0] = 1e300
        pattern = r"Expected pixel values of `x` in \[0\.0, 1\.0\]\. Received: x with values in \[0\.0, 1e\+300\]"
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for method in (model.log_likelihood, model.reconstruct, model.encode):
                with pytest.raises(ValueError, match=pattern):
                    method(x)
            with pytest.raises(ValueError, match=pattern):
                check_images(x, (8, 8, 1), (0.0, 1.0), allow_non_finite=True)
            x[0, 0, 0, 0] = -np.inf  # a value that is not finite is still named so
            with pytest.raises(ValueError, match=r"`x` contains 1 non-finite values \(NaN or inf\), in images \[0\]"):
                model.encode(x)

    @pytest.mark.parametrize("library", ["numpy", "jax", "tensorflow", "torch"])
    def test_bfloat16_images_are_taken_as_their_values(self, model, library):
        # Before: "`x` must be a numeric array of images. Received: x of dtype bfloat16 with shape
        # (2, 8, 8, 1)" (NumPy does not count ml_dtypes' bfloat16 as a number); a torch tensor on
        # TensorFlow or JAX: "`x` must be a concrete array ... Got unsupported ScalarType BFloat16".
        # Binary pixels are exact in bfloat16: the same results as float32's.
        x = shapes_batch(2)
        x_bf16 = as_bfloat16(x, library)
        calls = {
            "log_likelihood": lambda v: [model.log_likelihood(v, num_samples=2)],
            "reconstruct": lambda v: [model.reconstruct(v)],
            "encode": model.encode,
            "interpolate": lambda v: [model.interpolate(v[0], v[1], steps=2)],
        }
        for name, call in calls.items():
            reset_seed(model)
            expected = call(x)
            reset_seed(model)
            for received, wanted in zip(call(x_bf16), expected, strict=True):
                np.testing.assert_array_equal(received, wanted, err_msg=name)

    def test_interpolate_errors_name_the_shapes_received(self, model):
        # Before: a single image x_a with a batch of one x_b gave "Expected `x_b` of shape (batch, 8, 8, 1).
        # Received: x_b.shape=(1, 1, 8, 8, 1)": single images were checked as batches of one, and
        # those shapes shown.
        from keras_avae import inspection

        x = shapes_batch(2)
        nan_image = x[1].copy()
        nan_image[0, 0, 0] = np.nan
        same = (
            r"`x_a` and `x_b` must have the same shape: two images \(H, W, C\) or two batches \(B, H, W, C\) of the "
            r"same size\. Received: "
        )
        cases = [
            (x[0], x[1:], same + r"x_a.shape=\(8, 8, 1\) and x_b.shape=\(1, 8, 8, 1\)$"),
            (x[:1], x[1], same + r"x_a.shape=\(1, 8, 8, 1\) and x_b.shape=\(8, 8, 1\)$"),
            (x[:1], x, same + r"x_a.shape=\(1, 8, 8, 1\) and x_b.shape=\(2, 8, 8, 1\)$"),
            (x[0, :4], x[1, :4], r"Expected `x_a` of shape \(8, 8, 1\), one image\. Received: x_a.shape=\(4, 8, 1\)$"),
            (
                x[None, :1],
                x[None, 1:],
                r"Expected `x_a` of shape \(8, 8, 1\), one image, or \(batch, 8, 8, 1\)\. "
                r"Received: x_a.shape=\(1, 1, 8, 8, 1\)$",
            ),
            (x[0], nan_image, r"`x_b` contains 1 non-finite values \(NaN or inf\)\. Received: x_b with shape \(8, 8, 1\)$"),
            (np.full((8, 8, 1), "a"), x[1], r"`x_a` must be a numeric array.* of dtype <U1 with shape \(8, 8, 1\)$"),
        ]
        for x_a, x_b, pattern in cases:
            for interpolate in (model.interpolate, lambda a, b: inspection.interpolate(model, a, b)):
                with pytest.raises(ValueError, match=pattern):
                    interpolate(x_a, x_b)
        # What the docstring takes: two images, or two batches of the same size (one image each here).
        assert model.interpolate(x[0], x[1], steps=2).shape == (2, 8, 8, 1)
        assert model.interpolate(x[:1], x[1:], steps=2).shape == (1, 2, 8, 8, 1)

    @pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 0.0, -1.0, "hot", True])
    def test_temperature_must_be_finite_and_positive(self, model, temperature):
        # Before: `temperature=inf` sampled an all-black image without an error.
        with pytest.raises(ValueError, match=r"`temperature` must be a finite positive number\. Received: temperature="):
            model.sample(2, temperature=temperature)

    def test_non_finite_samples_raise(self, model):
        # Before: NaN pixels came back (and `keras-avae sample` drew them black).
        overflow = r"2 of the 2 samples hold non-finite values: at temperature=1e\+39"
        with pytest.raises(FloatingPointError, match=overflow):
            model.sample(2, temperature=1e39)  # overflows float32
        saved = model.get_weights()
        broken = r"3 of the 3 samples hold non-finite values: at temperature=1\.0"
        x = (np.random.default_rng(0).random((3, 8, 8, 1)) < 0.5).astype("float32")
        try:
            model.set_weights([np.full_like(w, np.nan) for w in saved])
            with pytest.raises(FloatingPointError, match=broken):
                model.sample(3)
            # Before: these returned NaN (drawn black by the report and the CLI).
            diverged = r"3 of the 3 {} hold non-finite values: the model's weights are probably not finite"
            with pytest.raises(FloatingPointError, match=diverged.format("reconstructions")):
                model.reconstruct(x)
            with pytest.raises(FloatingPointError, match=diverged.format("images' latents")):
                model.encode(x)
            with pytest.raises(FloatingPointError, match=r"of the 3 images' latents hold non-finite values"):
                model.interpolate(x, x[::-1], steps=2)
        finally:
            model.set_weights(saved)
        assert np.all(np.isfinite(model.sample(2)))

    def test_encode_sample_must_be_a_bool(self, model):
        # Before: `sample="no"` was truthy and returned posterior samples.
        with pytest.raises(ValueError, match=r"`sample` must be a bool. Received: sample='no'"):
            model.encode(np.zeros((1, 8, 8, 1), "float32"), sample="no")

    @pytest.mark.parametrize("num_samples", [0, -3, 2.0, True, None])
    def test_num_samples_must_be_a_positive_int(self, model, num_samples):
        with pytest.raises(ValueError, match=r"`num_samples` must be a positive int\. Received: num_samples="):
            model.sample(num_samples)
        with pytest.raises(ValueError, match=r"`num_samples` must be a positive int\. Received: num_samples="):
            model.log_likelihood(shapes_batch(1), num_samples=num_samples)

    def test_inference_methods_return_numpy_arrays(self, model):
        x = shapes_batch(2)
        log_px = model.log_likelihood(x, num_samples=2)
        assert type(log_px) is np.ndarray and log_px.dtype == np.float64 and log_px.shape == (2,)
        for images in (model.sample(np.int64(3), temperature=np.float32(0.5)), model.reconstruct(x)):
            assert type(images) is np.ndarray and images.dtype == np.float32
        latents = model.encode(x, sample=True)
        assert isinstance(latents, list) and len(latents) == TINY["num_layers"]
        assert all(type(z) is np.ndarray and z.dtype == np.float32 for z in latents)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="only torch skips Layer.__call__ (call_sublayer)")
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_skipping_layer_call_bookkeeping_changes_nothing(dtype, monkeypatch):
    # The same pass, losses and gradients with every sublayer called through
    # Layer.__call__ (call_sublayer's other branch).
    from keras_avae import keras_compat

    model = HierarchicalVAE(**dict(TINY, l2=1e-3), dtype=dtype)
    model.build()
    x = keras.ops.convert_to_tensor(shapes_batch(4))

    def loss_and_gradients():
        reset_seed(model)
        model.zero_grad()
        out = model(x, training=True)
        loss = model.compute_loss(x=x, y_pred=out)
        loss.backward()
        grads = [to_numpy(v.value.grad) for v in model.trainable_weights]
        return to_numpy(out), to_numpy(loss), grads, [to_numpy(v) for v in model.non_trainable_weights]

    start = model.get_weights()
    fast = loss_and_gradients()
    called = []
    original = keras_compat._skips_call_bookkeeping
    monkeypatch.setattr(keras_compat, "_skips_call_bookkeeping", lambda *a: called.append(original(*a)) or False)
    model.set_weights(start)  # the same moving statistics before both passes
    slow = loss_and_gradients()
    assert called and all(called), "every sublayer call took the fast path before"
    for key in ("nll", "kl", "kl_per_layer"):
        np.testing.assert_array_equal(fast[0][key], slow[0][key])
    np.testing.assert_array_equal(fast[1], slow[1])
    for a, b in zip(fast[2] + fast[3], slow[2] + slow[3]):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------- #
# The passes recomputed from the model's parts (stem, cells, heads) in NumPy
# ---------------------------------------------------------------------- #


def perturbed_model(config=TINY, seed=0):
    """A built model whose posteriors differ clearly from their priors.

    Every gate is opened and the weight-norm gains of the stochastic cells
    are jittered, so KL(q||p) and KL(p||q) differ and the attention paths
    carry signal.
    """
    model = HierarchicalVAE(**config)
    model.build()
    rng = np.random.default_rng(seed)
    for cell in model.prior_cells + model.posterior_cells:
        if cell.gate is not None:
            cell.gate.assign(0.5)
        for w in cell.weights:
            if w.path.endswith("log_g"):
                w.assign(to_numpy(w) + rng.normal(0.0, 0.5, size=w.shape).astype("float32"))
    return model


def gaussian_from_raw(raw_loc, raw_log_scale, bound=5.0):
    """DESIGN §3: mu = 5 tanh(mu / 10), sigma = exp(b tanh(log_sigma / 2b)) + 0.01, in NumPy."""
    loc = 5.0 * np.tanh(np.asarray(raw_loc, np.float64) / 10.0)
    scale = np.exp(bound * np.tanh(np.asarray(raw_log_scale, np.float64) / (2 * bound))) + 0.01
    return loc, scale


def gaussian_kl(q_loc, q_scale, p_loc, p_scale):
    """Closed-form KL(q || p) of diagonal Gaussians, summed over H, W, C: (B,)."""
    ratio = (q_scale / p_scale) ** 2
    per_element = 0.5 * (ratio + ((q_loc - p_loc) / p_scale) ** 2 - 1.0 - np.log(ratio))
    return per_element.reshape(len(per_element), -1).sum(-1)


def prior_steps(model, latents):
    """The prior side of the top-down loop written out: per layer `(condition, query, raw, p_loc, p_scale)`.

    Layer 0's prior is N(0, I) and its condition the top constant (`raw`
    is `None`); layer i >= 1 gets its prior from `prior_cells[i - 1]` fed
    the sampled `z_{i-1}`. The Gaussians are in NumPy, by DESIGN §3.
    """
    P, ik = model._context, model._ik
    latents = [to_numpy(z).astype("float32") for z in latents]
    top = np.tile(to_numpy(model.top_constant).astype("float32"), (len(latents[0]), 1, 1, 1))
    values, keys = [top[..., :P]], [top[..., P:]]
    yield top[..., :P], top[..., :ik], None, np.zeros(latents[0].shape), np.ones(latents[0].shape)
    for cell, z in zip(model.prior_cells, latents):
        step = cell(values, keys, z, training=False)
        p_loc, p_scale = gaussian_from_raw(to_numpy(step["raw"][0]), to_numpy(step["raw"][1]))
        yield step["condition"], step["query"], step["raw"], p_loc, p_scale
        values = values + [step["context"]] if cell.attend is not None else [step["context"]]
        if step["key"] is not None:
            keys = keys + [step["key"]]


def layer_distributions(model, features, latents):
    """Per layer, `(q_loc, q_scale, p_loc, p_scale)` in NumPy, from the cells given the sampled latents.

    The priors from `prior_steps`; every posterior from its cell, given its
    layer's condition, query and raw prior.
    """
    split = model.posterior_cells[0].split_features(features)
    layers = []
    for i, (condition, query, prior_raw, p_loc, p_scale) in enumerate(prior_steps(model, latents)):
        q, _ = model.posterior_cells[i](condition, query, prior_raw, split, training=False)
        layers.append((to_numpy(q.loc), to_numpy(q.scale), p_loc, p_scale))
    return layers


class TestPassesAgainstTheirParts(TestCase):
    def test_bottom_up_features_run_from_the_image_to_the_top_layer(self):
        # Protects the bottom-up order (`[e_0, ..., e_L]`, e_L the pre-processed image, DESIGN §3) and the
        # Bernoulli encoder's input mapping 2x - 1.
        model = HierarchicalVAE(**TINY)
        model.build()
        for cell in model.encoder_cells:  # larger residual branches: each cell changes its feature clearly
            for w in cell.weights:
                if w.path.endswith("log_g"):
                    w.assign(to_numpy(w).astype("float32") + 2.0)
        x = shapes_batch(4)
        features = to_numpy(model.bottom_up(x, training=False))
        e = model.stem(2.0 * x - 1.0)  # binary {0, 1} images enter the encoder in {-1, 1}
        for cell in model.preprocess:
            e = cell(e, training=False)
        expected = {model.num_layers: to_numpy(e)}
        n = model.cells_per_layer
        for j in reversed(range(model.num_layers)):  # e_j = EncoderCell_j(e_{j+1})
            for cell in model.encoder_cells[j * n : (j + 1) * n]:
                e = cell(e, training=False)
            expected[j] = to_numpy(e)
        assert len(features) == model.num_layers + 1
        for j, feature in enumerate(features):
            self.assertAllClose(feature, expected[j], atol=1e-5, rtol=1e-5, msg=f"e_{j}")
        # The two ends differ, so the order is seen.
        assert np.max(np.abs(expected[0] - expected[model.num_layers])) > 1e-2

    def test_kl_per_layer_is_closed_form_kl_of_posterior_to_prior(self):
        # Protects KL(q || p) (not KL(p || q)) per layer, with N(0, I) as the top layer's prior.
        model = perturbed_model()
        x = shapes_batch(4)
        features = model.bottom_up(x, training=False)
        reset_seed(model, 3)
        result = model.top_down(features, training=False, return_latents=True)
        latents = [to_numpy(z) for z in result["latents"]]
        layers = layer_distributions(model, features, latents)
        expected = np.stack([gaussian_kl(*layer) for layer in layers], axis=-1)
        self.assertAllClose(result["kl_per_layer"], expected, atol=1e-4, rtol=1e-4)
        # The check can tell the directions apart: KL(p || q) is far from KL(q || p) here.
        reverse = np.stack([gaussian_kl(pl, ps, ql, qs) for ql, qs, pl, ps in layers], axis=-1)
        assert np.abs(reverse - expected).sum() > 0.1 * expected.sum(), (reverse, expected)
        # ... and the top layer's prior scale: KL to N(0, 2^2) is far from KL to N(0, 1).
        q0_loc, q0_scale, _, _ = layers[0]
        wide = gaussian_kl(q0_loc, q0_scale, 0.0, 2.0)
        assert np.all(np.abs(wide - expected[:, 0]) > 1.0), (wide, expected[:, 0])
        # The posterior means returned alongside are the posteriors' locations.
        for i, (mean, layer) in enumerate(zip(result["posterior_means"], layers)):
            self.assertAllClose(mean, layer[0], atol=1e-5, rtol=1e-5, msg=f"layer {i}")

    def test_top_layer_prior_samples_are_standard_normal(self):
        # Protects the top layer's prior N(0, I): prior samples of layer 0 have mean 0 and unit variance.
        model = HierarchicalVAE(**TINY)
        model.build()
        reset_seed(model, 11)
        z0 = to_numpy(model.top_down(batch_size=4, training=False, return_latents=True)["latents"][0])
        # 128 draws: standard errors 0.09 for the mean, sqrt(2 / 128) = 0.125 for the variance; N(0, 2^2) has 4.
        assert abs(z0.mean()) < 0.35 and abs(z0.var() - 1.0) < 0.5, (z0.mean(), z0.var())

    def test_encode_returns_the_posterior_means_not_samples(self):
        # Protects `encode()` returning posterior means: layer 0's mean depends on x only, not on the draws.
        model = perturbed_model()
        x = shapes_batch(4)
        reset_seed(model, 1)
        first = model.encode(x)
        reset_seed(model, 2)
        second = model.encode(x)
        np.testing.assert_allclose(first[0], second[0], atol=1e-6)
        # Layer 0's posterior from its cell, fed the top constant's context and the features.
        P, ik = model._context, model._ik
        top = np.tile(to_numpy(model.top_constant).astype("float32"), (4, 1, 1, 1))
        split = model.posterior_cells[0].split_features(model.bottom_up(x, training=False))
        q0, _ = model.posterior_cells[0](top[..., :P], top[..., :ik], None, split, training=False)
        self.assertAllClose(first[0], q0.loc, atol=1e-5, rtol=1e-5)
        # A sample is not the mean (the posterior's scale is far from 0).
        assert np.min(to_numpy(q0.scale)) > 0.05
        reset_seed(model, 1)
        assert not np.allclose(model.encode(x, sample=True)[0], first[0], atol=1e-3)

    def test_importance_weights_score_each_image_with_its_own_posterior(self, monkeypatch):
        # Protects `log_weights` pairing each image with samples of its own posterior: with the noise fixed
        # (the same draw for every row), row i of a batch equals the computation on image i alone.
        def fixed_noise_sample(self, seed=None, temperature=1.0):
            shape = tuple(self.loc.shape)
            eps = np.sin(np.arange(np.prod(shape[1:]), dtype="float32") * 1.7).reshape(shape[1:])
            return self.loc + temperature * self.scale * ops.convert_to_tensor(eps[None])

        monkeypatch.setattr(DiagonalGaussian, "sample", fixed_noise_sample)
        model = perturbed_model()
        x = shapes_batch(2, seed=4)
        x[1] = 1.0 - x[1]  # two clearly different images
        features = model.bottom_up(x, training=False)
        own = [[f[i : i + 1] for f in features] for i in range(2)]  # image i's bottom-up features
        batched = to_numpy(model.log_weights(x, features, 2))
        assert batched.shape == (2, 2)
        alone = np.concatenate([to_numpy(model.log_weights(x[i : i + 1], own[i], 4)) for i in range(2)])
        # One draw per image: its weights agree, and each image's equal its weights scored alone.
        self.assertAllClose(alone, np.repeat(alone[:, :1], 4, axis=1), atol=1e-3, rtol=1e-5)
        self.assertAllClose(batched, alone[:, :2], atol=1e-3, rtol=1e-5)
        # The check can fail: image 0 scored with image 1's posterior gets other weights.
        swapped = to_numpy(model.log_weights(x[:1], own[1], 4))[0, 0]
        assert abs(swapped - alone[0, 0]) > 0.1, (swapped, alone[0, 0])

    def test_importance_samples_share_one_bottom_up_pass(self, monkeypatch):
        # Protects against the reference's defect of running the bottom-up pass once per importance sample:
        # `log_weights` draws its K samples from the features it is given, and `log_likelihood` computes
        # them once per pass of samples.
        model = HierarchicalVAE(**TINY)
        model.build()
        x = shapes_batch(2)
        features = model.bottom_up(x, training=False)
        calls = []
        bottom_up = model.bottom_up

        def counted(*args, **kwargs):
            calls.append(1)
            return bottom_up(*args, **kwargs)

        monkeypatch.setattr(model, "bottom_up", counted)
        model.log_weights(x, features, 3)
        assert calls == []
        if keras.backend.backend() == "torch":  # eager passes: each one is a call (compiled ones are traced once)
            model.log_likelihood(x, num_samples=6, chunk_size=2)
            assert len(calls) == 3

    def test_the_hierarchy_never_stacks_its_contexts(self, monkeypatch):
        # Protects the linear memory in L at the model level (the reference stacked every earlier context in
        # each layer, O(L^2) copies): each attention gets lists of contexts and features it does not copy
        # (no per-call normalisation), and no pass stacks them.
        config = dict(TINY, num_layers=4)
        model = HierarchicalVAE(**config)
        model.build()
        attend_call = DepthwiseAttend.call
        seen, stacked = [], []

        def recording_call(layer, query, keys, values, **kwargs):
            seen.append((type(keys), type(values), len(values), layer.normalize_values))
            return attend_call(layer, query, keys, values, **kwargs)

        stack = ops.stack

        def recording_stack(tensors, axis=0):
            result = stack(tensors, axis=axis)
            stacked.append(tuple(result.shape))
            return result

        monkeypatch.setattr(DepthwiseAttend, "call", recording_call)
        monkeypatch.setattr(keras.ops, "stack", recording_stack)
        model(shapes_batch(2), training=True)
        generative = [entry for entry in seen if entry[2] > 1]
        assert len(seen) == 2 * config["num_layers"] - 1 and generative, seen
        for keys_type, values_type, _, normalizes in seen:
            assert keys_type is list and values_type is list and not normalizes, seen
        assert all(len(shape) < 5 for shape in stacked), stacked

    def test_temperature_scales_every_layers_prior_draw(self):
        # Protects sampling at a temperature: each layer draws z_l = mu_l + t sigma_l eps_l from its prior
        # given the layers above, the top layer included, so the same seed gives the same eps_l at every t
        # (a decoder that applied t to the top layer only would pass a check of the top layer alone).
        model = perturbed_model()
        eps = {}
        for t in (1.0, 0.6):
            reset_seed(model, 9)
            latents = model.top_down(batch_size=2, training=False, temperature=t, return_latents=True)["latents"]
            steps = prior_steps(model, latents)
            eps[t] = [(to_numpy(z) - p_loc) / (t * p_scale) for z, (*_, p_loc, p_scale) in zip(latents, steps)]
        for i, (cold, warm) in enumerate(zip(eps[0.6], eps[1.0])):
            self.assertAllClose(cold, warm, atol=2e-4, rtol=1e-3, msg=f"layer {i}")
