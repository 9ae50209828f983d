"""`keras-avae report` and `keras_avae.report`: the numbers behind every figure.

The report of a tiny attentive model is written once per module; each test
checks that what a figure's JSON holds is what `keras_avae.inspection` and
the model's own methods give on the same images and seeds, that the page
references exactly the files written, and (slow, with a headless Chromium)
that every image of the page loads.
"""

import csv
import html.parser
import json
import math
import os
import shutil
import subprocess

import numpy as np
import pytest

from keras_avae import inspection
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from keras_avae.report import builder
from keras_avae.report import figures
from keras_avae.report import read_history
from keras_avae.report import write_report
from keras_avae.report.artifacts import jsonable
from tests.models import test_hierarchical_vae
from tests.models.test_hierarchical_vae import shapes_batch
from tests.test_case import backend_independent

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
pytestmark = pytest.mark.skipif(BACKEND == "torch", reason="the report is tested on TensorFlow and JAX")

# The hierarchical VAE tests' tiny model, with one non-local place and a crop.
TINY = dict(test_hierarchical_vae.TINY, nonlocal_blocks=("merge",), crop=1, seed=3)
SEED = 5
BATCH = 5  # images per pass: the posterior samples depend on the batching
TEMPERATURES = (0.6, 1.0)
QUERY_PIXELS = [(2, 2), (5, 6)]
HISTORY = """epoch,bits_per_dim,kl,kl_0,kl_1,kl_2,loss,nelbo,reconstruction
1,0.5,12.5,4.0,5.5,3.0,40.25,52.0,39.5
2,0.4,10.0,3.0,,2.0,35.0,45.5,35.5
"""


def tiny_model(**overrides):
    model = HierarchicalVAE(**{**TINY, **overrides})
    model.build()
    # Non-zero gates and non-local scales, so the attention reaches the output.
    for gate in [cell.gate for cell in model.prior_cells + model.posterior_cells if cell.gate is not None]:
        gate.assign(0.5)
    for block in inspection.nonlocal_blocks(model).values():
        block.gamma.assign(0.3)
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A report of the tiny model on 12 images, with a run folder's history."""
    root = tmp_path_factory.mktemp("report")
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "history.csv").write_text(HISTORY)
    model = tiny_model()
    x = shapes_batch(12)
    result = write_report(
        model,
        x,
        root / "out",
        run_dir=run_dir,
        name="tiny-attentive",
        query_pixels=QUERY_PIXELS,
        temperatures=TEMPERATURES,
        num_samples=4,
        num_reconstructions=6,
        num_interpolations=3,
        interpolation_steps=5,
        seed=SEED,
        batch_size=BATCH,
        progress=False,
    )
    return {"model": model, "x": x, "result": result, "out": root / "out", "run_dir": run_dir}


def numbers(written, name):
    with open(written["out"] / f"{name}.json") as f:
        return json.load(f)


def as_array(value):
    return np.array(value, dtype="float32")


def close(actual, expected):
    np.testing.assert_allclose(as_array(actual), np.asarray(expected, "float32"), rtol=1e-5, atol=1e-6)


