"""Tests of keras_avae.tuning: the search space reaches the model, builds are
deterministic, and a tiny KerasTuner search minimises the validation NELBO
and resumes only with the space it was started with."""

import shutil
import warnings

import keras
import keras_tuner
import numpy as np
import pytest

from keras_avae.tuning import OBJECTIVE, VAEHyperModel

TINY = dict(image_shape=[8, 8, 1], num_scales=1, crop=0, preprocess_cells=1, postprocess_cells=1, cells_per_layer=1)
SPACE = {"num_layers": [1, 2], "latent_channels": [2], "filters": [4, 8], "learning_rate": (1e-3, 1e-2)}


def hyperparameters(**values):
    hp = keras_tuner.HyperParameters()
    for name, value in values.items():
        hp.Fixed(name, value)
    return hp


def test_hyperparameters_reach_the_model():
    hypermodel = VAEHyperModel("mnist-attentive-small", steps_per_epoch=3, search_space=SPACE, overrides=TINY)
    model = hypermodel.build(
        hyperparameters(
            num_layers=2,
            filters=8,
            generative_attention=False,
            inference_attention=True,
            nonlocal_blocks=False,
            learning_rate=0.004,
        )
    )
    assert model.num_layers == 2 and model.preprocess_filters == 8 and model.decoder_filters == 8
    assert not model.generative_attention and model.inference_attention and list(model.nonlocal_blocks) == []
    assert model.optimizer is not None and model.built
    schedule = model.optimizer.inner_optimizer._learning_rate  # the schedule object
    # Warm-up ends at the peak learning rate the search chose.
    peak = float(keras.ops.convert_to_numpy(schedule(3 * 1)))  # warmup_epochs=1, 3 steps per epoch
    assert peak == pytest.approx(0.004, rel=1e-5)

    on = hypermodel.build(hyperparameters(num_layers=1, filters=4, nonlocal_blocks=True))
    assert list(on.nonlocal_blocks) == ["merge", "postprocess"] and on.num_layers == 1


def test_builds_are_deterministic():
    hypermodel = VAEHyperModel("mnist-baseline-small", steps_per_epoch=3, search_space=SPACE, overrides=TINY, seed=5)
    hp = hyperparameters(num_layers=2, filters=4)
    first, second = hypermodel.build(hp), hypermodel.build(hp)
    for a, b in zip(first.weights, second.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="num_stochastic"):
        VAEHyperModel(search_space={"num_stochastic": [2]})
    with pytest.raises(ValueError, match="mnist-gumbel"):
        VAEHyperModel("mnist-gumbel")
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        VAEHyperModel(steps_per_epoch=0)
    with pytest.raises(ValueError, match="steps_per_epoch=True"):
        VAEHyperModel(steps_per_epoch=True)
    for epochs in (0, "2", 2.5):
        with pytest.raises(ValueError, match=rf"Received: epochs={epochs!r}"):
            VAEHyperModel(epochs=epochs)
    for seed in (-1, 2**32, None, 1.5):
        with pytest.raises(ValueError, match=rf"`seed` must be an int.*Received: seed={seed!r}"):
            VAEHyperModel(seed=seed)
    for jit_compile in ("yes", 1):
        with pytest.raises(ValueError, match=rf"Received: jit_compile={jit_compile!r}"):
            VAEHyperModel(jit_compile=jit_compile)
    assert VAEHyperModel(steps_per_epoch=np.int64(10), epochs=np.int64(2)).steps_per_epoch == 10


RANGE, CHOICES, SWITCH = r"\(low, high\) range", "list of positive ints", "list of bools"


