"""The inspection API: values against direct computations, on a tiny model, on every backend."""

import re

import keras
import numpy as np
import pytest

from keras_avae import inspection
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.models.batch_norm_statistics import batch_norm_layers
from keras_avae.models.batch_norm_statistics import readjusted_batch_norm
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from tests.models.test_hierarchical_vae import TINY
from tests.models.test_hierarchical_vae import reset_seed
from tests.models.test_hierarchical_vae import shapes_batch
from tests.test_case import to_numpy


def tiny_model(**overrides):
    model = HierarchicalVAE(**{**TINY, **overrides})
    model.build()
    return model


def randomize_gates(model, value=0.7):
    cells = model.prior_cells + model.posterior_cells
    for gate in [cell.gate for cell in cells] + [b.gamma for b in _blocks(model)]:
        if gate is not None:
            gate.assign(value)


def _blocks(model):
    return list(inspection.nonlocal_blocks(model).values())


def test_kl_per_layer_is_the_models_own_kl_per_layer():
    model, x = tiny_model(), shapes_batch(6)
    reset_seed(model)
    kl = inspection.kl_per_layer(model, x, batch_size=6)
    reset_seed(model)
    direct = to_numpy(model(x, training=False))
    assert kl.shape == (6, 3) and kl.dtype == np.float32
    np.testing.assert_allclose(kl, direct["kl_per_layer"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kl.sum(axis=1), direct["kl"], rtol=1e-5, atol=1e-4)
    assert (kl >= 0).all()


def test_active_units_is_the_variance_of_the_posterior_means():
    model, x = tiny_model(), shapes_batch(10)
    randomize_gates(model)
    # E_q[z_l | x] averages the posterior means over samples of z_<l: the
    # same seed state draws the same samples.
    reset_seed(model)
    means = model.encode(np.repeat(x, 3, axis=0))
    reset_seed(model)
    result = inspection.active_units(model, x, threshold=1e-4, num_samples=3, batch_size=10)
    means = [m.reshape((10, 3) + m.shape[1:]).mean(axis=1) for m in means]
    expected = np.stack([np.var(m.reshape(10, -1).astype(np.float64), axis=0) for m in means])
    assert result["units"] == 4 * 4 * 2
    np.testing.assert_allclose(result["variance"], expected, rtol=1e-4, atol=1e-9)
    np.testing.assert_array_equal(result["active"], (expected > 1e-4).sum(axis=1))
    # The variance is over all images, not averaged per batch: layer 0's
    # posterior means do not depend on the samples, so any batch size gives them.
    batched = inspection.active_units(model, x, threshold=1e-4, num_samples=3, batch_size=3)
    np.testing.assert_allclose(batched["variance"][0], expected[0], rtol=1e-4, atol=1e-9)
    assert inspection.active_units(model, x, threshold=1e9)["active"].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="at least 2 images"):
        inspection.active_units(model, x[:1])
    with pytest.raises(ValueError, match="threshold=-1"):
        inspection.active_units(model, x, threshold=-1)


