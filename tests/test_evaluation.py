"""Resumable test-set scoring (`evaluation.score_batches`) and card figures.

A full MNIST evaluation with K = 100 runs for hours on a CPU, so it must
survive being stopped: a run cut short and resumed from its progress file
must give exactly the numbers of one uninterrupted run.
"""

import contextlib
import json
import math
import os
import re
import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_avae import evaluation
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from tests.models.test_hierarchical_vae import TINY
from tests.models.test_hierarchical_vae import shapes_batch
from tests.test_case import exited_pid

BATCHES = [shapes_batch(3, seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def model():
    model = HierarchicalVAE(**TINY)
    model.build()
    return model


@contextlib.contextmanager
def other_weights(model):
    """`model` with one weight changed: another model, without compiling one."""
    weight = model.weights[0]
    original = ops.convert_to_numpy(weight)
    weight.assign(original + 0.1)
    try:
        yield model
    finally:
        weight.assign(original)


class Interrupted(Exception):
    pass


def cut_after(batches, count):
    """Yields `count` batches, then fails as a killed run would."""
    for i, batch in enumerate(batches):
        if i == count:
            raise Interrupted
        yield batch


def test_resumed_run_equals_uninterrupted_run(model, tmp_path):
    whole = evaluation.score_batches(model, BATCHES, num_samples=4, seed=3)
    assert whole["log_px"].shape == (9,) and whole["elbo"].shape == (9,)
    assert whole["resumed_images"] == 0
    assert np.all(np.isfinite(whole["log_px"])) and np.all(whole["log_px"] < 0)

    progress = tmp_path / "progress.npz"
    with pytest.raises(Interrupted):
        evaluation.score_batches(model, cut_after(BATCHES, 2), num_samples=4, seed=3, progress_path=str(progress))
    # Only finished batches are on disk, and no temporary file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress.npz"]
    with np.load(progress) as saved:
        assert saved["log_px"].shape == (6,)

    seen = []
    resumed = evaluation.score_batches(
        model,
        BATCHES,
        num_samples=4,
        seed=3,
        progress_path=str(progress),
        report=lambda images, log_px, seconds: seen.append((images, log_px.size)),
    )
    assert resumed["resumed_images"] == 6
    assert seen == [(9, 9)]  # only the third batch was scored in this run
    np.testing.assert_allclose(resumed["log_px"], whole["log_px"], rtol=1e-6)
    np.testing.assert_allclose(resumed["elbo"], whole["elbo"], rtol=1e-6)

    # A finished file resumes to the same answer without scoring anything.
    again = evaluation.score_batches(model, BATCHES, num_samples=4, seed=3, progress_path=str(progress))
    assert again["resumed_images"] == 9
    np.testing.assert_array_equal(again["log_px"], resumed["log_px"])


def test_seed_sets_the_samples_of_every_batch(model):
    # The same image in two batches gets fresh samples: the estimates differ.
    x = BATCHES[0]
    scores = evaluation.score_batches(model, [x, x], num_samples=2, seed=0)["log_px"]
    assert not np.allclose(scores[:3], scores[3:])
    # Another seed, other samples; the same seed, the same numbers.
    other = evaluation.score_batches(model, [x, x], num_samples=2, seed=1)["log_px"]
    same = evaluation.score_batches(model, [x, x], num_samples=2, seed=0)["log_px"]
    assert not np.allclose(scores, other)
    np.testing.assert_allclose(scores, same, rtol=1e-6)
    # Different seeds agree in distribution: both estimate the same log p(x).
    assert abs(scores.mean() - other.mean()) < 0.2 * abs(scores.mean())


def test_progress_file_of_another_run_is_refused(model, tmp_path):
    progress = str(tmp_path / "progress.npz")
    evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=progress, run_info={"name": "a"})
    # With `run_info`, the file records it as before (the CLI's files stay resumable).
    with np.load(progress) as saved:
        assert json.loads(str(saved["identity"])) == {"name": "a", "num_samples": 2, "seed": 0}
    with pytest.raises(ValueError, match=r"num_samples: file 2, this run 3"):
        evaluation.score_batches(model, BATCHES[:1], num_samples=3, progress_path=progress, run_info={"name": "a"})
    with pytest.raises(ValueError, match=r"name: file 'a', this run 'b'"):
        evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=progress, run_info={"name": "b"})
    # Same identity, other pixels: the data changed under the file.
    with pytest.raises(ValueError, match=r"Batch 0 differs .*progress_path="):
        evaluation.score_batches(
            model, [1.0 - BATCHES[0]], num_samples=2, progress_path=progress, run_info={"name": "a"}
        )
    # Fewer batches than the file scored.
    with pytest.raises(ValueError, match=r"holds 1 scored batches but the data has only 0"):
        evaluation.score_batches(model, [], num_samples=2, progress_path=progress, run_info={"name": "a"})