@pytest.mark.parametrize(
    "key, value, form, shown",
    [
        ("learning_rate", [1e-3, 3e-3, 1e-2], RANGE, r"\[0\.001, 0\.003, 0\.01\]"),  # choices, not a range
        ("learning_rate", 1e-3, RANGE, r"Received: 0\.001$"),
        ("learning_rate", (1e-2, 1e-3), RANGE, r"\(0\.01, 0\.001\)"),  # low > high
        ("learning_rate", (0.0, 1e-2), RANGE, r"\(0\.0, 0\.01\)"),  # the log scale needs low > 0
        ("learning_rate", ("1e-3", 1e-2), RANGE, r"\('1e-3', 0\.01\)"),
        ("filters", 8, CHOICES, r"Received: 8$"),
        ("filters", [], CHOICES, r"Received: \[\]$"),
        ("filters", [8, 16.5], CHOICES, r"\[8, 16\.5\]"),
        ("num_layers", [0, 2], CHOICES, r"\[0, 2\]"),
        ("latent_channels", "8", CHOICES, r"Received: '8'$"),
        ("latent_channels", [True], CHOICES, r"\[True\]"),
        ("generative_attention", True, SWITCH, r"Received: True$"),
        ("nonlocal_blocks", ["merge"], SWITCH, r"\['merge'\]"),
        ("inference_attention", [0, 1], SWITCH, r"\[0, 1\]"),
    ],
)
def test_bad_search_space_values_are_refused_at_construction(key, value, form, shown):
    with pytest.raises(ValueError, match=rf"search_space\['{key}'\]` must be .*{form}.*{shown}"):
        VAEHyperModel(search_space={key: value})


def test_a_learning_rate_range_below_the_recipes_floor_is_refused_at_construction():
    # Before: accepted, then `build` failed in the schedule for every rate
    # sampled below min_learning_rate (1e-4, the floor it decays to).
    for low in (1e-5, 5e-5):
        with pytest.raises(ValueError, match=r"must not reach below the recipe's min_learning_rate \(0\.0001\)"):
            VAEHyperModel(search_space={"learning_rate": (low, 1e-3)})
    hypermodel = VAEHyperModel(search_space={"learning_rate": (1e-4, 1e-4)}, steps_per_epoch=2)
    hp = keras_tuner.HyperParameters()
    assert hypermodel._recipe(hp)["learning_rate"] == 1e-4


def test_search_space_forms_are_accepted_and_canonical():
    hypermodel = VAEHyperModel(
        search_space={
            "learning_rate": [1e-3, 1e-3],
            "filters": (4, np.int64(8)),
            "nonlocal_blocks": (True,),
            "num_layers": None,
        }
    )
    space = hypermodel.search_space
    assert space["learning_rate"] == (1e-3, 1e-3) and space["filters"] == [4, 8]
    assert space["nonlocal_blocks"] == [True] and "num_layers" not in space
    # A repeated value counts once: both switch values stay searched, no choice is drawn twice as often.
    hypermodel = VAEHyperModel(search_space={"nonlocal_blocks": [False, True, True], "num_layers": [4, 2, 4]})
    assert hypermodel.search_space["nonlocal_blocks"] == [False, True]
    assert hypermodel.search_space["num_layers"] == [4, 2]
    hp = keras_tuner.HyperParameters()
    hypermodel._config(hp)
    kinds = {p.name: type(p).__name__ for p in hp.space}
    assert kinds["nonlocal_blocks"] == "Boolean" and kinds["num_layers"] == "Choice"
    with pytest.raises(ValueError, match=r"`search_space` must be a dict.*\[\('filters', \[4\]\)\]"):
        VAEHyperModel(search_space=[("filters", [4])])


def test_overrides_may_not_set_a_searched_key():
    with pytest.raises(ValueError, match=r"overrides\['num_layers'\]=3 vs search_space\['num_layers'\]=\[2, 4\]"):
        VAEHyperModel(search_space={"num_layers": [2, 4]}, overrides={"num_layers": 3})
    # `filters` sets the encoder and decoder filters; several clashes are all named.
    with pytest.raises(
        ValueError,
        match=r"overrides\['decoder_filters'\]=16 vs search_space\['filters'\]=\[4, 8\].*"
        r"overrides\['nonlocal_blocks'\]=\[\] vs search_space\['nonlocal_blocks'\]=\[False, True\]",
    ):
        VAEHyperModel(search_space={"filters": [4, 8]}, overrides={"decoder_filters": 16, "nonlocal_blocks": []})
    # Not searching the key lets `overrides` fix it, and hp and model agree.
    hypermodel = VAEHyperModel(
        steps_per_epoch=3, search_space=dict(SPACE, num_layers=None), overrides=dict(TINY, num_layers=1)
    )
    hp = keras_tuner.HyperParameters()
    model = hypermodel.build(hp)
    assert model.num_layers == 1 and "num_layers" not in hp.values
    assert hp.values["filters"] == model.preprocess_filters == model.decoder_filters


