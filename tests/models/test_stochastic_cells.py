"""PriorCell (eq. 7-9) and PosteriorCell (eq. 10-11) against NumPy recomputations from their parts."""

import keras
import numpy as np
import pytest

from keras_avae.models import HierarchicalVAE
from keras_avae.models.stochastic_cells import PosteriorCell
from keras_avae.models.stochastic_cells import PriorCell
from tests.test_training import TINY


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def tiny_model():
    model = HierarchicalVAE(**dict(TINY, num_layers=3, seed=2))
    model.build()
    for cell in model.prior_cells + model.posterior_cells:
        if cell.gate is not None:
            cell.gate.assign(0.6)
    return model


def bounded_loc(raw):
    return 5.0 * np.tanh(raw / 10.0)


def test_one_cell_per_stochastic_layer():
    model = tiny_model()
    assert [c.index for c in model.prior_cells] == [1, 2]
    assert [c.index for c in model.posterior_cells] == [0, 1, 2]
    assert all(isinstance(c, PriorCell) for c in model.prior_cells)
    assert all(isinstance(c, PosteriorCell) for c in model.posterior_cells)
    # Each cell owns its own weights: no two cells share a variable (a layer
    # reused by two layers would show here; `model.weights` itself dedups),
    # and every cell weight is one of the model's.
    model_ids = {id(v) for v in model.weights}
    seen = set()
    for cell in model.prior_cells + model.posterior_cells:
        ids = {id(v) for v in cell.weights}
        assert ids and not ids & seen, cell.name
        assert ids <= model_ids, cell.name
        seen |= ids


def test_prior_cell_condition_is_context_plus_gated_attention_eq9():
    model = tiny_model()
    rng = np.random.default_rng(0)
    P = model._context
    shape = (2, *model._latent_size)
    top = rng.normal(size=(*shape, P + model._gk)).astype("float32")
    values, keys = [top[..., :P]], [top[..., P:]]
    z = rng.normal(size=(*shape, model.latent_channels)).astype("float32")
    cell = model.prior_cells[0]
    passed = (list(values), list(keys))
    step = cell(values, keys, z, training=False)
    # The caller's lists are not changed: the model keeps its own state.
    assert len(values) == len(passed[0]) == 1 and len(keys) == len(passed[1]) == 1

    # Recompute from the cell's parts: merge, cells, split, attend, gate.
    x = cell.merge(np.concatenate([values[-1], z], axis=-1))
    if cell.merge_nonlocal is not None:
        x = cell.merge_nonlocal(x, training=False)
    for residual in cell.cells:
        x = residual(x, training=False)
    x = to_numpy(x)
    context = x[..., :P]
    key = x[..., P : P + cell.key_channels]
    query = x[..., P + cell.key_channels :]
    normed = to_numpy(cell.context_norm(context)) if cell.context_norm is not None else context
    attended = to_numpy(cell.attend(query, keys, values))
    expected_condition = normed + 0.6 * attended
    np.testing.assert_allclose(to_numpy(step["condition"]), expected_condition, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(step["key"]), key, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(to_numpy(step["query"]), context[..., : model._ik], rtol=1e-6, atol=1e-6)

    # The prior (bounded parameterisation) from the head's raw output.
    params = to_numpy(cell.head(keras.ops.elu(expected_condition)))
    raw_loc = params[..., : model.latent_channels]
    np.testing.assert_allclose(to_numpy(step["prior"].loc), bounded_loc(raw_loc), rtol=1e-4, atol=1e-5)


def test_posterior_cell_is_a_residual_correction_of_the_prior():
    model = tiny_model()
    x = (np.random.default_rng(1).random((2, *model.image_shape)) > 0.5).astype("float32")
    features = model.bottom_up(x, training=False)
    rng = np.random.default_rng(2)
    shape = (2, *model._latent_size)
    condition = rng.normal(size=(*shape, model._context)).astype("float32")
    query = condition[..., : model._ik]
    prior_loc = rng.normal(size=(*shape, model.latent_channels)).astype("float32")
    prior_log_scale = rng.normal(size=prior_loc.shape).astype("float32")
    cell = model.posterior_cells[1]
    q, scores = cell(condition, query, (prior_loc, prior_log_scale), cell.split_features(features), training=False)

    E = model._values
    merged = to_numpy(cell.merge_condition(condition)) + to_numpy(cell.merge_h(to_numpy(features[1])[..., :E]))
    own_condition, own_key = merged[..., :E], merged[..., E:]
    deeper = [to_numpy(f) for f in features[2:]]
    attended = to_numpy(
        cell.attend(query, [own_key] + [f[..., E:] for f in deeper], [own_condition] + [f[..., :E] for f in deeper])
    )
    normed = to_numpy(cell.norm(own_condition)) if cell.norm is not None else own_condition
    head_input = np.concatenate([normed + 0.6 * attended, own_key], axis=-1)
    delta = to_numpy(cell.head(head_input))
    delta_loc, delta_log_scale = delta[..., : model.latent_channels], delta[..., model.latent_channels :]
    np.testing.assert_allclose(to_numpy(q.loc), bounded_loc(prior_loc + delta_loc), rtol=1e-4, atol=1e-5)
    # The log-scale is residual too: sigma = exp(b tanh((prior + delta) / 2b)) + 0.01 (`DiagonalGaussian.from_raw`).
    low, high = model.posterior_log_scale_bounds
    assert (low, high) == (-5.0, 5.0)  # the symmetric soft bound below
    expected_scale = np.exp(high * np.tanh((prior_log_scale + delta_log_scale) / (2 * high))) + 0.01
    np.testing.assert_allclose(to_numpy(q.scale), expected_scale, rtol=1e-4, atol=1e-5)
    # Layer 1 attends over its own feature and the L - 1 deeper ones.
    assert tuple(scores.shape)[-1] == 1 + len(deeper)


def test_cells_are_saved_with_their_model_not_alone(tmp_path):
    model = tiny_model()
    with pytest.raises(NotImplementedError, match="PriorCell is built by HierarchicalVAE"):
        model.prior_cells[0].get_config()
    path = tmp_path / "m.weights.h5"
    model.save_weights(str(path))
    other = HierarchicalVAE(**dict(TINY, num_layers=3, seed=5))
    other.build()
    other.load_weights(str(path))
    for a, b in zip(model.weights, other.weights):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