def test_progress_file_of_another_model_is_refused(model, tmp_path):
    # Without `run_info`, the file recorded only K and the seed: scoring
    # model B with model A's file returned A's scores.
    progress = str(tmp_path / "progress.npz")
    first = evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=progress)
    sha = r"'[0-9a-f]{64}'"
    with other_weights(model), pytest.raises(ValueError, match=rf"model_weights_sha256: file {sha}, this run {sha}"):
        evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=progress)
    # The same model resumes its own file.
    again = evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=progress)
    assert again["resumed_images"] == 3
    np.testing.assert_array_equal(again["log_px"], first["log_px"])


def test_corrupt_progress_file_names_the_path(model, tmp_path):
    progress = tmp_path / "progress.npz"
    evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=str(progress))
    progress.write_bytes(progress.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"progress_path=.*progress\.npz.* not a readable keras-avae progress file"):
        evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=str(progress))


@pytest.mark.parametrize("name", ["progress.npz", "progress"])
def test_temporaries_of_killed_writes_are_removed(model, tmp_path, name):
    # Before: a kill while the progress file was written left `.tmp-PID-progress.npz` for good.
    progress = tmp_path / name
    suffix = progress.suffix
    gone = exited_pid()
    stale = tmp_path / f".tmp-{gone}-{name}"
    live = tmp_path / f".tmp-{os.getppid()}-{name}"  # a write under way in a live process
    other = tmp_path / f".tmp-{gone}-other{suffix}"  # another file's
    for path in (stale, live, other):
        path.write_bytes(b"cut")
    evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=str(progress))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, name])


def test_numpy_integer_seeds_score_as_their_int(model, tmp_path):
    """Before: NumPy integer seeds were refused ("`seed` must be an int")."""
    expected = evaluation.score_batches(model, BATCHES[:1], num_samples=2, seed=2**20 - 1)["log_px"]
    for seed in (np.int64(2**20 - 1), np.int32(2**20 - 1)):  # int32: `_reseed`'s key would overflow
        path = tmp_path / f"{type(seed).__name__}.npz"
        scores = evaluation.score_batches(model, BATCHES[:1], num_samples=2, seed=seed, progress_path=path)
        np.testing.assert_array_equal(scores["log_px"], expected)
    for seed in (np.int64(2**20), np.bool_(True), 1.0):
        with pytest.raises(ValueError, match=re.escape(f"Received: seed={seed!r}")):
            evaluation.score_batches(model, BATCHES[:1], num_samples=2, seed=seed)


def test_bad_seed_names_the_value(model):
    with pytest.raises(ValueError, match=r"seed=-1"):
        evaluation.score_batches(model, BATCHES[:1], num_samples=2, seed=-1)
    # These gave a ZeroDivisionError from the pass plans, and a backend reshape error.
    for arguments, received in (
        (dict(num_samples=0), "num_samples=0"),
        (dict(num_samples=2.5), "num_samples=2.5"),
        (dict(num_samples=2, chunk_size=0), "chunk_size=0"),
    ):
        with pytest.raises(ValueError, match=rf"Received: {received}"):
            evaluation.score_batches(model, BATCHES[:1], **arguments)