def test_overrides_of_seed_or_unknown_keys_are_refused_at_construction():
    # Before: accepted here, then the tuner's first `build` failed with
    # "TypeError: zoo.load() got multiple values for keyword argument 'seed'"
    # ('weights' alike), and other unknown keys at that build too.
    with pytest.raises(
        ValueError,
        match=r"`overrides` may not set 'seed'.*VAEHyperModel\(\.\.\., seed=5\).*Received: overrides=\{'seed': 5\}$",
    ):
        VAEHyperModel(overrides={"seed": 5})
    for key in ("weights", "num_layer"):
        with pytest.raises(ValueError, match=rf"Unknown config override\(s\) \['{key}'\].*Received: \{{'{key}': 2\}}"):
            VAEHyperModel(overrides={key: 2})
    # The hypermodel's own `seed` seeds the model.
    model = VAEHyperModel(steps_per_epoch=3, search_space=SPACE, overrides=TINY, seed=5).build(
        hyperparameters(num_layers=1, filters=4)
    )
    assert model.seed == 5


def test_reloaded_trial_weights_restore_the_optimizer(tmp_path):
    # KerasTuner's Hyperband (next round) and `get_best_models` rebuild with
    # `build(hp)` and `load_weights` the trial's checkpoint. Before: the
    # optimizer was unbuilt, its state skipped with a warning, and a resumed
    # Hyperband trial restarted the learning-rate schedule at step 0.
    hypermodel = VAEHyperModel("mnist-baseline-small", steps_per_epoch=4, epochs=2, search_space=SPACE, overrides=TINY)
    hp = hyperparameters(num_layers=1, filters=4, learning_rate=0.004)
    x = (np.random.default_rng(0).random((24, 8, 8, 1)) > 0.5).astype("float32")
    trained = hypermodel.build(hp)
    hypermodel.fit(hp, trained, x, epochs=2, batch_size=6, verbose=0)
    trained.save_weights(tmp_path / "checkpoint.weights.h5")
    reloaded = hypermodel.build(hp)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Skipping variable loading")
        reloaded.load_weights(tmp_path / "checkpoint.weights.h5")
    assert int(keras.ops.convert_to_numpy(reloaded.optimizer.iterations)) == 8
    for a, b in zip(trained.optimizer.variables, reloaded.optimizer.variables):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_fit_refuses_epochs_and_steps_the_schedule_was_not_laid_out_for():
    # Before: the schedule silently ended early or never decayed (e.g. the
    # example's floor(len(x) / batch_size) steps where `fit` runs the ceiling).
    hypermodel = VAEHyperModel("mnist-baseline-small", steps_per_epoch=3, epochs=2, search_space=SPACE, overrides=TINY)
    hp = hyperparameters(num_layers=1, filters=4)
    model = hypermodel.build(hp)
    x = np.zeros((25, 8, 8, 1), "float32")
    with pytest.raises(keras_tuner.errors.FatalValueError, match=r"runs 4 steps per epoch.*steps_per_epoch=3"):
        hypermodel.fit(hp, model, x, epochs=2, batch_size=8)
    with pytest.raises(ValueError, match=r"runs 2 steps per epoch.*Pass VAEHyperModel\(..., steps_per_epoch=2\)"):
        hypermodel.fit(hp, model, x, epochs=2, batch_size=10, validation_split=0.2)  # 20 images train
    for epochs, problem in ((3, "end early"), (1, "never decay")):
        with pytest.raises(ValueError, match=rf"runs epochs={epochs} .* over 2 epochs .*{problem}"):
            hypermodel.fit(hp, model, x, epochs=epochs, batch_size=9)
    with pytest.raises(ValueError, match=r"runs epochs=1 "):  # Keras' default
        hypermodel.fit(hp, model, x, batch_size=9)
    # Hyperband's shorter trials (`tuner/epochs`) are part of its schedule.
    hp.Fixed("tuner/epochs", 1)
    hypermodel.fit(hp, model, x, epochs=1, batch_size=9, verbose=0)


