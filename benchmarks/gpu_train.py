"""Trains a paper-size zoo entry on one GPU for a fixed wall time and scores it.

For a GPU machine with PyTorch and JAX but without TensorFlow (so no
`tf.data`, no `keras-avae train`): the data travel as one `.npz` made
beforehand by `prepare` where TensorFlow is installed, and `run` trains with
`train_on_batch` on the PyTorch backend (eager) or the JAX backend (the step
compiled once by XLA) in bf16 mixed precision, with the entry's recipe
(Adamax, `NonFiniteGuard`, warm-up + cosine learning rate, KL warm-up)
compressed into the time budget: the schedule's length comes from the step
time measured before training starts. It prints, and writes to `--output`:

- the training step's images/s, steps, images seen and wall time;
- `<entry>.float16.weights.h5` (the shipped format);
- the test NLL with K importance samples, scored in float32 (TF32 off) by
  the model `zoo.load(entry)` builds from those float16 weights, on as many
  of the prepared test images as the scoring budget allows, per image in
  `scores.npz`;
- last, if time is left, the paper-size CIFAR-10 step's images/s on this
  GPU (random 8-bit images, the recipe's per-GPU batch), against the
  paper's ~20 images/s per V100.

    python benchmarks/gpu_train.py prepare --data-dir ../shared/data/omniglot --output .gpu/omniglot.npz
    KERAS_BACKEND=torch python benchmarks/gpu_train.py run --data .gpu/omniglot.npz \\
        --entry omniglot-attentive --train-seconds 270 --eval-seconds 150 --output runs/gpu --split-mib 15
    # train on from weights saved before, without a second KL warm-up:
    KERAS_BACKEND=torch python benchmarks/gpu_train.py run --data .gpu/omniglot.npz \\
        --entry omniglot-attentive --init-weights zoo/omniglot-attentive.weights.h5 --kl-warmup-fraction 0 ...

On JAX (`KERAS_BACKEND=jax`; TFP's JAX substrate, which the ELBO uses there,
travels as wheels) the first step compiles: about two minutes for the
paper-size OMNIGLOT step on a CPU. That happens in the untimed warm-up
steps, before `--train-seconds` starts counting: leave room for it in the
call's time limit. Scoring compiles its own pass once more.

The device returns files of at most 16 MiB; the paper-size OMNIGLOT float16
file is 16.9 MiB, so `--split-mib 15` writes it in parts too (join them with
`cat`).
"""

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import sys
import time

import numpy as np

from device_memory import gpu_peak_bytes  # benchmarks/, this script's folder

# tools/fill_card.py: the float16 copy and sha256 the zoo's cards use.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

# The binary test images: `keras-avae evaluate`'s (static binarisation, seed 0).
_EVALUATE_SEED = 0
_EVALUATE_BATCH = 25


def prepare(args):
    """Grey-level train images (28x28) and the padded, binarised test images, in one `.npz`."""
    from keras_avae import datasets

    grey, _ = datasets.read_omniglot_105(pathlib.Path(args.data_dir) / "omniglot_105.npz", "train")
    test = datasets.make_dataset(
        "omniglot", "test", args.data_dir, _EVALUATE_BATCH, shuffle=False, seed=_EVALUATE_SEED, every=args.every
    )
    test = np.concatenate([np.asarray(batch) for batch in test])
    output = pathlib.Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(output, train_grey=grey.astype(np.float16), test=test.astype(np.uint8), every=args.every)
    print(f"{output}: {len(grey)} train images, {len(test)} test images (every {args.every}th), "
          f"{output.stat().st_size / 2**20:.1f} MiB")


# --- The backend's GPU: PyTorch (eager) or JAX (XLA); the rest is Keras. ---
def _backend():
    return os.environ.get("KERAS_BACKEND")


def _device_name():
    if _backend() == "jax":
        import jax

        return jax.devices()[0].device_kind
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _out_of_memory(error):
    if _backend() == "jax":
        return "RESOURCE_EXHAUSTED" in str(error)
    import torch

    return isinstance(error, torch.OutOfMemoryError)


