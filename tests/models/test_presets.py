"""Presets the keras-hub way: `from_preset`, `save_to_preset`, `presets`, run folders.

That every public path, presets included, gives the trained model of each
shipped weight file is `tests/models/test_zoo.py::test_every_default_load_is_the_trained_model`.
"""

import json

import keras
import numpy as np
import pytest

import keras_avae
from keras_avae import zoo
from keras_avae.models import DiscreteVAE
from keras_avae.models import HierarchicalVAE
from tests.test_training import TINY

BACKEND = keras.backend.backend()


def weights_equal(a, b):
    return len(a.weights) == len(b.weights) and all(
        np.array_equal(keras.ops.convert_to_numpy(u), keras.ops.convert_to_numpy(v)) for u, v in zip(a.weights, b.weights)
    )


def test_presets_list_the_zoo_entries_of_each_class():
    hierarchical, discrete = HierarchicalVAE.presets, DiscreteVAE.presets
    assert set(hierarchical) | set(discrete) == set(zoo.names())
    assert not set(hierarchical) & set(discrete)
    assert hierarchical["mnist-attentive"] == zoo.describe("mnist-attentive")["description"]
    assert "mnist-gumbel-small" in discrete


def test_preset_errors_name_what_was_received(tmp_path):
    with pytest.raises(ValueError, match="is a HierarchicalVAE, not a DiscreteVAE"):
        DiscreteVAE.from_preset("mnist-baseline-small")
    with pytest.raises(ValueError, match="no trained weights.*load_weights=False"):
        HierarchicalVAE.from_preset("cifar10-attentive")
    with pytest.raises(ValueError, match="zoo entry of HierarchicalVAE.*preset='no-such-preset'"):
        HierarchicalVAE.from_preset("no-such-preset")
    with pytest.raises(ValueError, match="neither config.json.*nor run.json"):
        HierarchicalVAE.from_preset(tmp_path)


def test_save_to_preset_round_trip(tmp_path):
    model = HierarchicalVAE.from_preset("mnist-baseline-small")
    assert weights_equal(model, zoo.load("mnist-baseline-small"))
    model.save_to_preset(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "metadata.json", "model.weights.h5"]
    metadata = json.loads((tmp_path / "metadata.json").read_text())
    assert metadata["keras_version"] == keras.__version__
    assert metadata["keras_avae_version"] == keras_avae.__version__
    assert metadata["parameter_count"] == model.count_params()
    card = metadata["model_card"]
    assert card["name"] == "mnist-baseline-small"
    assert card["results"] == zoo.describe("mnist-baseline-small")["results"]
    restored = HierarchicalVAE.from_preset(tmp_path, seed=3)  # a neutral override keeps the weights
    assert weights_equal(restored, model) and restored.seed == 3
    assert restored.get_config()["num_layers"] == model.get_config()["num_layers"]
    with pytest.raises(ValueError, match=r"num_layers=2 \(preset: 4\)"):
        HierarchicalVAE.from_preset(tmp_path, num_layers=2)
    with pytest.raises(ValueError, match="Unknown config override"):
        HierarchicalVAE.from_preset(tmp_path, num_layer=2)
    fresh = HierarchicalVAE.from_preset(tmp_path, load_weights=False, num_layers=2)
    assert fresh.num_layers == 2
    with pytest.raises(ValueError, match="is a HierarchicalVAE, not a DiscreteVAE"):
        DiscreteVAE.from_preset(tmp_path)
    # A fresh model has no card.
    fresh.save_to_preset(tmp_path / "fresh")
    assert json.loads((tmp_path / "fresh" / "metadata.json").read_text())["model_card"] is None


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the run folder's files do not depend on the backend")
def test_a_run_folder_loads_as_a_preset(tmp_path):
    from keras_avae import training

    x = (np.random.default_rng(0).random((16, 8, 8, 1)) > 0.5).astype("float32")
    kwargs = dict(batch_size=8, config_overrides=TINY, verbose=0, jit_compile=False, tensorboard=False, num_images=2)
    trained = training.train("mnist-baseline", x, tmp_path / "run", epochs=1, **kwargs)
    loaded = HierarchicalVAE.from_preset(tmp_path / "run")
    assert weights_equal(loaded, trained) and loaded.num_layers == TINY["num_layers"]
    (tmp_path / "run" / "model.weights.h5").unlink()  # as in a run that has not finished
    with pytest.raises(ValueError, match="the run has not finished"):
        HierarchicalVAE.from_preset(tmp_path / "run")