# A resumed tuner (same `directory` and `project_name`, `overwrite=False`)
# reloads its oracle, search space included, from oracle.json.
RESUME_SPACE = dict(
    SPACE, num_layers=[1], filters=[4], generative_attention=[False], inference_attention=[False], nonlocal_blocks=[False]
)
# (search_space, overrides, the difference the error names) against RESUME_SPACE and TINY.
CHANGES = {
    "choices": (dict(RESUME_SPACE, num_layers=[1, 2]), TINY, r"search_space\['num_layers'\] was \[1\], now \[1, 2\]"),
    "range": (
        dict(RESUME_SPACE, learning_rate=(1e-3, 2e-2)),
        TINY,
        r"search_space\['learning_rate'\] was \(0\.001, 0\.01\), now \(0\.001, 0\.02\)",
    ),
    "fixed value": (
        dict(RESUME_SPACE, nonlocal_blocks=[True]),
        TINY,
        r"search_space\['nonlocal_blocks'\] was \[False\], now \[True\]",
    ),
    "fixed to searched": (
        dict(RESUME_SPACE, inference_attention=[False, True]),
        TINY,
        r"search_space\['inference_attention'\] was \[False\], now \[False, True\]",
    ),
    "no longer searched": (
        dict(RESUME_SPACE, learning_rate=None),
        TINY,
        r"search_space\['learning_rate'\] was \(0\.001, 0\.01\), now None",
    ),
    "override": (RESUME_SPACE, dict(TINY, cells_per_layer=2), r"overrides\['cells_per_layer'\] was 1, now 2"),
    "new override": (RESUME_SPACE, dict(TINY, bn_momentum=0.9), r"overrides\['bn_momentum'\] was not set, now 0\.9"),
}
search_on_tensorflow = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the search loop is KerasTuner's, backend-independent; run once, on TensorFlow. "
    "The check in `build(hp)` is tested on every backend",
)


class CountingHyperModel(VAEHyperModel):
    builds = 0

    def build(self, hp):
        CountingHyperModel.builds += 1
        return super().build(hp)


_search_images = (np.random.default_rng(0).random((32, 8, 8, 1)) > 0.5).astype("float32")
SEARCH_TRAIN, SEARCH_VALIDATION = _search_images[:24], _search_images[24:]


def tiny_search(directory, max_trials, search_space=RESUME_SPACE, overrides=TINY):
    """A random search of 1-epoch trials on 24 random 8x8 images, resumed where `directory` holds one."""
    hypermodel = CountingHyperModel(
        "mnist-attentive-small",
        steps_per_epoch=4,
        epochs=1,
        search_space=search_space,
        overrides=overrides,
        jit_compile=False,
    )
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective=OBJECTIVE, max_trials=max_trials, seed=1, directory=directory, project_name="tiny"
    )
    CountingHyperModel.builds = 0
    tuner.search(SEARCH_TRAIN, validation_data=(SEARCH_VALIDATION, None), epochs=1, batch_size=6, verbose=0)
    return tuner


def finished(tuner):
    return {i: (t.hyperparameters.values, t.score) for i, t in tuner.oracle.trials.items() if t.status == "COMPLETED"}


@pytest.fixture(scope="module")
def one_trial_project(tmp_path_factory):
    """The folder of a `tiny_search` project with one finished trial, and that trial."""
    directory = tmp_path_factory.mktemp("tuner")
    return directory, finished(tiny_search(directory, max_trials=1))