def _free_memory():
    if _backend() == "torch":
        import torch

        torch.cuda.empty_cache()


@contextlib.contextmanager
def _full_float32():
    """Float32 matrix products and convolutions without TF32 (scoring's precision)."""
    if _backend() == "jax":
        import jax

        with jax.default_matmul_precision("highest"):
            yield
        return
    import torch

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _write(output, results):
    (output / "results.json").write_text(json.dumps(results, indent=1))


def _timed_steps(model, batches, warmup):
    """Seconds per step over `batches` after `warmup` untimed steps (synchronised by the logs), and the
    seconds of those warm-up steps (a JAX compile or cuDNN's autotuning is in them)."""
    start = time.perf_counter()
    for x in batches[:warmup]:
        model.train_on_batch(x, return_dict=True)
    warmed = time.perf_counter()
    for x in batches[warmup:]:
        model.train_on_batch(x, return_dict=True)  # returns NumPy logs: waits for the GPU
    return (time.perf_counter() - warmed) / (len(batches) - warmup), warmed - start


def cifar10_throughput(args):
    """Images/s of the paper-size CIFAR-10 entry's bf16 training step at the recipe's per-GPU batch."""
    import keras

    from keras_avae import zoo

    entry = zoo.describe(args.throughput_entry)
    batch = entry["training"]["batch_size_per_replica"]
    model = zoo.load(args.throughput_entry, weights=None, seed=0, dtype=args.dtype)
    model.compile(optimizer=keras.optimizers.Adamax(1e-4))
    rng = np.random.default_rng(0)
    shape = (batch, *entry["config"]["image_shape"])
    count = args.throughput_warmup + args.throughput_steps
    batches = [rng.integers(0, 256, shape).astype("float32") / 127.5 - 1.0 for _ in range(count)]
    seconds, warmup_seconds = _timed_steps(model, batches, warmup=args.throughput_warmup)
    return {"entry": args.throughput_entry, "parameters": model.count_params(), "batch": batch,
            "seconds_per_step": seconds, "images_per_second": batch / seconds, "warmup_seconds": warmup_seconds}


class _Batches:
    """Dynamically binarised, padded training batches: a fresh permutation every pass."""

    def __init__(self, grey, batch_size, seed):
        from keras_avae.datasets.pipeline import _PAD  # the 28x28 -> 32x32 padding of the tf.data pipeline

        self.padding = [(0, 0), (_PAD, _PAD), (_PAD, _PAD), (0, 0)]
        self.grey = grey.astype(np.float32)
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)
        self.order, self.position = self.rng.permutation(len(grey)), 0

    def __next__(self):
        if self.position + self.batch_size > len(self.order):
            self.order, self.position = self.rng.permutation(len(self.grey)), 0
        index = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        p = self.grey[index]
        x = (self.rng.random(p.shape, dtype=np.float32) < p).astype(np.float32)
        return np.pad(x, self.padding)