def test_summarize_matches_the_formulas():
    rng = np.random.default_rng(0)
    log_px, elbo = -100 - rng.random(50), -110 - rng.random(50)
    s = evaluation.summarize(log_px, elbo, 784)
    assert s["num_examples"] == 50
    assert s["nll_nats"] == pytest.approx(-np.mean(log_px))
    assert s["nll_stderr"] == pytest.approx(np.std(log_px, ddof=1) / math.sqrt(50))
    assert s["bits_per_dim"] == pytest.approx(-np.mean(log_px) / (784 * math.log(2)))
    assert s["elbo_nats"] == pytest.approx(np.mean(elbo))
    assert evaluation.summarize(log_px[:1], elbo[:1], 784)["nll_stderr"] is None
    # Before: a card's ELBO of other images than its NLL, without a word.
    with pytest.raises(ValueError, match=r"same images.*Received: 50 values of log_px and 49 of elbo"):
        evaluation.summarize(log_px, elbo[:49], 784)
    with pytest.raises(ValueError, match=r"Received: num_dims=0"):
        evaluation.bits_per_dim(1.0, 0)



def test_paired_difference_of_two_progress_files(model, tmp_path):
    # Two models (other weights) with two K on the same images: what pairing is for.
    first, second = tmp_path / "a.npz", tmp_path / "b.npz"
    a = evaluation.score_batches(model, BATCHES, num_samples=2, seed=1, progress_path=str(first))["log_px"]
    with other_weights(model):
        b = evaluation.score_batches(model, BATCHES, num_samples=4, seed=1, progress_path=str(second))["log_px"]
    d = evaluation.paired_difference(str(first), str(second))
    # NLL_a - NLL_b and the standard error of the per-image differences, by hand.
    per_image = [b_i - a_i for a_i, b_i in zip(a.tolist(), b.tolist())]
    mean = sum(per_image) / len(per_image)
    spread = math.sqrt(sum((v - mean) ** 2 for v in per_image) / (len(per_image) - 1))
    assert mean != 0.0
    assert d["num_examples"] == 9
    assert d["nll_difference_nats"] == pytest.approx(mean)
    assert d["stderr"] == pytest.approx(spread / 3.0)
    assert evaluation.paired_difference(a, a)["nll_difference_nats"] == 0.0


def test_paired_difference_refuses_progress_files_of_other_images(model, tmp_path):
    # Before, only the lengths were compared: files over other images paired silently.
    first, other = tmp_path / "a.npz", tmp_path / "other.npz"
    a = evaluation.score_batches(model, BATCHES[:2], num_samples=2, seed=1, progress_path=str(first))["log_px"]
    b = evaluation.score_batches(
        model, [BATCHES[0], 1.0 - BATCHES[1]], num_samples=2, seed=1, progress_path=str(other)
    )["log_px"]
    with pytest.raises(ValueError, match=r"same images.* differ in: per-batch pixel sums in 1 batches \(batch 1: "):
        evaluation.paired_difference(str(first), str(other))
    # Arrays, or one path, are paired as before: nothing to compare them by.
    assert evaluation.paired_difference(str(first), b)["num_examples"] == 6
    assert evaluation.paired_difference(a, b)["num_examples"] == 6

    def written(file, **identity):
        path = tmp_path / f"{file}.npz"
        identity = {"name": "m", "num_samples": 2, "split": "test", "batch_size": 3, "seed": 0, **identity}
        state = {"log_px": [-1.0, -2.0, -4.0], "elbo": [-5.0] * 3, "checksums": [17.0], "seconds": 0.0}
        evaluation._write_progress(str(path), identity, state)
        return path

    base = written("base")
    # Another model, weights or K: the point of pairing.
    assert evaluation.paired_difference(base, written("b", name="n", weights_sha256="ab", num_samples=9))
    # A key one file lacks is not compared (files written before `--every`).
    assert evaluation.paired_difference(base, written("c", every=2))
    with pytest.raises(ValueError, match=r"differ in: split 'test' vs 'validation'"):
        evaluation.paired_difference(base, written("d", split="validation"))
    with pytest.raises(ValueError, match=r"differ in: batch_size 3 vs 1; seed 0 vs 1"):
        evaluation.paired_difference(base, written("e", batch_size=1, seed=1))
    with pytest.raises(ValueError, match=r"differ in: limit 3 vs 300"):
        evaluation.paired_difference(written("g", limit=3), written("h", limit=300))


