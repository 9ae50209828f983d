"""Importance-sampled marginal log-likelihood and bits per dimension.

`log p(x) ~= logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K`
(Burda et al., 2016) with `z_k ~ q(z|x)`. Unlike the reference, the
deterministic bottom-up pass runs once per pass of up to K samples, not once
per sample; the images and their K samples are split into passes that fit
in the available memory, so a batch of any size with any K gets its answer
instead of being killed.
`score_batches` runs it over a whole test set and can stop and resume: a
full MNIST evaluation with K = 100 takes hours on a CPU.
"""

import functools
import hashlib
import json
import math
import os
import time
import warnings

import numpy as np
from keras import ops

from keras_avae import inference_passes
from keras_avae._validation import check_finite_outputs
from keras_avae._validation import check_images
from keras_avae._validation import check_positive_int
from keras_avae._validation import concrete_images
from keras_avae._validation import is_integer
from keras_avae._validation import is_narrow_float


def importance_sampled_log_likelihood(model, x, num_samples=100, chunk_size=None):
    """Estimates `log p(x)` in nats for each image of `x`.

    The `B x K` top-down passes are split into chunks that fit in memory, so
    any batch size gives the answer one pass would (the same estimator; the
    random draws of a split batch differ): the images are split into groups
    and the samples of each group into chunks, each pass holding at most
    `_max_rows_per_pass(model)` image-samples (what half the available
    memory holds; a batch that fits is scored as before, in one group).
    Only when not a single image-sample fits is the batch refused, with a
    `ValueError` that gives the estimate. The budget is the host's memory
    (what a CPU run uses); an accelerator's own memory is not looked at.

    The passes decide which samples are drawn, so a batch split further to
    fit in memory gets other draws than on a machine with more memory; a
    `UserWarning` then says so. An explicit `chunk_size` for which
    `chunk_size x B` image-samples fit gives the same draws everywhere.

    Args:
        model: a keras-avae VAE (it provides `bottom_up` and `log_weights`).
        x: a batch of images in the model's input range (no NaN or inf, at
            least one image), each pixel one of the model's `pixel_levels`.
        num_samples: K, the number of importance samples per image.
        chunk_size: the most samples drawn per top-down pass (default: all
            K at once for small batches, otherwise bounded so a pass holds
            at most 1024 image-samples; always within the memory budget).

    Returns:
        NumPy float64 array `(B,)`: the estimate for each image (nats).

    Example:

    >>> import numpy as np, keras_avae
    >>> model = keras_avae.zoo.load("mnist-attentive", num_layers=2,
    ...     preprocess_filters=4, decoder_filters=4)
    >>> x = (np.random.rand(2, 32, 32, 1) > 0.5).astype("float32")
    >>> importance_sampled_log_likelihood(model, x, num_samples=4).shape
    (2,)
    """
    num_samples = check_positive_int(num_samples, "num_samples")
    if chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    x = _checked_images(model, x, "x")
    plan = _pass_plan(model, int(x.shape[0]), num_samples, chunk_size)
    return check_finite_outputs(_estimate(model, x, num_samples, plan), "images' log-likelihoods")


def _estimate(model, x, num_samples, plan):
    """The importance-sampled estimates of the checked batch `x` in the passes `plan` gives."""
    chunk_size, images_per_pass = plan
    log_weights = _compiled_log_weights(model)
    estimates = []
    for start in range(0, int(x.shape[0]), images_per_pass):
        images = ops.convert_to_tensor(x[start : start + images_per_pass])
        chunks, done = [], 0
        while done < num_samples:
            k = min(chunk_size, num_samples - done)
            chunks.append(np.asarray(ops.convert_to_numpy(log_weights(images, k)), np.float64))
            done += k
        log_w = np.concatenate(chunks, axis=1)
        peak = log_w.max(axis=1, keepdims=True)
        estimates.append(peak[:, 0] + np.log(np.exp(log_w - peak).sum(axis=1)) - math.log(num_samples))
    return np.concatenate(estimates)