@pytest.mark.slow
@search_on_tensorflow
def test_a_resumed_search_with_the_same_space_keeps_its_finished_trials(one_trial_project, tmp_path):
    directory, first = one_trial_project
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    tuner = tiny_search(tmp_path, max_trials=2)
    assert CountingHyperModel.builds == 1  # the new trial only
    trials = finished(tuner)
    assert len(trials) == 2 and {i: trials[i] for i in first} == first
    # The search minimises the validation NELBO, and a trial's score is the
    # validation NELBO of its trained model (reloaded from its checkpoint).
    best_trial = tuner.oracle.get_best_trials(1)[0]
    assert best_trial.score == min(score for _, score in trials.values()) and np.isfinite(best_trial.score)
    logs = tuner.get_best_models(1)[0].evaluate(SEARCH_VALIDATION, batch_size=8, return_dict=True, verbose=0)
    assert logs["nelbo"] == pytest.approx(best_trial.score, rel=0.2)
    # The best configuration rebuilds with a hypermodel of other `epochs` (to retrain it longer).
    best = tuner.get_best_hyperparameters(1)[0]
    retrain = VAEHyperModel("mnist-attentive-small", steps_per_epoch=4, epochs=3, search_space=RESUME_SPACE, overrides=TINY)
    assert retrain.build(best).num_layers == 1


@search_on_tensorflow
@pytest.mark.parametrize("search_space, overrides, shown", CHANGES.values(), ids=CHANGES.keys())
def test_a_resumed_search_with_another_space_is_refused(one_trial_project, tmp_path, search_space, overrides, shown):
    # Before: KerasTuner went on drawing from the space recorded in oracle.json
    # (e.g. num_layers=1 models for a search over [2, 3]) and scored them in the same project.
    shutil.copytree(one_trial_project[0], tmp_path, dirs_exist_ok=True)
    with pytest.raises(keras_tuner.errors.FatalValueError, match=rf"{shown}.*another `project_name`.*overwrite=True"):
        tiny_search(tmp_path, max_trials=3, search_space=search_space, overrides=overrides)
    assert CountingHyperModel.builds == 1  # refused at the first build, before any training


@pytest.mark.slow
@search_on_tensorflow
def test_a_refused_resume_loses_no_finished_trial(one_trial_project, tmp_path):
    directory, first = one_trial_project
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    search_space, overrides, shown = CHANGES["choices"]
    with pytest.raises(ValueError, match=shown):
        tiny_search(tmp_path, max_trials=3, search_space=search_space, overrides=overrides)
    # Resumed with the arguments it was started with, the search keeps its
    # finished trial and runs the one the refused resume had begun.
    tuner = tiny_search(tmp_path, max_trials=2)
    assert CountingHyperModel.builds == 1
    trials = finished(tuner)
    assert len(trials) == 2 and {i: trials[i] for i in first} == first


@pytest.mark.parametrize("search_space, overrides, shown", CHANGES.values(), ids=CHANGES.keys())
def test_hyperparameters_from_another_search_are_refused(search_space, overrides, shown):
    # The hyperparameters a tuner records when it starts (it builds once on an
    # empty space), as its trials and `get_best_hyperparameters` carry them.
    hp = keras_tuner.HyperParameters()
    VAEHyperModel(steps_per_epoch=4, search_space=RESUME_SPACE, overrides=TINY).build(hp)
    other = VAEHyperModel(steps_per_epoch=4, search_space=search_space, overrides=overrides)
    with pytest.raises(keras_tuner.errors.FatalValueError, match=shown):
        other.build(hp)
    # Their values alone build with any hypermodel, as the error says; the same
    # search space, entry and overrides with another schedule build as they are.
    values_only = keras_tuner.HyperParameters()
    values_only.values = dict(hp.values)
    assert other.build(values_only).num_layers == 1
    retrain = VAEHyperModel(steps_per_epoch=7, epochs=3, seed=2, search_space=RESUME_SPACE, overrides=TINY)
    assert retrain.build(hp).num_layers == 1