def crop(images, pixels=TINY["crop"]):
    return np.asarray(images)[..., pixels:-pixels, pixels:-pixels, :]


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.tags, self.text = [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "a":
            self.links.append(attrs["href"])

    def handle_data(self, data):
        self.text.append(data)


def parse_page(path):
    page = _Page()
    page.feed(path.read_text())
    return page


# ---------------------------------------------------------------------- #
# The JSON of each figure is the API's numbers
# ---------------------------------------------------------------------- #


def test_kl_and_active_units_are_the_inspection_numbers(written):
    model, x = written["model"], written["x"]
    with builder._seeded(model, SEED, builder._STREAMS["kl_per_layer"]):
        kl = inspection.kl_per_layer(model, x, batch_size=BATCH)
    with builder._seeded(model, SEED, builder._STREAMS["active_units"]):
        active = inspection.active_units(model, x, batch_size=BATCH)
    drawn = numbers(written, "kl_per_layer")
    close(drawn["kl_mean"], kl.mean(axis=0))
    close(drawn["kl_stderr"], kl.std(axis=0, ddof=1) / math.sqrt(len(x)))
    assert drawn["num_images"] == 12 and drawn["layers"] == [0, 1, 2]
    assert drawn["active"] == active["active"].tolist() and drawn["units"] == active["units"]
    assert drawn["threshold"] == 0.01
    # KL is non-negative and the layers are used by a fresh model.
    assert min(drawn["kl_mean"]) >= 0 and sum(drawn["kl_mean"]) > 0


def test_attention_matrices_are_the_inspection_numbers_and_rows_sum_to_1(written):
    model, x = written["model"], written["x"]
    with builder._seeded(model, SEED, builder._STREAMS["depthwise_attention"]):
        attention = inspection.depthwise_attention(model, x, batch_size=BATCH)
    drawn = numbers(written, "depthwise_attention")
    assert sorted(drawn) == ["generative", "inference"]
    L = TINY["num_layers"]
    for kind in ("generative", "inference"):
        close(drawn[kind]["matrix"], attention[kind]["matrix"])
        close(drawn[kind]["gates"], attention[kind]["gates"])
    generative, inference = as_array(drawn["generative"]["matrix"]), as_array(drawn["inference"]["matrix"])
    assert generative.shape == (L, L) and inference.shape == (L, L + 1)
    # Generative: row 0 does not attend; row l spreads 1 over the layers above it.
    np.testing.assert_array_equal(generative[0], 0)
    np.testing.assert_allclose(generative[1:].sum(axis=1), 1, atol=1e-5)
    assert np.all(np.triu(generative) == 0)
    # Inference: every row sums to 1 over columns l..L, zeros left of the diagonal.
    np.testing.assert_allclose(inference.sum(axis=1), 1, atol=1e-5)
    assert all(np.all(inference[l, :l] == 0) for l in range(L))
    assert drawn["generative"]["gates"] == [0.0, 0.5, 0.5] and drawn["inference"]["gates"] == [0.5] * L
    # The cells drawn as attended are the model's structure.
    np.testing.assert_array_equal(drawn["generative"]["attended"], np.tril(np.ones((L, L), bool), k=-1))
    np.testing.assert_array_equal(drawn["inference"]["attended"], np.triu(np.ones((L, L + 1), bool)))


def test_an_attended_weight_that_rounds_to_0_is_drawn_not_greyed(tmp_path, monkeypatch):
    # Before: cells were greyed where the mean weight was 0, as if layer 2
    # could not attend to layer 0 when softmax gave it (in float32) nothing.
    matrix = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0]], "float32")
    drawn = {}
    heatmap = figures._heatmap

    def recording(axes, matrix, attended, *args):
        image = heatmap(axes, matrix, attended, *args)
        drawn["mask"] = np.ma.getmaskarray(image.get_array())
        drawn["labels"] = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in axes.texts}
        return image

    monkeypatch.setattr(figures, "_heatmap", recording)
    for attention in ({"matrix": matrix, "gates": np.zeros(3)},  # the structure by default
                      {"matrix": matrix, "gates": np.zeros(3), "attended": np.tril(np.ones((3, 3), bool), k=-1)}):
        record = figures.depthwise_attention({"generative": attention}, tmp_path)
        np.testing.assert_array_equal(drawn["mask"], np.triu(np.ones((3, 3), bool)))
        assert drawn["labels"] == {(1, 0): "1.00", (2, 0): "0.00", (2, 1): "1.00"}
        saved = json.loads((tmp_path / record["json"]).read_text())["generative"]
        assert saved["attended"] == [[False, False, False], [True, False, False], [True, True, False]]
    with pytest.raises(ValueError, match=r"\['attended'\]` must have the shape of its matrix, \(3, 3\). Received: shape \(2,\)"):
        figures.depthwise_attention({"generative": {**attention, "attended": [True, False]}}, tmp_path)