def _pass_plan(model, batch, num_samples, chunk_size):
    """`(samples per pass, images per pass)` for scoring `batch` images with K = `num_samples`.

    The passes decide the random draws: a batch split into other passes is
    scored with other samples (the same estimator). The plan is the one
    memory does not limit, unless that does not fit in the memory available
    now; then a `UserWarning` says so, since the same call elsewhere (or a
    resumed run) draws other samples. An explicit `chunk_size` that fits
    makes the plan the same on every machine.
    """
    available, max_rows = _memory_budget(model)
    plan = _plan_within(batch, num_samples, chunk_size, max_rows)
    unconstrained = _plan_within(batch, num_samples, chunk_size, math.inf)
    if plan != unconstrained:
        if available is None:
            memory = f"the available memory is unknown, so a pass holds at most {max_rows} image-samples"
        else:
            memory = (
                f"a pass may hold {max_rows} image-samples: {_MEMORY_SAFETY:g} of the {available / 2**20:.1f} MiB "
                f"available, at about {_bytes_per_row(model) / 2**20:.2f} MiB each"
            )
        fits = max_rows // batch
        remedy = (
            f"pass `chunk_size={fits}` or less (`keras-avae evaluate --chunk-size {fits}`; "
            f"chunk_size x {batch} images must fit)"
            if fits
            else f"score batches of at most {max_rows} images, with an explicit `chunk_size`"
        )
        warnings.warn(
            f"The passes that score {batch} images with K = {num_samples} were shrunk to fit in memory: "
            f"{plan[0]} samples x {plan[1]} images per pass instead of {unconstrained[0]} samples x "
            f"{unconstrained[1]} images ({memory}). The estimator is the same, but the Monte Carlo draws "
            "differ from those of a run with more memory, so the numbers differ from the same call (or "
            f"an uninterrupted run) elsewhere. For the same draws everywhere, {remedy}.",
            UserWarning,
            stacklevel=3,
        )
    return plan


