"""The model zoo: entries, overrides, errors, and fidelity to the paper."""

import json
import pathlib

import keras
import numpy as np
import pytest

import keras_avae
from keras_avae import zoo

REPO_ZOO = pathlib.Path(__file__).resolve().parents[2] / "zoo"
REQUIRED = {
    "mnist-attentive",
    "omniglot-attentive",
    "cifar10-attentive",
    "mnist-baseline",
    "omniglot-baseline",
    "cifar10-baseline",
    "cifar10-performer",
    "mnist-gumbel",
}


def trainable_count(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def test_entries_are_readable_data_files():
    assert REQUIRED <= set(zoo.names())
    for path in REPO_ZOO.glob("*.json"):
        entry = json.loads(path.read_text())
        assert entry["name"] == path.stem
        assert entry["description"] and entry["config"] and entry["training"]


def test_baselines_switch_every_attention_off():
    for name in ("mnist-baseline", "omniglot-baseline", "cifar10-baseline"):
        cfg = zoo.describe(name)["config"]
        assert not cfg["generative_attention"] and not cfg["inference_attention"]
        assert cfg["nonlocal_blocks"] == []
    assert zoo.describe("cifar10-performer")["config"]["nonlocal_attention"] == "performer"


def test_unknown_name_and_override_list_the_valid_ones():
    with pytest.raises(ValueError, match="cifar10-attentive") as info:
        zoo.load("cifar100-attentive")
    assert "cifar100-attentive" in str(info.value)
    with pytest.raises(ValueError, match="num_layers") as info:
        zoo.load("mnist-attentive", num_layer=8)
    assert "num_layer" in str(info.value)


def test_load_with_overrides_builds_an_ordinary_keras_model(tmp_path):
    model = zoo.load("omniglot-attentive", num_layers=2, preprocess_filters=4, decoder_filters=4, seed=3)
    assert model.num_layers == 2 and model.built
    model.summary(print_fn=lambda *a, **k: None)
    path = tmp_path / "w.weights.h5"
    model.save_weights(str(path))
    again = zoo.load("omniglot-attentive", weights=str(path), num_layers=2, preprocess_filters=4, decoder_filters=4)
    for a, b in zip(model.weights, again.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_weights_files_raise_clear_errors(tmp_path):
    small = dict(num_layers=2, preprocess_filters=4, decoder_filters=4)
    with pytest.raises(ValueError, match="not found"):
        zoo.load("mnist-baseline", weights=str(tmp_path / "missing.weights.h5"), **small)
    corrupt = tmp_path / "corrupt.weights.h5"
    corrupt.write_bytes(b"this is not an HDF5 file")
    with pytest.raises(ValueError, match="corrupt"):
        zoo.load("mnist-baseline", weights=str(corrupt), **small)


# Published trainable parameter counts (paper Table 5; OMNIGLOT Sec. 3.1).
PUBLISHED = [
    ("cifar10-attentive", 118.966e6, 0.02),
    ("cifar10-baseline", 79.206e6, 0.02),
    ("omniglot-attentive", 7.87e6, 0.03),
]


@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the same layer code creates the same variables on every backend; counted once, on TensorFlow "
    "(initialising 119M parameters eagerly costs minutes on JAX)",
)
@pytest.mark.parametrize("name,published,tolerance", PUBLISHED)
def test_full_size_parameter_counts_match_the_paper(name, published, tolerance):
    count = trainable_count(keras_avae.zoo.load(name))
    assert abs(count - published) / published < tolerance, (name, count, published)


# ---------------------------------------------------------------------- #
# Pretrained entries: weight files, model cards, and real scores
# ---------------------------------------------------------------------- #

TRAINED = [name for name in zoo.names() if zoo.has_pretrained(name)]
CARD_KEYS = {
    "test_nll_nats",
    "test_nll_stderr",
    "test_images",
    "importance_samples",
    "elbo_nats",
    "bits_per_dim",
    "epochs",
    "steps_per_epoch",
    "batch_size",
    "train_seconds",
    "hardware",
    "backend",
    "train_command",
    "evaluate_command",
}


def test_the_mnist_entries_ship_trained_weights():
    assert {"mnist-attentive-small", "mnist-baseline-small", "mnist-gumbel-small"} <= set(TRAINED)


@pytest.mark.parametrize("name", TRAINED)
def test_weight_files_are_small_and_cards_complete(name):
    entry = zoo.describe(name)
    path = zoo.pretrained_path(name)
    assert path.is_file() and path.suffixes[-2:] == [".weights", ".h5"]
    assert path.stat().st_size < 6e6, "keep shipped weights to a few MB"
    card = entry["results"]
    assert CARD_KEYS <= set(card), CARD_KEYS - set(card)
    assert card["importance_samples"] >= 100 and card["test_images"] >= 1000
    assert f"keras-avae train {name} " in card["train_command"]
    assert f"keras-avae evaluate {name} " in card["evaluate_command"]
    assert card["test_nll_nats"] <= -card["elbo_nats"] + 3 * card["test_nll_stderr"]


def test_pretrained_requests_on_untrained_entries_name_the_trained_ones():
    with pytest.raises(ValueError, match="no pretrained weights") as info:
        zoo.load("cifar10-baseline", weights="pretrained", num_layers=2, preprocess_filters=4, decoder_filters=4)
    assert "mnist-attentive-small" in str(info.value)


def elbo_nats(model, x):
    out = model(keras.ops.convert_to_tensor(x), training=False)
    return float(np.mean(keras.ops.convert_to_numpy(out["nll"]) + keras.ops.convert_to_numpy(out["kl"])))


@pytest.mark.slow
@pytest.mark.skipif(keras.backend.backend() == "torch", reason="zoo models are supported on TensorFlow and JAX")
@pytest.mark.parametrize("name", TRAINED)
def test_pretrained_weights_score_real_digits_like_their_card(name):
    x = keras_avae.datasets.mnist_test_sample(25)
    model = zoo.load(name)  # the default: the shipped weights
    reference = zoo.load(name, weights="pretrained")
    for a, b in zip(model.weights, reference.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    card = zoo.describe(name)["results"]
    trained = elbo_nats(model, x)
    # 25 images: the card's ELBO (1000 images) within a generous sampling margin.
    assert abs(trained - (-card["elbo_nats"])) < 25, (trained, card["elbo_nats"])
    # Fresh weights score far worse: the shipped ones are trained.
    fresh = zoo.load(name, weights=None, seed=1)
    assert elbo_nats(fresh, x) > trained + 100


def _log_weights_under_one_sampling_seed(model, x):
    # The same sampling state in every model, so that only the function
    # itself (weights and random features) can make two results differ.
    state = model.seed_generator.state
    state.assign(keras.ops.convert_to_tensor(np.array([7, 0]), state.dtype))
    out = model(keras.ops.convert_to_tensor(x), training=False)
    return keras.ops.convert_to_numpy(out["nll"]) + keras.ops.convert_to_numpy(out["kl"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in TRAINED if zoo.describe(n)["family"] == "hierarchical_vae"])
def test_every_default_load_is_the_trained_model(name, tmp_path):
    x = keras_avae.datasets.mnist_test_sample(4)
    # Other Python random states before each load: a seed resolved from them
    # (the features of a `seed=None` model) would differ between loads.
    keras.utils.set_random_seed(1)
    first = zoo.load(name)
    keras.utils.set_random_seed(2)
    second = zoo.load(name)
    other_sampling_seed = zoo.load(name, seed=5)
    assert first.nonlocal_feature_seed == zoo.describe(name)["config"]["nonlocal_feature_seed"]
    expected = _log_weights_under_one_sampling_seed(first, x)
    for model in (second, other_sampling_seed):
        np.testing.assert_allclose(_log_weights_under_one_sampling_seed(model, x), expected, rtol=1e-5)
    path = tmp_path / "m.keras"
    first.save(path)
    keras.utils.set_random_seed(3)
    reloaded = keras.models.load_model(path)
    assert reloaded.nonlocal_feature_seed == first.nonlocal_feature_seed
    np.testing.assert_allclose(_log_weights_under_one_sampling_seed(reloaded, x), expected, rtol=1e-5)