def test_nonlocal_maps_are_the_inspection_numbers(written):
    model, x = written["model"], written["x"]
    with builder._seeded(model, SEED, builder._STREAMS["nonlocal_attention"]):
        blocks = inspection.nonlocal_attention(model, x[:1], QUERY_PIXELS, batch_size=BATCH)
    drawn = numbers(written, "nonlocal_attention")
    assert drawn["query_pixels"] == [list(q) for q in QUERY_PIXELS] and drawn["crop"] == TINY["crop"]
    close(drawn["image"], x[0])
    assert list(drawn["blocks"]) == list(blocks) and len(blocks) == 2 * (TINY["num_layers"] - 1) + 1
    for name, block in blocks.items():
        maps = as_array(drawn["blocks"][name]["maps"])
        close(maps, block["maps"][0])
        np.testing.assert_allclose(maps.sum(axis=(1, 2)), 1, atol=1e-5)
        assert drawn["blocks"][name]["query_pixels"] == [list(q) for q in block["query_pixels"]]
        assert drawn["blocks"][name]["gamma"] == pytest.approx(0.3)
        assert drawn["blocks"][name]["attention"] == "softmax"


def test_sample_grids_are_the_models_samples_with_and_without_readjustment(written):
    model = written["model"]
    drawn = numbers(written, "samples")
    assert [(g["temperature"], g["readjust_batch_norm"]) for g in drawn["grids"]] == [
        (t, r) for t in TEMPERATURES for r in (False, True)
    ]
    for index, grid in enumerate(drawn["grids"]):
        temperature, readjust = grid["temperature"], grid["readjust_batch_norm"]
        with builder._seeded(model, SEED, builder._STREAMS["samples"] + index // 2):
            samples = model.sample(4, temperature=temperature, readjust_batch_norm=readjust)
        close(grid["images"], crop(samples))
    # Different temperatures and the re-adjustment change the images.
    images = [as_array(g["images"]) for g in drawn["grids"]]
    assert all(not np.array_equal(images[0], other) for other in images[1:])
    assert drawn["pixel_range"] == [0.0, 1.0] and as_array(drawn["grids"][0]["images"]).shape == (4, 6, 6, 1)


def test_reconstructions_and_interpolations_are_the_api_numbers(written):
    model, x = written["model"], written["x"]
    with builder._seeded(model, SEED, builder._STREAMS["reconstructions"]):
        reconstructions = model.reconstruct(x[:6])
    drawn = numbers(written, "reconstructions")
    close(drawn["inputs"], crop(x[:6]))
    close(drawn["reconstructions"], crop(reconstructions))
    assert drawn["indices"] == list(range(6))

    with builder._seeded(model, SEED, builder._STREAMS["interpolations"]):
        path = inspection.interpolate(model, x[[0, 2, 4]], x[[1, 3, 5]], steps=5)
    drawn = numbers(written, "interpolations")
    assert drawn["pairs"] == [[0, 1], [2, 3], [4, 5]] and drawn["steps"] == 5
    close(drawn["images"], crop(path))


def test_figures_do_not_depend_on_the_generators_state_which_is_restored(written, tmp_path):
    model = written["model"]
    model.sample(3)  # moves the model's seed generator
    state = np.asarray(model.seed_generator.state.value).copy()
    again = write_report(model, written["x"][:4], tmp_path, temperatures=(1.0,), num_samples=4, seed=SEED,
                         progress=False)
    np.testing.assert_array_equal(np.asarray(model.seed_generator.state.value), state)
    assert "training_curves" in again["skipped"] and "training_curves" not in again["figures"]
    # The grids of temperature k are drawn from stream `samples + k`,
    # whatever ran before them.
    model.sample(2)
    drawn = json.loads((tmp_path / "samples.json").read_text())["grids"]
    assert [(g["temperature"], g["readjust_batch_norm"]) for g in drawn] == [(1.0, False), (1.0, True)]
    with builder._seeded(model, SEED, builder._STREAMS["samples"]):
        close(drawn[1]["images"], crop(model.sample(4, temperature=1.0, readjust_batch_norm=True)))


def test_the_same_seed_at_the_same_batch_size_gives_the_same_report(written, tmp_path):
    """Every JSON figure is the same when written again (the KL and attention draws follow the batches)."""
    model, x = written["model"], written["x"][:4]

    def report(folder):
        write_report(model, x, tmp_path / folder, temperatures=(1.0,), num_samples=2, num_reconstructions=2,
                     num_interpolations=1, interpolation_steps=2, seed=SEED, batch_size=2, progress=False)
        return {path.name: path.read_text() for path in (tmp_path / folder).glob("*.json")}

    first = report("a")
    assert {"kl_per_layer.json", "depthwise_attention.json"} <= set(first)
    assert report("b") == first


# ---------------------------------------------------------------------- #
# Training curves
# ---------------------------------------------------------------------- #


def read_csv_columns(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {key: [float(r[key]) if r[key] != "" else None for r in rows] for key in rows[0]}


def test_a_history_row_cut_inside_its_last_field_is_not_read(tmp_path):
    # Before: it had the header's field count, so "3,...,3" was drawn as epoch 3's 3.0 nats.
    (tmp_path / "history.csv").write_text(HISTORY + "3,0.3,9.0,3.0,3.0,3.0,30.0,42.0,3")
    history = read_history(tmp_path)
    assert history["epoch"] == [1, 2] and history["reconstruction"] == [39.5, 35.5]


def test_training_curves_are_the_history_csv(written):
    drawn = numbers(written, "training_curves")
    expected = read_csv_columns(written["run_dir"] / "history.csv")
    assert sorted(drawn) == ["epoch", "kl", "kl_0", "kl_1", "kl_2", "loss", "nelbo", "reconstruction"]
    for key, values in drawn.items():
        assert values == expected[key], key
    assert drawn["kl_1"] == [5.5, None]  # an empty cell is null, never NaN


@pytest.mark.slow
@backend_independent("history.csv is written the same way on every backend; each backend's training is tested elsewhere")
def test_training_curves_of_a_real_training_run(tmp_path):
    from keras_avae import training

    x = shapes_batch(16)
    run_dir = tmp_path / "run"
    training.train(
        "mnist-baseline",
        x,
        str(run_dir),
        epochs=2,
        batch_size=8,
        config_overrides=dict(
            image_shape=[8, 8, 1], num_layers=2, preprocess_filters=4, decoder_filters=4, num_scales=1, crop=0
        ),
        verbose=0,
    )
    record = figures.training_curves(read_history(run_dir), tmp_path)
    drawn = json.loads((tmp_path / record["json"]).read_text())
    expected = read_csv_columns(run_dir / "history.csv")
    assert drawn["epoch"] == [1, 2]
    assert {"loss", "nelbo", "kl", "kl_0", "kl_1"} <= set(drawn)
    for key in set(drawn) - {"epoch"}:
        assert drawn[key] == expected[key], key
    assert all(math.isfinite(v) for v in drawn["nelbo"])


def test_missing_history_names_the_path(tmp_path):
    model = tiny_model()
    with pytest.raises(FileNotFoundError, match="history.csv") as error:
        write_report(model, shapes_batch(4), tmp_path / "out", run_dir=tmp_path, progress=False)
    assert str(tmp_path / "history.csv") in str(error.value)
    assert not (tmp_path / "out").exists()  # refused before anything was computed or written


def test_a_run_folder_of_another_model_is_refused_naming_it(tmp_path):
    # Before: its history.csv was drawn as this model's training curves, silently.
    model = tiny_model()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "history.csv").write_text(HISTORY)
    config = {k: v for k, v in model.get_config().items() if k != "name"}
    # Another architecture; the feature seed and the sampling seed are not architecture.
    other = dict(config, num_layers=config["num_layers"] + 1, nonlocal_feature_seed=7, seed=9)
    (run_dir / "run.json").write_text(json.dumps({"model": "tiny", "config": other}, default=str))
    with pytest.raises(ValueError, match="run_dir") as error:
        write_report(model, shapes_batch(4), tmp_path / "out", run_dir=run_dir, progress=False)
    message = str(error.value)
    assert str(run_dir) in message and "num_layers" in message
    assert "nonlocal_feature_seed" not in message and "seed=" not in message.split("Received")[0]
    assert not (tmp_path / "out").exists()  # refused before anything was computed or written

    from keras_avae.report.history import check_run_trained

    (run_dir / "run.json").write_text(json.dumps({"model": "tiny", "config": config}, default=str))
    check_run_trained(run_dir, model)  # the run that trained it: no error


# ---------------------------------------------------------------------- #
# The page
# ---------------------------------------------------------------------- #


def test_page_references_every_figure_and_nothing_missing(written):
    out = written["out"]
    page = parse_page(out / "index.html")
    pngs = sorted(p.name for p in out.glob("*.png"))
    jsons = sorted(p.name for p in out.glob("*.json"))
    expected = ["depthwise_attention", "interpolations", "kl_per_layer", "nonlocal_attention", "reconstructions",
                "samples", "training_curves"]
    assert pngs == [f"{n}.png" for n in expected] and jsons == [f"{n}.json" for n in expected]
    assert sorted(page.images) == pngs
    assert sorted(link for link in page.links if not link.startswith("#")) == jsons
    assert sorted(written["result"]["figures"]) == expected and written["result"]["skipped"] == {}
    # Offline: no scripts, no style sheets or fonts to fetch, no absolute URLs.
    assert "script" not in page.tags and "link" not in page.tags
    assert not any("//" in ref for ref in page.images + page.links)
    text = " ".join(page.text)
    assert "tiny-attentive" in text and "12 images" in text and f"{written['model'].count_params():,} in all" in text
    # The KL and attention numbers follow the batch size: the page must say it beside the seed.
    assert f"seed {SEED} batch size {BATCH} images per pass" in " ".join(text.split())
    # Every figure has a caption saying what it shows.
    assert text.count("The numbers drawn") == len(expected)


@backend_independent("which figures a page holds")
def test_baseline_without_attention_or_nonlocal_blocks_says_so(tmp_path):
    model = tiny_model(generative_attention=False, inference_attention=False, nonlocal_blocks=())
    # An earlier report's figure in the same folder must not stay beside this page.
    (tmp_path / "depthwise_attention.png").write_bytes(b"stale")
    (tmp_path / "training_curves.json").write_text("{}")
    # The staging folder of a report killed outright (no `finally`): its process is gone.
    killed = tmp_path / ".partial-report-999999999"
    killed.mkdir()
    (killed / "samples.png").write_bytes(b"half")
    result = write_report(model, shapes_batch(4), tmp_path, temperatures=(1.0,), num_samples=4, progress=False)
    assert not (tmp_path / "depthwise_attention.png").exists() and not (tmp_path / "training_curves.json").exists()
    assert not list(tmp_path.glob(".partial-report-*"))
    assert sorted(result["figures"]) == ["interpolations", "kl_per_layer", "reconstructions", "samples"]
    assert sorted(result["skipped"]) == ["depthwise_attention", "nonlocal_attention", "training_curves"]
    page = parse_page(tmp_path / "index.html")
    text = " ".join(page.text)
    assert "no depth-wise attention" in text and "no non-local blocks" in text and "No run folder" in text
    assert sorted(page.images) == sorted(p.name for p in tmp_path.glob("*.png"))


def test_discrete_vae_and_bad_arguments_are_refused(tmp_path):
    from keras_avae import zoo

    gumbel = zoo.load("mnist-gumbel-small", weights=None)
    with pytest.raises(ValueError, match="HierarchicalVAE.*DiscreteVAE"):
        write_report(gumbel, np.zeros((2, 32, 32, 1)), tmp_path)
    model = tiny_model()
    x = shapes_batch(4)
    with pytest.raises(ValueError, match=r"query_pixels.*\(9, 0\)"):
        write_report(model, x, tmp_path, query_pixels=[(9, 0)])
    with pytest.raises(ValueError, match="temperatures"):
        write_report(model, x, tmp_path, temperatures=(0.5, 0.0))
    # A repeated temperature was drawn over the first's panel.
    with pytest.raises(ValueError, match=r"must not repeat a value. Received: temperatures=\(0.8, 1.0, 0.8\)"):
        write_report(model, x, tmp_path, temperatures=(0.8, 1.0, 0.8))
    with pytest.raises(ValueError, match="at least 2 images"):
        write_report(model, x[:1], tmp_path)
    with pytest.raises(ValueError, match=r"images"):
        write_report(model, x * 2, tmp_path)
    # Before: a TypeError naming nothing, and float or bool pixels truncated to ints.
    with pytest.raises(ValueError, match=r"`temperatures` must be a list of temperatures. Received: temperatures=0.5"):
        write_report(model, x, tmp_path, temperatures=0.5)
    for pixels in ([(6.7, 3.9)], [(True, 3)], [(1, 2, 3)]):
        with pytest.raises(ValueError, match=r"`query_pixels` must be \(row, col\) pairs of ints"):
            write_report(model, x, tmp_path, query_pixels=pixels)
    assert not list(tmp_path.iterdir())


def test_a_rerun_stopped_part_way_leaves_the_earlier_report_as_it_was(tmp_path, monkeypatch):
    # Before: the earlier page was deleted first and its figures overwritten one
    # by one, so a stopped rerun lost the earlier report (and left a mix).
    earlier = {"index.html": b"<html>an earlier model's report</html>", "kl_per_layer.json": b"{}",
               "kl_per_layer.png": b"png", "samples.json": b"{}", "notes.txt": b"the user's"}
    for file, data in earlier.items():
        (tmp_path / file).write_bytes(data)

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(figures, "depthwise_attention", stop)
    with pytest.raises(KeyboardInterrupt):
        write_report(tiny_model(), shapes_batch(4), tmp_path, seed=np.int64(3), progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier  # no staging folder left either


def test_an_out_dir_that_is_a_file_is_refused_naming_it(tmp_path):
    # Before: mkdir's "[Errno 17] File exists", naming neither `out_dir` nor the problem.
    page = tmp_path / "report.html"
    page.write_text("mine")
    with pytest.raises(ValueError, match=r"`out_dir` must be a folder.*not a file. Received: out_dir='.*report.html'"):
        write_report(tiny_model(), shapes_batch(4), page, progress=False)
    assert page.read_text() == "mine"
    # A new folder named like a page: the user meant a file, and would find a folder.
    with pytest.raises(ValueError, match=r"named like a page file is refused. Pass a folder, e.g. out_dir='.*new'. "
                       r"Received: out_dir='.*new.HTML'"):
        write_report(tiny_model(), shapes_batch(4), tmp_path / "new.HTML", progress=False)
    assert not (tmp_path / "new.HTML").exists()


def test_jsonable_is_strict_json_with_exact_float32():
    values = np.array([0.1, 1 / 3, 1e-8, np.nan, np.inf, -2.5], "float32")
    text = json.dumps(jsonable({"v": values, "n": np.int64(3), "t": (np.float32(0.5), None)}), allow_nan=False)
    loaded = json.loads(text)
    assert loaded["v"][3:5] == [None, None] and loaded["n"] == 3 and loaded["t"] == [0.5, None]
    finite = np.isfinite(values)
    np.testing.assert_array_equal(np.array([v for v in loaded["v"] if v is not None], "float32"), values[finite])
    assert "0.1," in text  # the shortest form, not 0.10000000149011612


# ---------------------------------------------------------------------- #
# Command line
# ---------------------------------------------------------------------- #


@pytest.mark.slow
@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="the command's own code is backend-independent; the report's numbers are checked on JAX above",
)
def test_report_command_end_to_end(tmp_path, capsys):
    from keras_avae import cli, zoo
    from tests.test_cli import TINY_SETS, sets
    from tests.test_datasets import make_mnist_dir

    data = tmp_path / "mnist"
    make_mnist_dir(data, n_train=4, n_test=6)
    overrides = dict(
        num_layers=2, latent_channels=2, preprocess_filters=4, decoder_filters=4, generative_attention_dim=2,
        inference_attention_dim=4, nonlocal_key_dim=2, nonlocal_num_random_features=4, seed=0,
    )
    weights = tmp_path / "tiny.weights.h5"
    zoo.load("mnist-attentive-small", weights=None, **overrides).save_weights(str(weights))
    set_args = sets(TINY_SETS + ["generative_attention_dim=2", "inference_attention_dim=4", "nonlocal_key_dim=2",
                                 "nonlocal_num_random_features=4"])
    out = tmp_path / "report"
    argv = ["report", "mnist-attentive-small", "--weights", str(weights), "--data-dir", str(data), "--out",
            str(out), "--num-images", "5", "--num-samples", "4", "--temperatures", "0.7", "1", "--seed", "2",
            "--every", "1"]
    status = cli.main(argv + set_args)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "Wrote" in captured.err and "index.html" in captured.err
    page = parse_page(out / "index.html")
    assert sorted(page.images) == sorted(p.name for p in out.glob("*.png")) and len(page.images) == 6
    text = " ".join(page.text)
    assert "mnist-attentive-small" in text and "first 5 images of the mnist test split" in text
    kl = json.loads((out / "kl_per_layer.json").read_text())
    assert kl["num_images"] == 5 and len(kl["kl_mean"]) == 2
    samples = json.loads((out / "samples.json").read_text())
    assert [g["temperature"] for g in samples["grids"]] == [0.7, 0.7, 1.0, 1.0]
    assert as_array(samples["grids"][0]["images"]).shape == (4, 28, 28, 1)  # cropped to the digits

    # Mistakes: one line, status 2.
    status = cli.main(argv + set_args + ["--run", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and "history.csv" in err and len(err.strip().splitlines()) == 1
    status = cli.main(["report", "mnist-gumbel-small", "--weights", "pretrained", "--data-dir", str(data),
                       "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and "hierarchical VAE" in err and len(err.strip().splitlines()) == 1
    # A run of the same entry with another architecture (its own --set): refused by name, before the data load.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "history.csv").write_text(HISTORY)
    record = {"model": "mnist-attentive-small", "config": zoo.config("mnist-attentive-small")}
    (run_dir / "run.json").write_text(json.dumps(record))
    status = cli.main(argv + set_args + ["--run", str(run_dir)])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert f"`--run` {str(run_dir)!r} trained another architecture" in err and "num_layers=" in err
    status = cli.main(argv[:4] + ["--data-dir", str(data), "--out", str(tmp_path / "page.html")])
    err = capsys.readouterr().err
    assert status == 2 and f"Pass a folder, e.g. --out {str(tmp_path / 'page')!r}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "page.html").exists()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the command's own code is backend-independent")
def test_report_command_names_the_images_and_the_pretrained_weights_file(tmp_path, capsys, monkeypatch):
    # Before: the header said "weights: pretrained", not which file.
    from keras_avae import cli, report
    from tests.test_datasets import make_mnist_dir

    make_mnist_dir(tmp_path, n_train=4, n_test=7)
    written = {}

    def record(model, images, out_dir, **kwargs):
        written.update(kwargs["info"], drawn=images)
        return {"index": str(out_dir), "figures": {}, "skipped": {}, "seconds": 0.0}

    monkeypatch.setattr(report, "write_report", record)
    argv = ["report", "mnist-attentive-small", "--weights", "pretrained", "--data-dir", str(tmp_path), "--out",
            str(tmp_path / "report"), "--every", "3"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert written["weights"] == "the zoo's pretrained mnist-attentive-small.weights.h5"
    assert written["images"].startswith("the first 3 of images 0, 3, 6, ... of the mnist test split")
    assert len(written["drawn"]) == 3


# ---------------------------------------------------------------------- #
# In a browser
# ---------------------------------------------------------------------- #

_CHECK_SCRIPT = """
<script>
window.addEventListener("load", function () {
  var rows = [];
  document.querySelectorAll("img").forEach(function (img) {
    rows.push([img.getAttribute("src"), img.complete, img.naturalWidth]);
  });
  var out = document.createElement("pre");
  out.id = "image-check";
  out.textContent = JSON.stringify(rows);
  document.body.appendChild(out);
});
</script>
"""


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium here (Debian: apt-get install chromium)")
def test_every_image_loads_in_a_headless_browser(written, tmp_path):
    # A copy of the report folder whose page reports, once loaded, each
    # image's natural width; one extra image points at a missing file, to
    # show that the check sees a failed load.
    folder = tmp_path / "copy"
    shutil.copytree(written["out"], folder)
    page = (folder / "index.html").read_text()
    probe = '<img src="no-such-figure.png">' + _CHECK_SCRIPT
    (folder / "check.html").write_text(page.replace("</body>", probe + "</body>"))
    command = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--dump-dom",
        (folder / "check.html").as_uri(),
    ]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120).stdout
    start = dom.index('<pre id="image-check">') + len('<pre id="image-check">')
    rows = json.loads(html.unescape(dom[start : dom.index("</pre>", start)]))
    widths = {src: width for src, _, width in rows}
    assert widths.pop("no-such-figure.png") == 0
    assert sorted(widths) == sorted(parse_page(written["out"] / "index.html").images) and len(widths) == 7
    assert all(width > 0 for width in widths.values()), widths


@pytest.mark.parametrize("split", ["train", "test"])
def test_load_images_reads_the_first_images_of_either_split_in_any_batch_size(tmp_path, split):
    # The train split's default drop_remainder lost a last partial batch
    # (30 images in batches of 20 gave 20; a split smaller than a batch failed).
    from keras_avae.report import load_images
    from tests.test_datasets import make_mnist_dir

    make_mnist_dir(tmp_path, n_train=7, n_test=7)
    everything, text = load_images("mnist", tmp_path, split, num_images=500)
    assert everything.shape == (7, 32, 32, 1) and f"first 7 images of the mnist {split} split" in text
    for num_images, batch_size in ((5, 2), (7, 3), (20, 4)):
        images, _ = load_images("mnist", tmp_path, split, num_images=num_images, batch_size=batch_size)
        np.testing.assert_array_equal(images, everything[:num_images])
    # Spread over the split: the same binary images as the whole split's, every 3rd.
    spread, text = load_images("mnist", tmp_path, split, num_images=500, every=3)
    np.testing.assert_array_equal(spread, everything[::3])
    assert f"the first 3 of images 0, 3, 6, ... of the mnist {split} split" in text
    with pytest.raises(ValueError, match="`every` must be a positive int or None. Received: every=0"):
        load_images("mnist", tmp_path, split, every=0)