def test_depthwise_attention_weights_rows_and_matrix():
    model, x = tiny_model(), shapes_batch(5)
    randomize_gates(model)
    result = inspection.depthwise_attention(model, x, batch_size=2)
    gen, inf = result["generative"], result["inference"]
    # Generative layer l attends over the l contexts of layers 0..l-1.
    assert gen["per_pixel"][0] is None
    assert [w.shape for w in gen["per_pixel"][1:]] == [(5, 4, 4, 1), (5, 4, 4, 2)]
    # Inference layer l over its own feature, the deeper ones and the image.
    assert [w.shape for w in inf["per_pixel"]] == [(5, 4, 4, 4), (5, 4, 4, 3), (5, 4, 4, 2)]
    for weights in gen["per_pixel"][1:] + inf["per_pixel"]:
        np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)
        assert (weights >= 0).all()
    np.testing.assert_allclose(gen["matrix"].sum(axis=1), [0.0, 1.0, 1.0], atol=1e-5)
    np.testing.assert_allclose(inf["matrix"].sum(axis=1), [1.0, 1.0, 1.0], atol=1e-5)
    assert np.all(np.triu(gen["matrix"]) == 0)  # only earlier layers
    assert np.all(np.tril(inf["matrix"], k=-1) == 0)  # only itself and deeper
    np.testing.assert_array_equal(gen["attended"], np.tril(np.ones((3, 3), bool), k=-1))
    np.testing.assert_array_equal(inf["attended"], np.triu(np.ones((3, 4), bool)))
    np.testing.assert_allclose(inf["matrix"][1, 1:], inf["per_pixel"][1].mean(axis=(0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(gen["gates"], [0.0, 0.7, 0.7], rtol=1e-6)


def test_kl_per_layer_refuses_a_model_that_is_not_a_vae():
    # Before: AttributeError: 'Sequential' object has no attribute '_check_images'.
    with pytest.raises(ValueError, match="HierarchicalVAE or a DiscreteVAE. Received: model of type Sequential"):
        inspection.kl_per_layer(keras.Sequential([keras.layers.Dense(1)]), shapes_batch(2))


def test_depthwise_attention_refuses_a_baseline():
    model = tiny_model(generative_attention=False, inference_attention=False)
    with pytest.raises(ValueError, match="no depth-wise attention.*generative_attention=False"):
        inspection.depthwise_attention(model, shapes_batch(2))
    with pytest.raises(ValueError, match="HierarchicalVAE.*Received: model of type Sequential"):
        inspection.depthwise_attention(keras.Sequential([keras.layers.Dense(1)]), shapes_batch(2))


def _perturb_attention(model):
    """New logit scales and output normalisations of every depth-wise attention."""
    rng = np.random.default_rng(3)
    for attend in [cell.attend for cell in model.prior_cells + model.posterior_cells if cell.attend is not None]:
        for weight in attend.weights:
            weight.assign(rng.normal(size=weight.shape).astype("float32") * 3.0)


@pytest.mark.parametrize("gates", [0.0, 0.7])
def test_with_every_gate_zero_attention_cannot_change_the_output(gates):
    model, x = tiny_model(), shapes_batch(4)
    randomize_gates(model, gates)
    reset_seed(model)
    before = to_numpy(model(x, training=False))
    _perturb_attention(model)
    reset_seed(model)
    after = to_numpy(model(x, training=False))
    changed = not np.allclose(before["nll"], after["nll"], rtol=1e-6, atol=1e-6)
    assert changed == (gates != 0.0)


def test_nonlocal_attention_maps_reproduce_the_blocks():
    model, x = tiny_model(), shapes_batch(3)
    randomize_gates(model)
    result = inspection.nonlocal_attention(model, x, [(0, 0), (7, 5)], batch_size=2)
    assert set(result) == set(inspection.nonlocal_blocks(model))
    for path, entry in result.items():
        assert entry["query_pixels"] == [(0, 0), (3, 2)], path  # 8x8 image, 4x4 blocks
        assert entry["maps"].shape == (3, 2, 4, 4)
        np.testing.assert_allclose(entry["maps"].sum(axis=(2, 3)), 1.0, atol=1e-5)
        assert entry["gamma"] == pytest.approx(0.7) and entry["attention"] == "softmax"
    with pytest.raises(ValueError, match=r"query_pixels.*\[0, 8\) x \[0, 8\).*\(8, 0\)"):
        inspection.nonlocal_attention(model, x, [(8, 0)])
    # One pixel instead of a list of them, floats (not truncated), NaN: the same error.
    for bad in ((3, 4), [3], None, [(3.9, 4)], [(float("nan"), 1)], [(True, 1)]):
        with pytest.raises(ValueError, match=re.escape(f"Received: query_pixels={bad!r}")):
            inspection.nonlocal_attention(model, x, bad)
    with pytest.raises(ValueError, match="no non-local block"):
        inspection.nonlocal_attention(tiny_model(nonlocal_blocks=()), x, [(0, 0)])
    # The recording is undone: the blocks run their own `call` again.
    assert all("call" not in vars(block) for block in _blocks(model))
    # Each block's maps are its own attention at the input it was given:
    # inputs captured here, independently, with the same posterior draws.
    captured, order = {}, []
    for path, block in inspection.nonlocal_blocks(model).items():
        def record(x, *args, _path=path, _call=block.call, **kwargs):
            captured[_path] = x
            order.append(_path)
            return _call(x, *args, **kwargs)

        block.call = record
    reset_seed(model)
    model(x, training=False)
    for block in _blocks(model):
        del block.call
    reset_seed(model)
    result = inspection.nonlocal_attention(model, x, [(0, 0), (7, 5)], batch_size=3)
    assert list(result) == order  # the order the forward pass runs them
    for path, block in inspection.nonlocal_blocks(model).items():
        expected = to_numpy(block.attention_map(captured[path], [(0, 0), (3, 2)]))
        np.testing.assert_allclose(result[path]["maps"], expected, rtol=1e-5, atol=1e-6)


def test_nonlocal_blocks_of_an_unbuilt_model_are_all_found():
    # Before: unbuilt blocks have path `None`, so the 15 blocks collapsed
    # into one entry keyed `None` (and `nonlocal_attention` drew one block).
    def names(paths):
        return sorted(path.split("/", 1)[1] for path in paths)

    expected = names(inspection.nonlocal_blocks(tiny_model()))
    assert len(expected) == 15
    assert names(inspection.nonlocal_blocks(HierarchicalVAE(**TINY))) == expected
    assert names(inspection.nonlocal_attention(HierarchicalVAE(**TINY), shapes_batch(2), [(0, 0)])) == expected
    # A model that cannot build itself is refused, not collapsed.
    unbuilt = keras.Sequential([NonLocalBlock(key_dim=2), NonLocalBlock(key_dim=2)])
    with pytest.raises(ValueError, match="must be built.*Received: an unbuilt model of type Sequential"):
        inspection.nonlocal_blocks(unbuilt)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="autograd graphs are PyTorch's")
def test_nonlocal_attention_runs_without_autograd():
    # Before: the kept block inputs held the autograd graph of each whole pass
    # (100 MNIST images, `mnist-attentive-small`: +1.4 GB peak instead of +0.3 GB).
    import torch

    model = tiny_model()
    block = _blocks(model)[-1]
    grad_enabled = []
    for name in ("call", "attention_map"):

        def record(*args, _method=getattr(block, name), **kwargs):
            grad_enabled.append(torch.is_grad_enabled())
            return _method(*args, **kwargs)

        setattr(block, name, record)
    inspection.nonlocal_attention(model, shapes_batch(2), [(0, 0)])
    assert grad_enabled == [False, False]


def test_decoding_given_latents_reproduces_the_posterior_pass():
    model, x = tiny_model(), shapes_batch(3)
    randomize_gates(model)
    reset_seed(model)
    posterior = model.top_down(model.bottom_up(x, training=False), training=False, return_latents=True)
    decoded = model.top_down(latents=posterior["latents"], training=False)["decoded"]
    np.testing.assert_allclose(to_numpy(decoded), to_numpy(posterior["decoded"]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one tensor per layer"):
        model.top_down(latents=posterior["latents"][:2])


def test_interpolate_ends_at_the_images_and_is_linear_in_latents():
    model, x = tiny_model(), shapes_batch(4)
    randomize_gates(model)
    reset_seed(model)
    line = inspection.interpolate(model, x[0], x[1], steps=5)
    assert line.shape == (5, 8, 8, 1)
    # The same seed state draws the same posterior means (layers >= 1 are
    # conditioned on samples of the layers above).
    reset_seed(model)
    ends = model.encode(x[:1]), model.encode(x[1:2])

    def decode(latents):
        decoded = model.top_down(latents=latents, training=False)["decoded"]
        return to_numpy(model._data_mean_or_sample(decoded, "mean"))[0]

    np.testing.assert_allclose(line[0], decode(ends[0]), atol=1e-5)
    np.testing.assert_allclose(line[4], decode(ends[1]), atol=1e-5)
    np.testing.assert_allclose(line[2], decode([(a + b) / 2 for a, b in zip(*ends)]), atol=1e-5)
    batched = inspection.interpolate(model, x[:2], x[2:], steps=3)
    assert batched.shape == (2, 3, 8, 8, 1)
    with pytest.raises(ValueError, match="steps=1"):
        inspection.interpolate(model, x[0], x[1], steps=1)
    with pytest.raises(ValueError, match="same shape"):
        inspection.interpolate(model, x[:2], x[:3])


def test_a_model_with_non_finite_weights_is_named_not_drawn():
    # Before: NaN KL bars, NaN attention maps, and 0 active units (as if collapsed).
    model = tiny_model()
    x = shapes_batch(4)
    model.set_weights([np.full_like(w, np.nan) for w in model.get_weights()])
    with pytest.raises(FloatingPointError, match=r"4 of the 4 images' KL terms hold non-finite values"):
        inspection.kl_per_layer(model, x)
    with pytest.raises(FloatingPointError, match=r"images' latents hold non-finite values"):
        inspection.active_units(model, x)  # (each image encoded num_samples times)
    with pytest.raises(FloatingPointError, match=r"of the 4 images' (generative|inference) attention weights"):
        inspection.depthwise_attention(model, x)
    with pytest.raises(FloatingPointError, match=r"4 of the 4 images' log-likelihoods hold non-finite values"):
        model.log_likelihood(x, num_samples=2)


def _record_batch_norm_inputs(norms):
    inputs = {id(n): [] for n in norms}
    for norm in norms:
        call = norm.call

        def recorded(x, *args, _call=call, _key=id(norm), **kwargs):
            inputs[_key].append(to_numpy(x))
            return _call(x, *args, **kwargs)

        norm.call = recorded
    return inputs


def test_readjusted_batch_norm_averages_batch_statistics_and_restores_them():
    model = tiny_model(log_scale_noise=0.5)
    randomize_gates(model)
    values = {v.path: to_numpy(v) for v in model.variables}
    norms = batch_norm_layers(model)
    inputs = _record_batch_norm_inputs(norms)
    with readjusted_batch_norm(model, temperature=0.6, steps=3, batch_size=8):
        for norm in norms:
            del norm.call
        assert model.log_scale_noise == 0.5
        changed = {v.path for v in model.variables if not np.array_equal(to_numpy(v), values[v.path])}
        used = [n for n in norms if inputs[id(n)]]
        assert used and len(used) < len(norms)  # the sampler never runs the encoder
        for norm in used:
            passes = inputs[id(norm)]
            assert len(passes) == 3
            mean = np.mean([p.reshape(-1, p.shape[-1]).mean(axis=0) for p in passes], axis=0)
            variance = np.mean([p.reshape(-1, p.shape[-1]).var(axis=0) for p in passes], axis=0)
            np.testing.assert_allclose(to_numpy(norm.moving_mean), mean, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(to_numpy(norm.moving_variance), variance, rtol=1e-3, atol=1e-5)
    # Only batch-norm statistics (and the sampling seed) moved, and they are back.
    statistics = {v.path for n in used for v in (n.moving_mean, n.moving_variance)}
    assert changed - {model.seed_generator.state.path} == statistics
    for v in model.variables:
        if v is not model.seed_generator.state:
            np.testing.assert_array_equal(to_numpy(v), values[v.path])
    assert all(n.momentum == model.bn_momentum for n in norms)


def test_readjusted_batch_norm_passes_draw_no_log_scale_noise():
    # Before: only the model's copy of `log_scale_noise` was zeroed; the cells
    # kept theirs, so the passes of a noisy model added noise to the statistics.
    noisy, quiet = tiny_model(log_scale_noise=0.5), tiny_model(log_scale_noise=0.0)
    randomize_gates(noisy)
    quiet.set_weights(noisy.get_weights())
    readjusted = []
    for model in (noisy, quiet):
        with readjusted_batch_norm(model, temperature=0.6, steps=2, batch_size=8):
            readjusted.append([to_numpy(n.moving_mean) for n in batch_norm_layers(model)])
    for a, b in zip(*readjusted):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all(cell.log_scale_noise == 0.5 for cell in noisy.prior_cells + noisy.posterior_cells)


@pytest.mark.parametrize("frozen", [False, True])
def test_sample_with_readjusted_batch_norm(frozen):
    model = tiny_model()
    randomize_gates(model)
    for norm in batch_norm_layers(model):  # statistics far from the samples'
        norm.moving_mean.assign(norm.moving_mean + 3.0)
    model.trainable = not frozen  # Keras uses batch statistics only in trainable layers
    values = {v.path: to_numpy(v) for v in model.variables}
    reset_seed(model)
    plain = model.sample(4, temperature=0.6)
    plain_state = to_numpy(model.seed_generator.state)
    reset_seed(model)
    readjusted = model.sample(4, temperature=0.6, readjust_batch_norm=True, readjust_steps=2)
    # The same noise (the passes give the generator back): only the
    # statistics differ, and they are restored afterwards.
    np.testing.assert_array_equal(to_numpy(model.seed_generator.state), plain_state)
    assert readjusted.shape == plain.shape and np.isfinite(readjusted).all()
    assert not np.allclose(plain, readjusted)
    for v in model.variables:
        if v is not model.seed_generator.state:
            np.testing.assert_array_equal(to_numpy(v), values[v.path])
    assert model.trainable == (not frozen) and all(n.trainable == (not frozen) for n in batch_norm_layers(model))
    # `sample(readjust_batch_norm=True)` is sampling inside the context.
    reset_seed(model)
    with readjusted_batch_norm(model, temperature=0.6, steps=2):
        reset_seed(model)
        inside = model.sample(4, temperature=0.6)
    np.testing.assert_allclose(inside, readjusted, atol=1e-6)
    reset_seed(model)  # a NumPy bool (refused before) is the bool
    np.testing.assert_allclose(model.sample(4, 0.6, readjust_batch_norm=np.True_, readjust_steps=2), readjusted, atol=1e-6)
    with pytest.raises(ValueError, match="readjust_batch_norm=1"):
        model.sample(2, readjust_batch_norm=1)
    with pytest.raises(ValueError, match="readjust_steps=0"):
        model.sample(2, readjust_batch_norm=True, readjust_steps=0)


def test_readjusted_batch_norm_restores_the_statistics_after_an_error():
    model = tiny_model()
    values = {v.path: to_numpy(v) for v in model.variables}
    with pytest.raises(RuntimeError, match="inside"):
        with readjusted_batch_norm(model, temperature=0.8, steps=2, batch_size=4):
            raise RuntimeError("inside")
    for v in model.variables:
        np.testing.assert_array_equal(to_numpy(v), values[v.path], err_msg=v.path)