def test_paired_difference_refuses_unpaired_scores():
    with pytest.raises(ValueError, match="same images"):
        evaluation.paired_difference(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="scores_b"):
        evaluation.paired_difference(np.zeros(2), np.array([0.0, np.nan]))

class ConstantWeights(keras.Model):
    """Log-weights that depend on the image only: `log w = -sum(x)` for every sample.

    The estimate of image i is then exactly `-sum(x_i)` however the images
    and samples are split (a lost, repeated or misplaced chunk shows).
    """

    image_shape = (8, 8, 1)
    pixel_range = (0.0, 1.0)

    def __init__(self):
        super().__init__()
        self.built = True

    def bottom_up(self, x, training=None):
        return ops.sum(x, axis=(1, 2, 3))

    def log_weights(self, x, features, num_samples):
        return -ops.repeat(features[:, None], num_samples, axis=1)

    def _activation_floats_per_sample(self):
        return 1000


def memory_for(model, rows, monkeypatch):
    """Makes exactly `rows` image-samples fit in the available memory."""
    available = rows * evaluation._bytes_per_row(model) / evaluation._MEMORY_SAFETY
    monkeypatch.setattr(evaluation, "_available_memory_bytes", lambda: available + 1)


def budget(model, rows, monkeypatch):
    """Makes `rows` image-samples fit in the available memory; records each pass's (images, k)."""
    memory_for(model, rows, monkeypatch)
    passes = []
    compiled = evaluation._compiled_log_weights

    def recording(model):
        fn = compiled(model)

        def call(x, k):
            passes.append((int(x.shape[0]), k))
            return fn(x, k)

        return call

    monkeypatch.setattr(evaluation, "_compiled_log_weights", recording)
    return passes


def test_available_memory_is_measured():
    available = evaluation._available_memory_bytes()
    assert available is None or 2**20 < available < 2**50


def test_chunked_evaluation_equals_one_pass(monkeypatch):
    model = ConstantWeights()
    x = np.concatenate([shapes_batch(4, seed=i) for i in range(3)])  # 12 images
    whole = evaluation.importance_sampled_log_likelihood(model, x, num_samples=5)
    np.testing.assert_allclose(whole, -x.reshape(12, -1).sum(1), rtol=1e-6)
    passes = budget(model, 3, monkeypatch)
    with pytest.warns(UserWarning, match="shrunk to fit in memory"):
        chunked = evaluation.importance_sampled_log_likelihood(model, x, num_samples=5)
    assert passes and max(n * k for n, k in passes) <= 3
    assert sum(n * k for n, k in passes) == 12 * 5  # every image-sample once
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)


def test_large_batch_is_split_to_fit_in_memory(model, monkeypatch):
    # Before, a batch held all its images in one pass: `evaluate
    # --batch-size 5000` was killed by the kernel at 13 GB. Here a memory
    # budget of 6 image-samples splits each batch of 3 images x K = 4 (the
    # shapes other tests compile already, so JAX's eager passes stay cheap).
    whole = evaluation.score_batches(model, BATCHES, num_samples=4, seed=2)
    passes = budget(model, 6, monkeypatch)
    with pytest.warns(UserWarning, match="shrunk to fit in memory"):
        split = evaluation.score_batches(model, BATCHES, num_samples=4, seed=2)
    # Split into more passes than batches, none over the budget.
    assert len(passes) > len(BATCHES), passes
    assert max(n * k for n, k in passes) <= 6, passes
    assert split["log_px"].shape == (9,) and np.all(np.isfinite(split["log_px"]))
    # Other random draws, the same estimator: the mean difference is within
    # 4 standard errors of zero (`test_chunked_evaluation_equals_one_pass`
    # shows the split itself is exact).
    for key in ("log_px", "elbo"):
        diff = split[key] - whole[key]
        assert abs(diff.mean()) < 4 * diff.std(ddof=1) / math.sqrt(diff.size) + 0.1, (key, diff)