def train(args, data, results, output):
    """Trains `args.entry` for about `args.train_seconds`; returns the trained model.

    The step is compiled once (on JAX a compile of the paper-size step takes
    minutes): the optimizer gets a plain learning rate that the loop sets
    from the recipe's schedule before every step, so the step timed first
    is the one that trains, whatever the run's length turns out to be.
    """
    import keras

    from keras_avae import zoo
    from keras_avae.training import KLWarmup
    from keras_avae.training import make_optimizer
    from keras_avae.training import make_schedule
    from keras_avae.training import resolve_recipe
    from keras_avae.training.optimizers import check_guard_policy

    # `--init-weights` continues an earlier run's shipped float16 weights (a new schedule, fresh optimizer slots).
    model = zoo.load(args.entry, weights=args.init_weights, seed=0, dtype=args.dtype)
    check_guard_policy(model)  # --dtype mixed_float16 would hide NaN steps from the guard
    initial = model.get_weights()

    def plan(epochs):
        return resolve_recipe(
            args.entry,
            learning_rate=args.learning_rate,
            min_learning_rate=min(args.min_learning_rate, args.learning_rate),
            epochs=epochs,
            warmup_epochs=max(1, round(0.05 * epochs)),
            kl_warmup_epochs=0 if args.kl_warmup_fraction == 0 else max(1, round(args.kl_warmup_fraction * epochs)),
        )

    optimizer = make_optimizer(plan(1), args.steps_per_epoch, 1, schedule=False)
    model.compile(optimizer=optimizer)
    optimizer.build(model.trainable_variables)
    fresh = [keras.ops.convert_to_numpy(v) for v in optimizer.variables]
    # The step time sets the schedule's length; the timing steps' updates are discarded.
    while True:
        batches = _Batches(data["train_grey"], args.batch_size, seed=args.data_seed)
        try:
            step_seconds, warmup_seconds = _timed_steps(
                model, [next(batches) for _ in range(args.timing_steps + 3)], warmup=3
            )
            break
        except Exception as error:  # one GPU call must not be lost to a batch too large
            if not _out_of_memory(error) or args.batch_size < 32:
                raise
            print(f"batch {args.batch_size}: out of GPU memory; trying {args.batch_size // 2}", flush=True)
            args.batch_size //= 2
            _free_memory()
    model.set_weights(initial)
    for variable, value in zip(optimizer.variables, fresh):
        variable.assign(value)
    steps = max(args.steps_per_epoch, int(args.train_seconds / step_seconds))
    epochs = max(1, steps // args.steps_per_epoch)
    steps = epochs * args.steps_per_epoch
    recipe = plan(epochs)
    # The schedule's rate for every optimizer step (a skipped non-finite step does not advance it).
    rates = keras.ops.convert_to_numpy(make_schedule(recipe, args.steps_per_epoch, epochs)(np.arange(steps)))
    kl = KLWarmup(recipe["kl_warmup_epochs"], recipe["kl_min"])
    results["training"] = {
        "entry": args.entry, "dtype": args.dtype, "batch_size": args.batch_size,
        "init_weights": args.init_weights, "data_seed": args.data_seed,
        "parameters": model.count_params(), "timed_step_seconds": step_seconds,
        "warmup_seconds": warmup_seconds,  # the first 3 steps, the compile included
        "steps_planned": steps, "pseudo_epoch_steps": args.steps_per_epoch,
        "recipe": {k: recipe[k] for k in ("learning_rate", "min_learning_rate", "warmup_epochs",
                                          "kl_warmup_epochs", "kl_min", "epochs")},
        "train_images": int(len(data["train_grey"])),
    }
    _write(output, results)
    print(json.dumps(results["training"]), flush=True)
    start = time.perf_counter()
    history = []
    for step in range(steps):
        if step % args.steps_per_epoch == 0:
            model.kl_weight.assign(kl.beta(step // args.steps_per_epoch))
        optimizer.learning_rate = rates[int(keras.ops.convert_to_numpy(optimizer.iterations))]
        logs = model.train_on_batch(next(batches), return_dict=True)
        if step % args.log_every == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            row = {"step": step + 1, "seconds": round(elapsed, 1), "learning_rate": float(optimizer.learning_rate),
                   **{k: round(float(v), 4) for k, v in logs.items()}}
            history.append(row)
            print(json.dumps(row), flush=True)
        if step + 1 >= args.steps_per_epoch and time.perf_counter() - start > 1.15 * args.train_seconds:
            print(f"stopping at step {step + 1} of {steps}: over the time budget", flush=True)
            break
    seconds = time.perf_counter() - start
    done = step + 1
    results["training"].update(
        steps=done, images_seen=done * args.batch_size, seconds=seconds,
        images_per_second=done * args.batch_size / seconds, epochs_of_data=done * args.batch_size / len(data["train_grey"]),
        optimizer_iterations=int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        history=history,
    )
    _write(output, results)
    return model


def save_float16(model, args, output):
    """The trained weights as the zoo ships them: a float16 `.weights.h5`."""
    from fill_card import float16_copy

    from keras_avae import zoo

    # From an uncompiled float32 copy: a compiled model's file also holds the optimizer's slots.
    copy = zoo.load(args.entry, weights=None, seed=0)
    copy.set_weights(model.get_weights())
    full = output / "float32.weights.h5"
    copy.save_weights(str(full))
    half = output / f"{args.entry}.float16.weights.h5"
    float16_copy(full, half)
    full.unlink()  # 32 MB: over what comes back from the machine
    return half


def _write_parts(path, mib):
    """`path` again as `path.part0`, `path.part1`, ... of at most `mib` MiB: the device returns
    files of at most 16 MiB, and `cat` joins the parts."""
    content, size = path.read_bytes(), int(mib * 2**20)
    for i in range(0, len(content), size):
        path.with_name(f"{path.name}.part{i // size}").write_bytes(content[i : i + size])


def evaluate(args, data, weights, results, output):
    """K-sample NLL, in float32 with TF32 off, of `zoo.load(entry)` with the float16 weights."""
    from keras_avae import evaluation, zoo

    model = zoo.load(args.entry, weights=str(weights))
    test = data["test"].astype(np.float32)
    start = time.perf_counter()

    def batches():
        for i in range(0, len(test), _EVALUATE_BATCH):
            if time.perf_counter() - start > args.eval_seconds:
                return
            yield test[i : i + _EVALUATE_BATCH]

    def report(images, log_px, seconds):
        print(f"evaluate: {images} images, NLL so far {-log_px.mean():.2f} nats, {seconds:.0f} s", flush=True)

    from fill_card import _sha256

    # What a progress file must match to be continued (as `keras-avae evaluate --progress`).
    run_info = {"name": args.entry, "weights_sha256": _sha256(weights), "every": int(data["every"]),
                "batch_size": _EVALUATE_BATCH}
    with _full_float32():
        scores = evaluation.score_batches(
            model, batches(), num_samples=args.num_samples, seed=_EVALUATE_SEED, report=report,
            chunk_size=args.chunk_size, progress_path=args.progress, run_info=run_info,
        )
    np.savez(output / "scores.npz", log_px=scores["log_px"], elbo=scores["elbo"])
    results["evaluation"] = {
        "num_samples": args.num_samples, "images": int(len(scores["log_px"])),
        "resumed_images": scores["resumed_images"],
        "chunk_size": args.chunk_size, "weights_sha256": run_info["weights_sha256"], "of_prepared": int(len(test)), "every": int(data["every"]), "seconds": scores["seconds"],
        **evaluation.summarize(scores["log_px"], scores["elbo"], model.num_data_dims),
    }
    _write(output, results)
    print(json.dumps(results["evaluation"]), flush=True)


def run(args):
    import keras

    started = time.perf_counter()
    output = pathlib.Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    backend = keras.backend.backend()
    framework = importlib.import_module(backend)
    if backend == "torch":
        # Fixed shapes: let cuDNN time its convolution algorithms once per shape (XLA autotunes itself).
        framework.backends.cudnn.benchmark = True
    results = {"backend": backend, "keras": keras.__version__, backend: framework.__version__, "device": _device_name()}
    print(json.dumps(results), flush=True)
    data = dict(np.load(args.data))
    if args.weights:
        weights = pathlib.Path(args.weights)  # trained before: score it only
    else:
        model = train(args, data, results, output)
        peak = gpu_peak_bytes(_backend())
        results["training"]["peak_gpu_memory_gib"] = None if peak is None else peak / 2**30
        weights = save_float16(model, args, output)
        if args.split_mib:
            _write_parts(weights, args.split_mib)
        del model
        _free_memory()
    if args.eval_seconds > 0:
        evaluate(args, data, weights, results, output)
        _free_memory()
    else:  # trained only: scored in a later call (`--weights`), which pays for its own compile
        results["evaluation"] = {"skipped": "--eval-seconds 0"}
    left = args.deadline_seconds - (time.perf_counter() - started)
    if args.cifar10 and left > args.throughput_seconds:
        try:
            results["cifar10_throughput"] = cifar10_throughput(args)
        except Exception as e:  # a failed side measurement must not cost the results above
            results["cifar10_throughput"] = {"error": f"{type(e).__name__}: {e}"}
    elif args.cifar10:
        results["cifar10_throughput"] = {"skipped": f"{left:.0f} s left of --deadline-seconds"}
    print(json.dumps(results.get("cifar10_throughput")), flush=True)
    _write(output, results)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="write the .npz `run` reads (needs TensorFlow)")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--every", type=int, default=6, help="every N-th test image")
    r = commands.add_parser("run", help="train, save and score on the GPU (PyTorch or JAX backend)")
    r.add_argument("--data", required=True)
    r.add_argument("--output", required=True)
    r.add_argument("--entry", default="omniglot-attentive")
    r.add_argument("--dtype", default="mixed_bfloat16")
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--learning-rate", type=float, default=1e-2)
    r.add_argument("--min-learning-rate", type=float, default=1e-4, help="the cosine's end (at most --learning-rate)")
    r.add_argument("--kl-warmup-fraction", type=float, default=0.2)
    r.add_argument("--train-seconds", type=float, default=270)
    r.add_argument("--eval-seconds", type=float, default=150, help="scoring budget; 0 skips scoring")
    r.add_argument("--num-samples", type=int, default=500)
    r.add_argument("--chunk-size", type=int, default=None, help="samples per top-down pass in scoring")
    r.add_argument("--weights", help="score these float16 weights instead of training")
    r.add_argument("--split-mib", type=float, help="also write the weights in parts of this many MiB")
    r.add_argument("--init-weights", help="train on from these float16 weights instead of fresh ones")
    r.add_argument("--data-seed", type=int, default=0, help="seed of the batches' order and binarisation")
    r.add_argument("--progress", help="a progress .npz: scoring continues where it stopped")
    r.add_argument("--steps-per-epoch", type=int, default=50, help="steps per schedule 'epoch'")
    r.add_argument("--timing-steps", type=int, default=10)
    r.add_argument("--log-every", type=int, default=50)
    r.add_argument("--throughput-entry", default="cifar10-attentive", help="the CIFAR-10 entry timed last")
    r.add_argument("--no-cifar10", dest="cifar10", action="store_false")
    r.add_argument("--deadline-seconds", type=float, default=540, help="time the CIFAR-10 step last only within this")
    r.add_argument("--throughput-seconds", type=float, default=60, help="time the CIFAR-10 step needs")
    r.add_argument("--throughput-warmup", type=int, default=3, help="untimed CIFAR-10 steps (cuDNN's autotuning)")
    r.add_argument("--throughput-steps", type=int, default=4, help="timed CIFAR-10 steps")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args)
    else:
        if not args.eval_seconds >= 0:
            parser.error(f"--eval-seconds must be at least 0. Received: --eval-seconds {args.eval_seconds}")
        if args.split_mib is not None and not args.split_mib > 0:
            parser.error(f"--split-mib must be positive. Received: --split-mib {args.split_mib}")
        if args.throughput_steps < 1 or args.throughput_warmup < 0:
            parser.error(
                "--throughput-steps must be at least 1 and --throughput-warmup at least 0. "
                f"Received: --throughput-steps {args.throughput_steps} --throughput-warmup {args.throughput_warmup}"
            )
        if _backend() not in ("torch", "jax"):
            parser.error(f"`run` needs KERAS_BACKEND=torch or jax. Received: KERAS_BACKEND={_backend()!r}")
        run(args)


if __name__ == "__main__":
    main()