def _plan_within(batch, num_samples, chunk_size, max_rows):
    """The pass plan when one pass may hold `max_rows` image-samples (`math.inf`: unlimited)."""
    if chunk_size is None:
        chunk_size = max(1, min(num_samples, min(_MAX_ROWS, max_rows) // batch))
    chunk_size = min(chunk_size, num_samples, max_rows)
    return int(chunk_size), int(max(1, min(batch, max_rows // chunk_size)))


def _checked_images(model, x, name):
    """`x` as a checked float32 NumPy batch; only made concrete for a model without image metadata."""
    if hasattr(model, "image_shape") and hasattr(model, "pixel_range"):
        received = concrete_images(x, name)  # its dtype: a float narrower than float32 rounds the levels
        x = check_images(received, model.image_shape, model.pixel_range, name=name)
        if hasattr(model, "pixel_levels"):
            x = _check_pixel_levels(x, model.pixel_range, model.pixel_levels, name, received.dtype)
        return x
    return concrete_images(x, name)


def _check_pixel_levels(x, pixel_range, levels, name, received_dtype=None):
    """Returns `x` if every value is one of the `levels` pixel levels spread evenly over `pixel_range`, else raises.

    The estimate is `log p(x)` of a discrete distribution over those levels
    only: a Bernoulli model scored grey pixels by a cross-entropy, and the
    logistic mixture scored in-range values between its levels (CIFAR-10 in
    [0, 1] instead of [-1, 1]: half the levels between two) as if they were
    levels, each a finite and plausible figure in nats that no density gives.

    `x` was received as `received_dtype`. A float narrower than float32
    (bfloat16, float16) rounds the levels: bfloat16's `k / 127.5 - 1` lies
    up to a quarter of a level from its level. Values that are exactly a
    level rounded to that dtype are returned as the levels (float32); a
    dtype that rounds some level nearer another (bfloat16 for 1024 levels)
    is refused.

    Example:

    >>> _check_pixel_levels(np.array([[0.0, 0.5]]), (0.0, 1.0), 2, "x")
    Traceback (most recent call last):
    ...
    ValueError: Expected `x` to hold only the model's 2 pixel levels (binary pixels: 0 or 1; ...
    Received: x with 1 values between levels, e.g. 0.5
    """
    low, high = pixel_range
    values = np.asarray(x, np.float64)
    position = (values - low) * ((levels - 1) / (high - low))
    narrow = received_dtype is not None and is_narrow_float(received_dtype)
    if narrow:
        # Snapped, not refused: where every level rounds to a value of its
        # own, nearer that level than any other (checked once per dtype), a
        # value that is exactly a level's rounding stands for that level and
        # no other, so the levels are the image received and their log p(x)
        # the honest score (a mixed-precision user's 8-bit images are exact).
        # A value that is no level's rounding (a level computed in bfloat16
        # arithmetic: up to half a level off) is refused below, as is a dtype
        # that cannot keep the levels apart (here).
        dtype = np.dtype(received_dtype)
        if not _levels_survive_rounding(dtype, float(low), float(high), int(levels)):
            raise ValueError(
                f"`{name}` of dtype {dtype} cannot hold the model's {levels} pixel levels: {dtype} rounds some "
                f"level nearer another, so which image was meant is unknown. Pass float32 images. Received: "
                f"{name} of dtype {dtype}"
            )
        snapped = (low + np.round(position) * (high - low) / (levels - 1)).astype("float32")
        between = snapped.astype(dtype).astype(np.float64) != values
    else:
        # 1e-3 of a level: far above float32 rounding of `k / 127.5 - 1`, far below any real offset.
        between = np.abs(position - np.round(position)) > 1e-3
    if between.any():
        kind = (
            "binary pixels: 0 or 1; binarise grey images first"
            if levels == 2
            else f"{low:g} + k * {(high - low):g} / {levels - 1} for integers k, e.g. `pixels / 127.5 - 1` for "
            "8-bit pixels"
        )
        if narrow:
            kind += f"; as {np.dtype(received_dtype)}: levels computed in float32, then cast"
        raise ValueError(
            f"Expected `{name}` to hold only the model's {levels} pixel levels ({kind}): its log p(x) is a "
            f"probability of those levels only. Received: {name} with {int(between.sum())} values between "
            f"levels, e.g. {float(np.asarray(x)[between][0])!r}"
        )
    return snapped if narrow else x


@functools.lru_cache(maxsize=16)
def _levels_survive_rounding(dtype, low, high, levels):
    """Whether `dtype`'s rounding of each of the `levels` levels over `[low, high]` lies nearest that level."""
    k = np.arange(levels)
    rounded = (low + k * (high - low) / (levels - 1)).astype("float32").astype(dtype).astype(np.float64)
    return bool(np.all(np.round((rounded - low) * ((levels - 1) / (high - low))) == k))


# Default chunks hold at most this many image-samples: larger passes gain
# nothing in speed on a CPU.
_MAX_ROWS = 1024
# Peak resident memory per image-sample, in bytes per float32 value of
# `_activation_floats(model)`. Measured as peak RSS (`ru_maxrss`) against
# the batch size on TensorFlow, CPU, `mnist-attentive-small` (53,248
# values): the eager forward pass of `score_batches`' ELBO takes 2.6 MiB per
# image (52 bytes per value; 5000 images: the 13 GB the kernel killed), the
# XLA `log_weights` pass 1.75 MiB per image-sample (34 bytes per value; 15
# with 12 layers, so the estimate errs high for deep models). Rounded up:
_BYTES_PER_ACTIVATION_FLOAT = 64
# Only this fraction of the available memory is planned for.
_MEMORY_SAFETY = 0.5


def _activation_floats(model):
    """Float32 values one image-sample's pass holds at once, up to a constant factor.

    Models provide `_activation_floats_per_sample()`; otherwise 64 values
    per pixel.
    """
    estimate = getattr(model, "_activation_floats_per_sample", None)
    if estimate is not None:
        return int(estimate())
    return 64 * int(np.prod(getattr(model, "image_shape", (32, 32, 3))))


def _available_memory_bytes():
    """Memory this process can still use: `MemAvailable`, within a cgroup limit if one is set."""
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
        except OSError:
            pass
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            headroom = max(0, int(limit) - usage)
            available = headroom if available is None else min(available, headroom)
        break
    return available


def _bytes_per_row(model):
    """Estimated peak memory of one image-sample in a compiled pass, in bytes."""
    return _BYTES_PER_ACTIVATION_FLOAT * _activation_floats(model)


def _max_rows_per_pass(model):
    """Image-samples one pass may hold in memory.

    `_MEMORY_SAFETY` of the available memory (`_available_memory_bytes`)
    divided by `_bytes_per_row(model)`. Raises `ValueError` when not even
    one image-sample fits. Where the available memory is unknown (no
    `/proc/meminfo`), `_MAX_ROWS`.
    """
    return _memory_budget(model)[1]


def _memory_budget(model):
    """`(available bytes or None, rows)`: `_max_rows_per_pass` with the memory it was computed from."""
    available = _available_memory_bytes()
    if available is None:
        return None, _MAX_ROWS
    per_row = _bytes_per_row(model)
    rows = int(available * _MEMORY_SAFETY // per_row)
    if rows < 1:
        raise ValueError(
            f"Not enough memory to score even one image-sample: one needs about {per_row / 2**20:.1f} MiB, "
            f"and {_MEMORY_SAFETY:g} of the {available / 2**20:.1f} MiB available is planned for. "
            "Free memory or use a smaller model."
        )
    return available, rows


def _compiled_log_weights(model):
    """`(x, k) -> log_weights(x, bottom_up(x), k)`, compiled where possible.

    Evaluation draws millions of samples; eager execution runs the top-down
    pass several times slower than the compiled graph
    (`benchmarks/evaluation_speed.py`). TensorFlow compiles with XLA, JAX with
    `jax.jit` over the model's variables; PyTorch runs eagerly, without
    autograd (`keras_avae.inference_passes`). The bottom-up pass is
    recomputed per chunk inside the compiled function: it is cheap next to
    `k` top-down passes and keeps one compiled function per shape.
    """

    def log_weights(x, k):
        return model.log_weights(x, model.bottom_up(x, training=False), k)

    return inference_passes.inference_pass(model, "log_weights", log_weights, (1,), xla_on_tensorflow=True)


def bits_per_dim(nats, num_dims):
    """Converts a negative log-likelihood in nats to bits per dimension.

    Example:

    >>> round(bits_per_dim(3072 * math.log(2.0), 3072), 6)
    1.0
    """
    return nats / (check_positive_int(num_dims, "num_dims") * math.log(2.0))


# Each batch's seed generators start from counter `batch_index * _DRAWS_PER_BATCH`:
# the streams of different batches never overlap (a batch draws a few
# hundred times), and the largest counter, for 60,000 images in batches of
# one, stays below 2**31 (the torch backend keeps seed states in int32).
_DRAWS_PER_BATCH = 2**15


def score_batches(
    model, batches, num_samples=100, seed=0, progress_path=None, run_info=None, report=None, chunk_size=None
):
    """Importance-sampled `log p(x)` and the ELBO of every image, resumable.

    Before each batch, every `SeedGenerator` of the model is set from
    `(seed, batch index)`, so each batch draws the same samples however the
    run was split: a run stopped and resumed from `progress_path` gives the
    numbers one uninterrupted run gives, and two runs with the same `seed`
    agree. The passes a batch is split into (which also decide the draws)
    are planned once per batch size from the memory available then, and
    kept for the rest of the run and in the progress file: a resume where
    they no longer fit in memory is refused with a `ValueError`. A batch
    whose estimate or ELBO is not finite (NaN weights) raises
    `FloatingPointError` before anything of it is saved.

    Args:
        model: a keras-avae VAE (`bottom_up`, `log_weights`, and a call
            that returns `nll` and `kl`).
        batches: an iterable of image batches, in the same order every run
            (e.g. `datasets.make_dataset(..., shuffle=False)`).
        num_samples: K, importance samples per image.
        seed: int (NumPy's too) in `[0, 2**20)`, seeds the samples of every batch.
        progress_path: optional `.npz` path. The per-image results are
            written there (atomically) after every batch; if it exists, its
            batches are skipped and the run continues where it stopped.
        run_info: optional JSON-serialisable dict that identifies the run
            (model name, weights, data). A progress file written for
            different `run_info`, `num_samples` or `seed` is refused.
            Without it, the file records the model's class and a sha256 of
            its weights instead, so another model's file is refused too.
        report: optional `report(images_done, log_px_so_far, seconds)`
            callable, called after every batch (e.g. to print progress).
        chunk_size: the most samples per top-down pass, as in
            `importance_sampled_log_likelihood` (default: its choice); a
            progress file records it, and another value is refused.

    Returns:
        A dict: `log_px` and `elbo`, NumPy float64 arrays `(N,)` in nats;
        `seconds`, the scoring time summed over every run that contributed;
        `resumed_images`, how many images came from the progress file.

    Example:

    >>> import numpy as np, keras_avae
    >>> model = keras_avae.zoo.load("mnist-attentive", num_layers=2,
    ...     preprocess_filters=4, decoder_filters=4)
    >>> x = (np.random.default_rng(0).random((4, 32, 32, 1)) > 0.5)
    >>> x = x.astype("float32")
    >>> first = score_batches(model, [x[:2], x[2:]], num_samples=4)
    >>> again = score_batches(model, [x[:2], x[2:]], num_samples=4)
    >>> first["log_px"].shape, np.allclose(first["log_px"], again["log_px"])
    ((4,), True)
    """
    if not is_integer(seed) or not 0 <= seed < 2**20:
        raise ValueError(f"`seed` must be an int in [0, 2**20). Received: seed={seed!r}")
    seed = int(seed)  # a NumPy int32 would overflow in `_reseed` and is not JSON for the progress file
    # Unchecked, 0 divided by zero in the pass plans and 2.5 asked for a chunk of half a sample.
    num_samples = check_positive_int(num_samples, "num_samples")
    if chunk_size is not None:
        chunk_size = check_positive_int(chunk_size, "chunk_size")
    if not model.built:
        model.build()  # its seed generators must exist before the first reseed
    state = {"log_px": [], "elbo": [], "checksums": [], "seconds": 0.0, "plans": {}}
    if progress_path is not None:
        # Without `run_info`, only the weights tell two models' files apart.
        identity = _progress_identity(
            _model_fingerprint(model) if run_info is None else run_info, num_samples, seed, chunk_size
        )
        from keras_avae.training.atomic_files import _remove_stale_temporaries

        _remove_stale_temporaries(progress_path)  # a kill cut a write
        if os.path.exists(progress_path):
            state = _read_progress(progress_path, identity)
    resumed = len(state["log_px"])
    done_batches = len(state["checksums"])
    recorded_plans = set(state["plans"])  # checked against this process's memory at their first use
    start, seen = time.time(), 0
    for index, batch in enumerate(batches):
        seen = index + 1
        x = _checked_images(model, batch, f"batches[{index}]")
        checksum = float(np.asarray(x, np.float64).sum())
        if index < done_batches:
            # Cheap guard against data that changed between the runs.
            if not _same_pixel_sums(checksum, state["checksums"][index]):
                raise ValueError(
                    f"Batch {index} differs from the one scored in `progress_path={progress_path!r}` "
                    f"(pixel sum {checksum} vs {state['checksums'][index]}): the data changed. "
                    "Delete the file to start over."
                )
            continue
        plan = _run_plan(model, state["plans"], recorded_plans, len(x), num_samples, chunk_size, progress_path)
        _reseed(model, seed, index)
        log_px = _estimate(model, x, num_samples, plan[:2])
        elbo = _elbo(model, x, plan[2])
        bad = np.flatnonzero(~(np.isfinite(log_px) & np.isfinite(elbo)))
        if bad.size:
            raise FloatingPointError(
                f"Batch {index}: the model scored {bad.size} of its {len(x)} images (images {bad[:10].tolist()}) "
                "NaN or infinite: its weights or outputs are not finite. Nothing of this batch was saved."
            )
        state["log_px"].extend(log_px.tolist())
        state["elbo"].extend(np.asarray(elbo, np.float64).tolist())
        state["checksums"].append(checksum)
        seconds = state["seconds"] + time.time() - start
        if progress_path is not None:
            _write_progress(progress_path, identity, dict(state, seconds=seconds))
        if report is not None:
            report(len(state["log_px"]), np.asarray(state["log_px"]), seconds)
    if seen < done_batches:
        raise ValueError(
            f"`progress_path={progress_path!r}` holds {done_batches} scored batches but the data has only {seen}: "
            "the data changed. Delete the file to start over."
        )
    return {
        "log_px": np.asarray(state["log_px"], np.float64),
        "elbo": np.asarray(state["elbo"], np.float64),
        "seconds": state["seconds"] + time.time() - start,
        "resumed_images": resumed,
    }


def _run_plan(model, plans, unchecked, batch, num_samples, chunk_size, progress_path):
    """`[samples per pass, images per pass, images per ELBO pass]` for a batch of `batch` images.

    The passes decide the draws, and the memory they are planned from
    changes during a run and between a stop and its resume: so a run plans
    each batch size once (`plans`, which the progress file keeps) and keeps
    the plan. A plan read from the file (`unchecked`) must fit in the
    memory available to this process (all of it, not the half a new plan
    keeps free); else a `ValueError`, since another plan would draw other
    samples than the uninterrupted run.
    """
    key = str(batch)
    if key not in plans:
        plans[key] = [*_pass_plan(model, batch, num_samples, chunk_size), min(batch, _max_rows_per_pass(model))]
    elif key in unchecked:
        unchecked.discard(key)
        chunk, images, elbo_images = plans[key]
        # A new plan keeps half the memory free (`_MEMORY_SAFETY`); the file's
        # plan is kept as long as it fits at all: free memory varies.
        available, _ = _memory_budget(model)
        rows = math.inf if available is None else int(available // _bytes_per_row(model))
        if max(chunk * images, elbo_images) > rows:
            raise ValueError(
                f"`progress_path={progress_path!r}` scored batches of {batch} images in passes of {chunk} samples "
                f"x {images} images, but only {rows} image-samples fit in the memory available now: smaller "
                "passes would draw other samples than an uninterrupted run. Free memory, or delete the file "
                "(or use another) to score again in passes that fit."
            )
    return plans[key]


def _elbo(model, x, step):
    """Per-image ELBO in nats, `(B,)`, in passes of `step` images."""
    terms = inference_passes.inference_pass(model, "elbo_terms", lambda b: _elbo_terms(model(b, training=False)))
    parts = []
    for start in range(0, len(x), step):
        batch_terms = terms(ops.convert_to_tensor(x[start : start + step]))
        nll, kl = (np.asarray(ops.convert_to_numpy(t), np.float64) for t in batch_terms)
        parts.append(-(nll + kl))  # summed in float64 on the host
    return np.concatenate(parts)


def _elbo_terms(out):
    return out["nll"], out["kl"]


def _seed_states(model):
    """The state variable of every `SeedGenerator` in `model` (a DiscreteVAE's Gumbel sampler has its own)."""
    return [v for v in model.non_trainable_variables if v.name == "seed_generator_state"]


def _nelbo_under_fixed_seeds(model, x, state=(7, 0)):
    """Per-image negative ELBO (nats) of one pass with every seed state of `model` at `state`.

    The model cards' `shipped_sample_nelbo_nats` is its mean over the shipped
    images: with the sampling fixed, only the weights and the FAVOR+
    features can change it.
    """
    for seed_state in _seed_states(model):
        seed_state.assign(ops.convert_to_tensor(np.array(state), seed_state.dtype))
    nll, kl = _elbo_terms(model(ops.convert_to_tensor(x), training=False))
    return ops.convert_to_numpy(nll) + ops.convert_to_numpy(kl)


def _reseed(model, seed, batch_index):
    """Sets every seed state of `model` from `(seed, batch_index)`."""
    for j, state in enumerate(_seed_states(model)):
        # [key, counter]: one key per generator, one counter range per batch.
        key = (seed * 4099 + j) % 2**31
        state.assign(np.array([key, batch_index * _DRAWS_PER_BATCH]).astype(state.dtype))


def _progress_identity(run_info, num_samples, seed, chunk_size=None):
    """What a progress file records of its run, as the file holds it after a JSON round trip.

    `chunk_size` only when given: files written before it was recorded resume.
    """
    chunks = {} if chunk_size is None else {"chunk_size": chunk_size}
    return json.loads(json.dumps({"num_samples": num_samples, "seed": seed, **chunks, **(run_info or {})}))


def _model_fingerprint(model):
    """The model's class name and a sha256 of all its weights (float32 bytes, in order)."""
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.asarray(ops.convert_to_numpy(weight), np.float32).tobytes())
    return {"model": type(model).__name__, "model_weights_sha256": digest.hexdigest()}


def _load_progress(path):
    """`(identity, state)` of a progress file, whatever run wrote it (its values are checked to agree)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            saved = json.loads(str(data["identity"]))
            state = {
                "log_px": data["log_px"].tolist(),
                "elbo": data["elbo"].tolist(),
                "checksums": data["checksums"].tolist(),
                "seconds": float(data["seconds"]),
                # Files written before the plans were recorded plan afresh.
                "plans": json.loads(str(data["plans"])) if "plans" in data.files else {},
            }
    except Exception as error:  # a truncated zip, a foreign file, missing keys
        raise ValueError(
            f"`progress_path={path!r}` is not a readable keras-avae progress file ({type(error).__name__}: "
            f"{error}). Delete it to start over."
        ) from None
    if len(state["log_px"]) != len(state["elbo"]):
        raise ValueError(
            f"`progress_path={path!r}` is inconsistent: {len(state['log_px'])} log p(x) values, "
            f"{len(state['elbo'])} ELBO values. Delete it to start over."
        )
    return saved, state


def _read_progress(path, identity):
    saved, state = _load_progress(path)
    if not state["plans"] and "chunk_size" not in saved:
        # Written before the chunk size and the plans were recorded: resumed
        # as before, with the chunk size it is given.
        identity = {key: value for key, value in identity.items() if key != "chunk_size"}
    if saved != identity:
        changed = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        detail = ", ".join(f"{k}: file {saved.get(k)!r}, this run {identity.get(k)!r}" for k in changed)
        raise ValueError(
            f"`progress_path={path!r}` was written by a different evaluation ({detail}). "
            "Use another file, or delete it to start over."
        )
    return state


def _write_progress(path, identity, state):
    """Writes the progress file atomically: a crash leaves the old or the new file."""
    from keras_avae.training.atomic_files import _atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(
                f,
                identity=np.array(json.dumps(identity, sort_keys=True)),
                log_px=np.asarray(state["log_px"], np.float64),
                elbo=np.asarray(state["elbo"], np.float64),
                checksums=np.asarray(state["checksums"], np.float64),
                seconds=np.array(state["seconds"], np.float64),
                plans=np.array(json.dumps(state.get("plans", {}), sort_keys=True)),
            )

    _atomic_write(path, write)


def summarize(log_px, elbo, num_data_dims):
    """The figures a model card reports, from per-image `log p(x)` and ELBO (nats).

    Example:

    >>> s = summarize(np.array([-100.0, -102.0]), np.array([-110.0, -112.0]), 784)
    >>> s["nll_nats"], s["nll_stderr"], s["elbo_nats"]
    (101.0, 1.0, -111.0)
    """
    log_px = _per_image_scores(log_px, "log_px")
    elbo = _per_image_scores(elbo, "elbo")
    if log_px.size != elbo.size:
        raise ValueError(
            "`log_px` and `elbo` must score the same images (one value each per image). "
            f"Received: {log_px.size} values of log_px and {elbo.size} of elbo"
        )
    nll = float(-log_px.mean())
    return {
        "num_examples": int(log_px.size),
        "nll_nats": nll,
        "nll_stderr": float(log_px.std(ddof=1) / math.sqrt(log_px.size)) if log_px.size > 1 else None,
        "bits_per_dim": bits_per_dim(nll, num_data_dims),
        "elbo_nats": float(elbo.mean()),
    }


def paired_difference(scores_a, scores_b):
    """Mean per-image NLL difference of two models scored on the same images.

    Pairing removes the image-to-image spread that both scores share, so the
    standard error of the difference is far smaller than either model's own.

    Args:
        scores_a: per-image `log p(x)` in nats, or the path of an
            `evaluate --progress` file.
        scores_b: the same for the second model, on the same images in the
            same order.

    Returns:
        A dict: `nll_difference_nats` (NLL of a minus NLL of b: negative
        when a is better), its `stderr`, and `num_examples`.

    Raises:
        ValueError: when the two hold different numbers of images, or
            non-finite values; for two progress files, also when they
            scored other images: other per-batch pixel sums, or another
            `split`, `limit`, `every`, `batch_size` or `seed` (which seeds
            the binarisation) where both record one. The model, its weights
            and K may differ.

    Example:

    >>> d = paired_difference(np.array([-90.0, -101.0]), np.array([-92.0, -104.0]))
    >>> d["nll_difference_nats"], d["stderr"], d["num_examples"]
    (-2.5, 0.5, 2)
    """
    files = [_scores_file(s) if isinstance(s, (str, os.PathLike)) else None for s in (scores_a, scores_b)]
    if all(f is not None and f["identity"] is not None for f in files):
        _check_same_images(scores_a, scores_b, *files)
    a = _per_image_scores(files[0]["log_px"] if files[0] else scores_a, "scores_a")
    b = _per_image_scores(files[1]["log_px"] if files[1] else scores_b, "scores_b")
    if a.shape != b.shape:
        raise ValueError(
            "`scores_a` and `scores_b` must score the same images. "
            f"Received: {a.size} and {b.size} per-image values"
        )
    difference = b - a  # log p_b(x) - log p_a(x) = NLL_a - NLL_b
    return {
        "nll_difference_nats": float(difference.mean()),
        "stderr": float(difference.std(ddof=1) / math.sqrt(difference.size)) if difference.size > 1 else None,
        "num_examples": int(difference.size),
    }


# Identity keys of a progress file that select or prepare the images (the
# CLI's seed also binarises them); the others name the model, its settings and K.
_DATA_KEYS = ("split", "limit", "every", "batch_size", "seed")


def _same_pixel_sums(a, b):
    """Whether per-batch pixel sums agree (elementwise): the same images, up to float summation order."""
    return np.isclose(a, b, rtol=1e-9, atol=1e-6)


def _scores_file(path):
    """A scores file read once: `log_px`, and `identity` and `checksums` (`None` in a plain `log_px` file)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            has_identity = "identity" in data.files and "checksums" in data.files
            return {
                "log_px": data["log_px"],
                "identity": json.loads(str(data["identity"])) if has_identity else None,
                "checksums": data["checksums"] if has_identity else None,
            }
    except Exception as error:  # no `log_px`, not an .npz, unreadable
        raise ValueError(
            f"{os.fspath(path)!r} is not a scores file: an `.npz` with per-image `log_px` "
            f"({type(error).__name__}: {error})"
        ) from None


def _check_same_images(path_a, path_b, file_a, file_b):
    """Refuses two progress files (read by `_scores_file`) that cannot have scored the same images."""
    identity_a, identity_b = file_a["identity"], file_b["identity"]
    differences = [
        f"{key} {identity_a[key]!r} vs {identity_b[key]!r}"
        for key in _DATA_KEYS
        if key in identity_a and key in identity_b and identity_a[key] != identity_b[key]
    ]
    sums_a, sums_b = np.asarray(file_a["checksums"]), np.asarray(file_b["checksums"])
    if sums_a.shape != sums_b.shape:
        differences.append(f"{sums_a.size} vs {sums_b.size} scored batches")
    else:
        unequal = np.flatnonzero(~_same_pixel_sums(sums_a, sums_b))
        if unequal.size:
            i = int(unequal[0])
            differences.append(
                f"per-batch pixel sums in {unequal.size} batches (batch {i}: {float(sums_a[i])} vs {float(sums_b[i])})"
            )
    if differences:
        raise ValueError(
            f"`scores_a` and `scores_b` must score the same images, but {os.fspath(path_a)!r} and "
            f"{os.fspath(path_b)!r} differ in: {'; '.join(differences)}"
        )


def _per_image_scores(scores, name):
    scores = np.asarray(scores, np.float64).reshape(-1)
    if scores.size == 0 or not np.all(np.isfinite(scores)):
        raise ValueError(f"`{name}` must hold finite per-image values. Received: {scores.size} values")
    return scores