def shrink_warnings(call):
    """`call()`'s result, and the messages of the pass-plan warnings it emitted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if "shrunk to fit in memory" in str(w.message)]


def test_passes_shrunk_to_fit_in_memory_warn(monkeypatch):
    # The passes decide the draws: a plan shrunk by the memory of the moment
    # gives other numbers than the same call on a larger machine, or than an
    # uninterrupted run when a run is resumed. Before, silently.
    model = ConstantWeights()
    x = np.concatenate([shapes_batch(4, seed=i) for i in range(3)])  # 12 images
    score = evaluation.importance_sampled_log_likelihood
    passes = budget(model, 30, monkeypatch)
    _, messages = shrink_warnings(lambda: score(model, x, num_samples=5))
    assert len(messages) == 1, messages
    assert "2 samples x 12 images per pass instead of 5 samples x 12 images" in messages[0]
    # 30 rows x 64,000 bytes, doubled: 3.7 MiB.
    assert "30 image-samples: 0.5 of the 3.7 MiB available, at about 0.06 MiB each" in messages[0]
    assert "Monte Carlo draws differ from those of a run with more memory" in messages[0]
    assert "pass `chunk_size=2` or less" in messages[0]
    # That chunk_size fits: the plan is the one plentiful memory gives.
    passes.clear()
    fitting, messages = shrink_warnings(lambda: score(model, x, 5, chunk_size=2))
    assert not messages and passes == [(12, 2), (12, 2), (12, 1)]
    memory_for(model, 10**6, monkeypatch)
    passes.clear()
    plentiful, messages = shrink_warnings(lambda: score(model, x, 5, chunk_size=2))
    assert not messages and passes == [(12, 2), (12, 2), (12, 1)]
    np.testing.assert_array_equal(fitting, plentiful)
    # Not even the given chunk_size fits: the images are split, which warns too.
    memory_for(model, 3, monkeypatch)
    _, messages = shrink_warnings(lambda: score(model, x, 5, chunk_size=2))
    assert len(messages) == 1, messages
    assert "2 samples x 1 images per pass instead of 2 samples x 12 images" in messages[0]
    assert "batches of at most 3 images" in messages[0]


def test_plentiful_memory_keeps_the_plan_and_the_numbers(model, monkeypatch):
    whole = evaluation.score_batches(model, BATCHES[:1], num_samples=4, seed=2)  # this machine's memory
    passes = budget(model, 10**6, monkeypatch)
    again, messages = shrink_warnings(lambda: evaluation.score_batches(model, BATCHES[:1], num_samples=4, seed=2))
    assert not messages
    assert passes == [(3, 4)]
    np.testing.assert_array_equal(again["log_px"], whole["log_px"])
    np.testing.assert_array_equal(again["elbo"], whole["elbo"])


def test_too_little_memory_for_one_sample_is_refused(model, monkeypatch):
    monkeypatch.setattr(evaluation, "_available_memory_bytes", lambda: 1000)
    with pytest.raises(ValueError, match=r"Not enough memory to score even one image-sample: one needs about .* MiB"):
        model.log_likelihood(BATCHES[0], num_samples=2)


def test_non_finite_batch_names_its_index(model):
    bad = BATCHES[1].copy()
    bad[2, 3, 3, 0] = np.nan
    with pytest.raises(ValueError, match=r"`batches\[1\]` contains 1 non-finite values .* in images \[2\]"):
        evaluation.score_batches(model, [BATCHES[0], bad], num_samples=2)


def test_score_batches_passes_chunk_size_on(model, monkeypatch):
    # `chunk_size` bounds the samples of every top-down pass, as in
    # `importance_sampled_log_likelihood` (the GPU scoring sets it).
    passes = budget(model, 10**6, monkeypatch)
    scores = evaluation.score_batches(model, BATCHES[:1], num_samples=4, seed=2, chunk_size=3)
    assert passes == [(3, 3), (3, 1)], passes
    assert scores["log_px"].shape == (3,) and np.all(np.isfinite(scores["log_px"]))


@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="only PyTorch records gradients outside a training step"
)
def test_scoring_records_no_autograd_graph_on_torch(monkeypatch):
    # A recorded graph keeps every activation of a pass alive: the
    # paper-size OMNIGLOT model ran out of an 80 GB GPU at 1,000
    # image-samples per pass before scoring ran under `torch.no_grad`.
    import torch

    model = HierarchicalVAE(**TINY)
    model.build()
    grad_enabled = []
    bottom_up = model.bottom_up

    def recording(x, training=None):
        grad_enabled.append(torch.is_grad_enabled())
        return bottom_up(x, training=training)

    monkeypatch.setattr(model, "bottom_up", recording)
    scores = evaluation.score_batches(model, BATCHES[:1], num_samples=2, seed=0)
    # Both the importance-sampled pass and the ELBO pass went through it.
    assert len(grad_enabled) >= 2 and not any(grad_enabled), grad_enabled
    assert torch.is_grad_enabled()  # restored afterwards
    assert np.all(np.isfinite(scores["log_px"]))


def test_a_run_keeps_its_passes_when_the_free_memory_changes(model, monkeypatch, tmp_path):
    # The passes decide the draws. Before, each batch was planned from the
    # memory free at that moment: a run, or its resume on a busier machine,
    # silently mixed batches drawn in other passes.
    passes = budget(model, 6, monkeypatch)
    path = str(tmp_path / "progress.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shrink warning, tested above
        uninterrupted = evaluation.score_batches(model, BATCHES, num_samples=4, seed=2)
        planned = list(passes)
        with pytest.raises(Interrupted):
            evaluation.score_batches(model, cut_after(BATCHES, 1), num_samples=4, seed=2, progress_path=path)
    # The resume has all the memory it wants, yet scores in the file's passes.
    memory_for(model, 10**6, monkeypatch)
    passes.clear()
    resumed = evaluation.score_batches(model, BATCHES, num_samples=4, seed=2, progress_path=path)
    assert passes == planned[len(planned) // 3 :], passes
    np.testing.assert_array_equal(resumed["log_px"], uninterrupted["log_px"])
    np.testing.assert_array_equal(resumed["elbo"], uninterrupted["elbo"])
    # Within one run, memory that shrinks after the first batch changes nothing.
    available = iter([10**12] + [1] * 100)
    per_row = evaluation._bytes_per_row(model)
    monkeypatch.setattr(evaluation, "_available_memory_bytes", lambda: max(per_row * 2, next(available)))
    passes.clear()
    evaluation.score_batches(model, BATCHES, num_samples=4, seed=2)
    assert passes == [(3, 4)] * 3, passes


def test_a_resume_whose_passes_no_longer_fit_is_refused(model, monkeypatch, tmp_path):
    path = str(tmp_path / "progress.npz")
    budget(model, 10**6, monkeypatch)
    with pytest.raises(Interrupted):
        evaluation.score_batches(model, cut_after(BATCHES, 1), num_samples=4, seed=2, progress_path=path)
    # 12 rows fit in all the memory (`memory_for` plans with half of it): the file's plan of 12 is kept.
    memory_for(model, 6, monkeypatch)
    evaluation.score_batches(model, BATCHES[:1], num_samples=4, seed=2, progress_path=path)
    memory_for(model, 5, monkeypatch)
    pattern = r"scored batches of 3 images in passes of 4 samples x 3 images, but only 10 image-samples fit"
    with pytest.raises(ValueError, match=pattern):
        evaluation.score_batches(model, BATCHES, num_samples=4, seed=2, progress_path=path)
    # Another chunk_size is another evaluation.
    memory_for(model, 10**6, monkeypatch)
    with pytest.raises(ValueError, match=r"chunk_size: file None, this run 2"):
        evaluation.score_batches(model, BATCHES, num_samples=4, seed=2, progress_path=path, chunk_size=2)


def test_a_file_written_before_the_plans_resumes_with_its_chunk_size(model, tmp_path):
    path = str(tmp_path / "progress.npz")
    uninterrupted = evaluation.score_batches(model, BATCHES, num_samples=4, seed=2, chunk_size=3)
    with pytest.raises(Interrupted):
        evaluation.score_batches(model, cut_after(BATCHES, 1), num_samples=4, seed=2, progress_path=path, chunk_size=3)
    # The format before: no plans, no chunk size in the identity.
    identity, state = evaluation._load_progress(path)
    del identity["chunk_size"]
    evaluation._write_progress(path, identity, dict(state, plans={}))
    resumed = evaluation.score_batches(model, BATCHES, num_samples=4, seed=2, progress_path=path, chunk_size=3)
    assert resumed["resumed_images"] == 3
    np.testing.assert_array_equal(resumed["log_px"], uninterrupted["log_px"])


def test_non_finite_scores_raise_and_save_nothing(model, tmp_path):
    # Before, NaN weights gave NaN figures, saved in the progress file, and
    # `evaluate` printed them as (invalid) JSON with status 0.
    path = tmp_path / "progress.npz"
    weight = model.data_head.weights[0]
    original = ops.convert_to_numpy(weight)
    weight.assign(np.full(original.shape, np.nan, original.dtype))
    try:
        with pytest.raises(FloatingPointError, match=r"Batch 0: the model scored 3 of its 3 images .* NaN"):
            evaluation.score_batches(model, BATCHES, num_samples=2, progress_path=str(path))
    finally:
        weight.assign(original)
    assert not path.exists()
    with pytest.raises(ValueError, match="`log_px` must hold finite per-image values"):
        evaluation.summarize(np.array([-1.0, np.nan]), np.array([-2.0, -3.0]), 784)


def test_a_bad_batch_on_resume_is_named_as_such(model, tmp_path):
    path = str(tmp_path / "progress.npz")
    evaluation.score_batches(model, BATCHES[:1], num_samples=2, progress_path=path)
    bad = BATCHES[0].copy()
    bad[0, 0, 0, 0] = np.nan
    # Not "the data changed": the batch is not an image batch.
    with pytest.raises(ValueError, match=r"`batches\[0\]` contains 1 non-finite values"):
        evaluation.score_batches(model, [bad], num_samples=2, progress_path=path)


def test_paired_difference_names_a_file_without_scores(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, weights=np.zeros(3))
    with pytest.raises(ValueError, match=r"other\.npz' is not a scores file"):
        evaluation.paired_difference(str(path), np.zeros(3))


def test_reseed_gives_every_seed_generator_its_own_stream():
    # Protects `_reseed`: the model's generators (here the latents' and the Gumbel sampler's) get distinct
    # states from one `(seed, batch)`, so they draw different numbers, not one shared stream.
    from keras_avae.models.discrete_vae import DiscreteVAE
    from tests.models.test_discrete_vae import TINY as DISCRETE_TINY

    model = DiscreteVAE(**DISCRETE_TINY)
    model.build()
    generators = [layer.seed_generator for layer in model._flatten_layers() if hasattr(layer, "seed_generator")]
    assert len(generators) == len(evaluation._seed_states(model)) >= 2
    for seed, batch in ((0, 0), (5, 3)):
        evaluation._reseed(model, seed, batch)
        states = [tuple(ops.convert_to_numpy(g.state).tolist()) for g in generators]
        assert len(set(states)) == len(states), states
        draws = [ops.convert_to_numpy(keras.random.normal((16,), seed=g)) for g in generators]
        for i in range(len(draws)):
            for j in range(i):
                assert not np.allclose(draws[i], draws[j]), (i, j)


def test_crop_leaves_the_border_out_of_a_logistic_mixture_likelihood():
    """Before: the logistic mixture scored every pixel whatever `crop`, while
    `num_data_dims` (bits/dim) left the border out: 4x too many nats per dim here."""
    config = dict(TINY, image_shape=(8, 8, 3), likelihood="logistic_mixture", num_mixtures=2, nonlocal_blocks=())
    full = HierarchicalVAE(**config)
    cropped = HierarchicalVAE(**dict(config, crop=2))
    full.build()
    cropped.build()
    cropped.set_weights(full.get_weights())
    x = (np.round(np.random.default_rng(0).random((2, 8, 8, 3)) * 255) / 127.5 - 1).astype("float32")
    # The same posterior draws in both models (the crop changes only the likelihood).
    for model in (full, cropped):
        model.seed_generator.state.assign(np.array([7, 0]))
    top_down = full.top_down(full.bottom_up(x, training=False), training=False)
    per_pixel = ops.convert_to_numpy(full.data_distribution_params(top_down["decoded"]).log_prob(x, reduce=False))
    expected = -per_pixel[:, 2:-2, 2:-2].sum(axis=(1, 2))  # the 4x4 interior, by hand
    nll = ops.convert_to_numpy(cropped(x, training=False)["nll"])
    np.testing.assert_allclose(nll, expected, rtol=1e-5)
    assert cropped.num_data_dims == 4 * 4 * 3


def test_scores_are_refused_for_pixels_between_the_likelihoods_levels(model):
    """Before: grey pixels for a Bernoulli model, and CIFAR-10 scaled to [0, 1] for a logistic mixture
    (in range, but half its values between two of the 256 levels), got finite log p(x) figures that are
    no probability of those images (the [0, 1] images scored higher than the right ones)."""
    x = BATCHES[0]
    grey = x * 0.5
    with pytest.raises(ValueError, match=r"`x` to hold only the model's 2 pixel levels.*Received: x with \d+ values"):
        evaluation.importance_sampled_log_likelihood(model, grey, num_samples=2)
    with pytest.raises(ValueError, match=r"`x` to hold only the model's 2 pixel levels"):
        model.log_likelihood(grey, num_samples=2)
    with pytest.raises(ValueError, match=r"`batches\[1\]` to hold only the model's 2 pixel levels"):
        evaluation.score_batches(model, [x, grey], num_samples=2)
    for binary in (x, x.astype("uint8"), x.astype(bool), x.astype("float64")):
        assert np.all(np.isfinite(model.log_likelihood(binary, num_samples=2)))

    mixture = HierarchicalVAE(**dict(TINY, image_shape=(8, 8, 3), likelihood="logistic_mixture", num_mixtures=2))
    pixels = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3))
    on_grid = (pixels / 127.5 - 1).astype("float32")  # float32 rounding stays on the levels
    assert mixture.pixel_levels == 256
    assert np.all(np.isfinite(evaluation.importance_sampled_log_likelihood(mixture, on_grid, num_samples=2)))
    even = np.flatnonzero(pixels % 2 == 0)[0]  # k / 255 is a level of [-1, 1] only for odd k
    expected = float(((pixels / 255.0).astype("float32")).reshape(-1)[even])  # the first value between levels
    with pytest.raises(ValueError, match=rf"256 pixel levels \(-1 \+ k \* 2 / 255.*e\.g\. {re.escape(repr(expected))}"):
        mixture.log_likelihood((pixels / 255.0).astype("float32"), num_samples=2)


def test_narrow_float_images_are_scored_as_the_levels_they_round(monkeypatch):
    """Before: bfloat16 images were refused as not numeric, and float16 8-bit images as "between levels"
    (float16 puts `k / 127.5 - 1` up to 0.03 of a level off, bfloat16 up to 0.25). Each such value is
    exactly one level's rounding, so it is scored as that level: the float32 images' figures."""
    mixture = HierarchicalVAE(**dict(TINY, image_shape=(8, 8, 3), likelihood="logistic_mixture", num_mixtures=2))
    mixture.build()  # building draws random numbers: before seeding
    pixels = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3))
    levels = (pixels / 127.5 - 1).astype("float32")

    def score(x):
        mixture.seed_generator.state.assign(np.array([7, 0]))
        return mixture.log_likelihood(x, num_samples=2)

    expected = score(levels)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        rounded = levels.astype(dtype)
        assert np.any(rounded.astype("float32") != levels)
        np.testing.assert_array_equal(score(rounded), expected, err_msg=str(dtype))
    # Levels computed in bfloat16 arithmetic are up to half a level off: which level is unknown.
    computed = pixels.astype(ml_dtypes.bfloat16) / ml_dtypes.bfloat16(127.5) - ml_dtypes.bfloat16(1)
    between = r"256 pixel levels \(.*; as bfloat16: levels computed in float32, then cast\).*values between levels"
    with pytest.raises(ValueError, match=between):
        score(computed)
    # A dtype that rounds some level nearer another cannot say which image was meant.
    monkeypatch.setattr(mixture.data_head, "num_bins", 1024)
    refused = r"`x` of dtype bfloat16 cannot hold the model's 1024 pixel levels.*Received: x of dtype bfloat16$"
    with pytest.raises(ValueError, match=refused):
        mixture.log_likelihood(levels.astype(ml_dtypes.bfloat16), num_samples=2)
