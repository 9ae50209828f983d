"""Training throughput per backend and zoo entry, old code against new.

For every backend and entry this prints images/s of a bare compiled
training step, GFLOP/s from a FLOP count, the fraction of this machine's
convolution rate (measured in the same process), the first-step trace time,
and the per-step cost of the real `keras-avae train` against the bare step.
With `--baseline-rev REV` the same measurements also run on the package of
git revision REV (extracted into a temporary folder and imported through
`PYTHONPATH`), interleaved with the working tree's (old, new, old, new for
`--rounds`) so that load changes hit both; medians over rounds are printed
with the new/old factors.

What each figure is:

- bare step: a fresh process builds `keras_avae.zoo.load(name, weights=None,
  seed=0)`, compiles it with the optimizer `keras-avae train` uses
  (`--optimizer recipe`, the default: that code version's
  `keras_avae.training.make_optimizer` for the entry's recipe, i.e.
  `NonFiniteGuard` around Adamax on the warm-up schedule) or with a plain
  `keras.optimizers.Adamax(1e-3)` (`--optimizer adamax`), and
  `jit_compile="auto"` (what `keras-avae train` uses: graph mode without
  XLA for TensorFlow on CPU, `jax.jit` on JAX, eager on torch) and calls
  `train_on_batch` on one fixed
  random batch (binary images; 8-bit images in [-1, 1] for logistic-mixture
  entries). "step ms" is the median of `--steps` steps after 2 warm-up
  steps; "first-step trace s" is the first call's time (tracing,
  compilation and one step) minus that median.
- FLOPs: one step's loss and gradients (no optimizer) traced once per code
  version as a TensorFlow graph; the count sums Conv2D, both convolution
  backprops, MatMul, BatchMatMul and Einsum ops from their static shapes
  (elementwise ops are not counted). TF's own profiler is not used: it has
  no statistics for the convolution backprops and Einsum. The count is
  backend-independent and serves every backend's GFLOP/s.
- conv GFLOP/s: forward and both backward convolutions of model-shaped 3x3
  convolutions (batch 32: 32x32x16, 16x16x32 and 8x8x64 maps), through
  `keras.ops.conv` and the backend's autodiff, in the bare step's process
  right after its steps; "fraction" is the model's GFLOP/s over this.
- train ms/step: the real `keras-avae train NAME --epochs 2
  --steps-per-epoch N --verbose 2` (`keras_avae.cli.main`, in a process
  that only adds a callback stamping every batch end) on a small
  MNIST-format folder this script writes; the figure is the median
  interval between batch ends in the second epoch (data pipeline,
  optimizer guard and every per-batch callback included; tracing and the
  epoch-end checkpoint and PNG not). Keras' own "ms/step" is whole
  milliseconds, or whole seconds above 1 s, too coarse here. "train/bare"
  divides it by the same code version's bare step.

Usage:
    python benchmarks/train_throughput.py                       # current KERAS_BACKEND
    python benchmarks/train_throughput.py --baseline-rev 8f9aa5c \\
        --entries mnist-attentive-small mnist-baseline-small --json out.json
    python benchmarks/train_throughput.py --backends tensorflow jax torch --rounds 3
    python benchmarks/train_throughput.py --quick               # smoke test, tiny model
"""

import argparse
import gzip
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = ("mnist-attentive-small", "mnist-baseline-small")
# A tiny config for --quick: every entry accepts these overrides.
TINY = dict(num_layers=2, num_scales=1, latent_channels=4, preprocess_filters=4, decoder_filters=4)
# Model-shaped 3x3 convolutions, (batch, height, width, channels) -> channels.
CONV_SHAPES = ((32, 32, 32, 16), (32, 16, 16, 32), (32, 8, 8, 64))
WARMUP = 2


# --------------------------------------------------------------------- #
# Child: measurements inside one fresh process
# --------------------------------------------------------------------- #
def random_batch(model, batch_size):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (batch_size, *model.image_shape)
    if getattr(model, "likelihood", "bernoulli") == "bernoulli":
        return (rng.random(shape) > 0.5).astype("float32")
    return (rng.integers(0, 256, shape) / 127.5 - 1.0).astype("float32")


def median_seconds(fn, steps):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def conv_rate(jit_compile, steps):
    """GFLOP/s of forward + both backward convolutions, as the backend trains."""
    import keras
    import numpy as np
    from keras import ops

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in CONV_SHAPES]
    ks = [(0.1 * rng.standard_normal((3, 3, s[-1], s[-1]))).astype("float32") for s in CONV_SHAPES]
    # A random cotangent: a constant one could be simplified away.
    ws = [rng.standard_normal(s).astype("float32") for s in CONV_SHAPES]
    flops = sum(3 * 2 * math.prod(s) * 9 * s[-1] for s in CONV_SHAPES)

    def loss(xs, ks, ws):
        return sum(ops.sum(ops.conv(x, k, padding="same") * w) for x, k, w in zip(xs, ks, ws))

    if backend == "tensorflow":
        import tensorflow as tf

        args = [[tf.constant(a) for a in group] for group in (xs, ks, ws)]

        @tf.function(jit_compile=bool(jit_compile))
        def step(xs, ks, ws):
            with tf.GradientTape() as tape:
                tape.watch([xs, ks])
                value = loss(xs, ks, ws)
            grads = tape.gradient(value, [xs, ks])
            # The loss is returned too, so the forward convolutions are not pruned.
            return value + tf.add_n([tf.reduce_sum(g) for g in tf.nest.flatten(grads)])

        def run():
            float(step(*args))

    elif backend == "jax":
        import jax

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

        def run():
            jax.block_until_ready(grad(xs, ks, ws))

    else:
        xs_t = [ops.convert_to_tensor(a).requires_grad_() for a in xs]
        ks_t = [ops.convert_to_tensor(a).requires_grad_() for a in ks]
        ws_t = [ops.convert_to_tensor(a) for a in ws]

        def run():
            for t in xs_t + ks_t:
                t.grad = None
            loss(xs_t, ks_t, ws_t).backward()
            float(sum(t.grad.sum() for t in xs_t + ks_t))  # waits for a GPU too

    return flops / median_seconds(run, steps) / 1e9


def _einsum_flops(equation, shapes):
    """2 x the product of all index sizes (ellipsis dimensions included)."""
    inputs = equation.split("->")[0].split(",")
    sizes, ellipsis = {}, []
    for spec, shape in zip(inputs, shapes):
        shape = list(shape)
        if "..." in spec:
            left, right = spec.split("...")
            middle = shape[len(left) : len(shape) - len(right)]
            spec = left + right
            shape = shape[: len(left)] + shape[len(shape) - len(right) :]
            # Broadcast the ellipsis dimensions, aligned from the right.
            ellipsis = [1] * max(0, len(middle) - len(ellipsis)) + ellipsis
            for i, size in enumerate(middle):
                j = len(ellipsis) - len(middle) + i
                ellipsis[j] = max(ellipsis[j], size)
        for letter, size in zip(spec, shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return 2 * math.prod(sizes.values()) * math.prod(ellipsis)


def count_flops(model, x):
    """FLOPs of one step's loss and gradients, from the TensorFlow graph."""
    import tensorflow as tf

    @tf.function
    def loss_and_grads(x):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y_pred=model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    graph = loss_and_grads.get_concrete_function(tf.TensorSpec(x.shape, tf.float32)).graph
    counted, skipped = {}, set()
    for op in graph.get_operations():
        try:
            if op.type == "Conv2D":
                kh, kw, cin, _ = op.inputs[1].shape
                flops = 2 * op.outputs[0].shape.num_elements() * kh * kw * cin
            elif op.type == "Conv2DBackpropInput":
                kh, kw, cin, _ = op.inputs[1].shape
                flops = 2 * op.inputs[2].shape.num_elements() * kh * kw * cin
            elif op.type == "Conv2DBackpropFilter":
                kh, kw, cin, _ = op.outputs[0].shape
                flops = 2 * op.inputs[2].shape.num_elements() * kh * kw * cin
            elif op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3"):
                a = op.inputs[0].shape
                adj = op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x")
                flops = 2 * op.outputs[0].shape.num_elements() * (a[-2] if adj else a[-1])
            elif op.type == "Einsum":
                equation = op.get_attr("equation").decode()
                flops = _einsum_flops(equation, [tuple(t.shape) for t in op.inputs])
            else:
                continue
            counted[op.type] = counted.get(op.type, 0) + int(flops)
        except (TypeError, ValueError):  # a dimension unknown at trace time
            skipped.add(op.type)
    method = "TF graph of loss+gradients: " + ", ".join(sorted(counted)) + " (elementwise ops not counted)"
    if skipped:
        method += f"; skipped ops with unknown shapes: {', '.join(sorted(skipped))}"
    return {"flops": sum(counted.values()), "flops_by_op": counted, "flops_method": method}


def measure(name, overrides, batch_size, steps, flops, optimizer_kind="recipe"):
    import keras
    import numpy as np

    import keras_avae
    from keras_avae import training

    start = time.perf_counter()
    model = keras_avae.zoo.load(name, weights=None, seed=0, **overrides)
    build_s = time.perf_counter() - start
    if optimizer_kind == "recipe":
        # 1875 steps per epoch: MNIST's 60,000 images in batches of 32.
        optimizer = training.make_optimizer(training.resolve_recipe(name), steps_per_epoch=1875)
    else:
        optimizer = keras.optimizers.Adamax(1e-3)
    # "auto" is what `keras-avae train` compiles with.
    model.compile(optimizer=optimizer, jit_compile="auto")
    x = random_batch(model, batch_size)

    def step():
        return float(model.train_on_batch(x, return_dict=True)["loss"])  # waits for the step

    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    step_s = median_seconds(step, steps)
    guard = training.find_guard(model.optimizer)
    if guard is not None and int(keras.ops.convert_to_numpy(guard.nonfinite_steps)):
        # A skipped step is cheaper: its time would not be a training step's.
        raise RuntimeError("the guard skipped non-finite steps; the timings are not training steps")
    result = {
        "keras_avae": os.path.dirname(keras_avae.__file__),
        "backend": keras.backend.backend(),
        "jit_compile": bool(model.jit_compile),
        "optimizer": type(getattr(model.optimizer, "inner_optimizer", model.optimizer)).__name__,
        "params": int(sum(int(np.prod(w.shape)) for w in model.trainable_weights)),
        "build_s": build_s,
        "first_step_s": first_s,
        "trace_s": max(first_s - step_s, 0.0),
        "step_ms": 1000 * step_s,
        "images_per_s": batch_size / step_s,
        "conv_gflops": conv_rate(model.jit_compile, steps),
    }
    if flops:
        try:
            result.update(count_flops(model, x))
        except Exception as error:  # the timings above stand without the count
            result["flops_error"] = f"{type(error).__name__}: {error}"[:200]
    return result


def flops_only(name, overrides, batch_size):
    import keras_avae

    model = keras_avae.zoo.load(name, weights=None, seed=0, **overrides)
    return count_flops(model, random_batch(model, batch_size))


# --------------------------------------------------------------------- #
# Parent: code versions, subprocesses, the table
# --------------------------------------------------------------------- #
def child_env(backend, package_root):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    # A persistent JAX cache would turn later first steps into cache hits.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def run_child(args, mode, name, backend, version, with_flops=False):
    command = [sys.executable, os.path.abspath(__file__), "--child", mode, "--child-entry", name]
    command += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    command += ["--quick"] if args.quick else []
    command += ["--child-flops"] if with_flops else []
    command += ["--optimizer", args.optimizer]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(backend, version["root"]))
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        return {"error": lines[-1][:200]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = os.path.join(version["root"], "keras_avae")
    if mode == "step" and os.path.realpath(result["keras_avae"]) != os.path.realpath(expected):
        return {"error": f"imported {result['keras_avae']}, not {expected}"}
    return result


def write_mnist(directory, num_images):
    """Digit-like 28x28 images (a random stroke blob) as gzip IDX files."""
    import numpy as np

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:28, :28]
    centres = rng.uniform(9, 19, (num_images, 2, 1, 1))
    radius = rng.uniform(4, 8, (num_images, 1, 1))
    distance = np.hypot(yy - centres[:, 0], xx - centres[:, 1])
    images = (np.clip(1.5 - abs(distance - radius), 0, 1) * 255).astype("uint8")
    labels = rng.integers(0, 10, num_images).astype("uint8")
    os.makedirs(directory, exist_ok=True)
    with gzip.open(os.path.join(directory, "train-images-idx3-ubyte.gz"), "wb") as f:
        f.write((2051).to_bytes(4, "big") + num_images.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)
        f.write(images.tobytes())
    with gzip.open(os.path.join(directory, "train-labels-idx1-ubyte.gz"), "wb") as f:
        f.write((2049).to_bytes(4, "big") + num_images.to_bytes(4, "big") + labels.tobytes())


def train_cli(argv):
    """Runs `keras-avae train` with a callback that stamps every batch end."""
    import keras

    from keras_avae import cli

    stamps = []  # one list per epoch

    class Stamps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            stamps.append([])

        def on_train_batch_end(self, batch, logs=None):
            stamps[-1].append(time.perf_counter())

    fit = keras.Model.fit

    def timed_fit(self, *args, callbacks=None, **kwargs):
        return fit(self, *args, callbacks=[*(callbacks or []), Stamps()], **kwargs)

    keras.Model.fit = timed_fit
    status = cli.main(argv)
    if status:
        raise SystemExit(status)
    # The last epoch's steps after its first: no tracing, no epoch-end saving.
    intervals = [b - a for a, b in zip(stamps[-1], stamps[-1][1:])]
    return {
        "train_ms": 1000 * statistics.median(intervals),
        "train_mean_ms": 1000 * statistics.mean(intervals),
        "train_steps_timed": len(intervals),
    }


def run_train(args, name, backend, version, data_dir, work_dir):
    output = tempfile.mkdtemp(prefix="run-", dir=work_dir)
    argv = ["train", name, "--data-dir", data_dir, "--output", output, "--epochs", "2"]
    argv += ["--steps-per-epoch", str(args.train_steps), "--batch-size", str(args.batch_size), "--verbose", "2"]
    for key, value in (TINY.items() if args.quick else ()):
        argv += ["--set", f"{key}={value}"]
    command = [sys.executable, os.path.abspath(__file__), "--child", "train", "--child-argv", json.dumps(argv)]
    start = time.perf_counter()
    env = child_env(backend, version["root"])
    done = subprocess.run(command, capture_output=True, text=True, cwd=work_dir, env=env)
    wall_s = time.perf_counter() - start
    shutil.rmtree(output, ignore_errors=True)
    if done.returncode != 0:
        lines = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
        return {"error": lines[-1][:200]}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "train_wall_s": wall_s}


def code_versions(args, tmp):
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    versions = [{"label": f"new (working tree, HEAD {head.stdout.strip() or '?'})", "key": "new", "root": ROOT}]
    if args.baseline_rev:
        rev = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", args.baseline_rev], capture_output=True, text=True, check=True
        ).stdout.strip()
        root = os.path.join(tmp, f"baseline-{rev}")
        os.makedirs(root)
        # zoo/ too: the package finds its entries in the folder next to it.
        archive = subprocess.Popen(["git", "-C", ROOT, "archive", rev, "keras_avae", "zoo"], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", root], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"git archive {rev} failed")
        versions.insert(0, {"label": f"old ({rev})", "key": "old", "root": root})
    return versions


def median_of(results, key):
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def factor(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", nargs="+", default=list(ENTRIES))
    parser.add_argument("--backends", nargs="+", default=[os.environ.get("KERAS_BACKEND", "tensorflow")])
    parser.add_argument("--baseline-rev", help="git revision of the old code (the issue's: 8f9aa5c)")
    parser.add_argument("--rounds", type=int, default=1, help="old/new pairs of runs; medians are printed")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after 2 warm-up steps")
    parser.add_argument(
        "--optimizer",
        choices=("recipe", "adamax"),
        default="recipe",
        help="bare step's optimizer: the entry's recipe as `keras-avae train` builds it, or plain Adamax(1e-3)",
    )
    parser.add_argument("--train-steps", type=int, default=20, help="steps per epoch of `keras-avae train`")
    parser.add_argument("--no-train", action="store_true", help="skip the `keras-avae train` runs")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 2 steps, first entry only")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--child", choices=("step", "flops", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--child-entry", help=argparse.SUPPRESS)
    parser.add_argument("--child-argv", help=argparse.SUPPRESS)
    parser.add_argument("--child-flops", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = dict(TINY) if args.quick else {}

    if args.child == "step":
        print(json.dumps(measure(args.child_entry, overrides, args.batch_size, args.steps, args.child_flops, args.optimizer)))
        return
    if args.child == "flops":
        print(json.dumps(flops_only(args.child_entry, overrides, args.batch_size)))
        return
    if args.child == "train":
        print(json.dumps(train_cli(json.loads(args.child_argv))))
        return
    if args.quick:
        args.entries, args.steps, args.train_steps = args.entries[:1], 2, 2

    tmp = tempfile.mkdtemp(prefix="keras-avae-throughput-")
    try:
        report = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def run(args, tmp):
    versions = code_versions(args, tmp)
    data_dir = os.path.join(tmp, "mnist")
    if not args.no_train:
        write_mnist(data_dir, 2 * args.train_steps * args.batch_size)
    flops = {}  # (version, entry) -> the count, from the first TensorFlow process
    report = {"settings": vars(args), "versions": versions, "results": []}
    for backend in args.backends:
        for name in args.entries:
            steps = {v["key"]: [] for v in versions}
            trains = {v["key"]: [] for v in versions}
            for _ in range(args.rounds):
                for version in versions:  # old, new, old, new, ...
                    need = backend == "tensorflow" and (version["key"], name) not in flops
                    result = run_child(args, "step", name, backend, version, with_flops=need)
                    steps[version["key"]].append(result)
                    if need and "flops" in result:
                        flops[version["key"], name] = result
                    elif "flops_error" in result:
                        flops[version["key"], name] = {"error": result["flops_error"]}
            for _ in range(0 if args.no_train else args.rounds):
                for version in versions:
                    trains[version["key"]].append(run_train(args, name, backend, version, data_dir, tmp))
            for version in versions:
                key = version["key"]
                if (key, name) not in flops:
                    flops[key, name] = run_child(args, "flops", name, "tensorflow", version)
                row = {"backend": backend, "entry": name, "version": key, "label": version["label"]}
                for figure in ("images_per_s", "step_ms", "conv_gflops", "trace_s", "first_step_s", "build_s"):
                    row[figure] = median_of(steps[key], figure)
                row["train_ms"] = median_of(trains[key], "train_ms")
                row["flops"] = flops[key, name].get("flops")
                row["flops_method"] = flops[key, name].get("flops_method")
                row["errors"] = [r["error"] for r in steps[key] + trains[key] + [flops[key, name]] if "error" in r]
                row["jit_compile"] = next((r["jit_compile"] for r in steps[key] if "jit_compile" in r), None)
                row["optimizer"] = next((r["optimizer"] for r in steps[key] if "optimizer" in r), None)
                gflops = row["flops"] and row["step_ms"] and row["flops"] / row["step_ms"] / 1e6
                row["gflops_per_s"] = gflops or None
                row["conv_fraction"] = gflops / row["conv_gflops"] if gflops and row["conv_gflops"] else None
                bare = row["train_ms"] and row["step_ms"]
                row["train_over_bare"] = row["train_ms"] / row["step_ms"] if bare else None
                row["rounds"] = {"step": steps[key], "train": trains[key]}
                report["results"].append(row)
    print_table(args, versions, report["results"])
    return report


def print_table(args, versions, rows):
    print(
        f"batch {args.batch_size}, step = median of {args.steps} train_on_batch calls after {WARMUP} warm-up, "
        f"medians over {args.rounds} round(s){', tiny model (--quick)' if args.quick else ''}; "
        f"bare-step optimizer: {args.optimizer} ("
        + ", ".join(sorted({f"{r['label'].split(' ')[0]} {r['optimizer']}" for r in rows if r["optimizer"]}))
        + ")"
    )
    for row in rows:
        if row["flops"] and row["backend"] == rows[0]["backend"]:  # the same count on every backend
            label = row["label"].split(" ")[0]
            print(f"FLOPs per step, {row['entry']}, {label}: {row['flops'] / 1e9:.2f} GFLOP ({row['flops_method']})")
    print()
    print(
        "| backend | entry | code | images/s | step ms | GFLOP/s | conv GFLOP/s | fraction of conv "
        "| first-step trace s | train ms/step | train/bare |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    per_round = []
    for i, row in enumerate(rows):
        print(
            f"| {row['backend']} | {row['entry']} | {row['label']} | {fmt(row['images_per_s'], '.1f')} "
            f"| {fmt(row['step_ms'], '.1f')} | {fmt(row['gflops_per_s'], '.2f')} | {fmt(row['conv_gflops'], '.2f')} "
            f"| {fmt(row['conv_fraction'], '.3f')} | {fmt(row['trace_s'], '.2f')} | {fmt(row['train_ms'], '.1f')} "
            f"| {fmt(row['train_over_bare'], '.2f')} |"
        )
        old = rows[i - 1] if i and row["version"] == "new" and rows[i - 1]["version"] == "old" else None
        if not old:
            continue
        # Every factor reads "new is N times better": >1 is an improvement.
        cells = [
            factor(row["images_per_s"], old["images_per_s"]),
            factor(old["step_ms"], row["step_ms"]),
            factor(row["gflops_per_s"], old["gflops_per_s"]),
            factor(row["conv_gflops"], old["conv_gflops"]),
            factor(row["conv_fraction"], old["conv_fraction"]),
            factor(old["trace_s"], row["trace_s"]),
            factor(old["train_ms"], row["train_ms"]),
        ]
        print(f"| {row['backend']} | {row['entry']} | **new vs old** | {' | '.join(cells)} | |")
        if len(row["rounds"]["step"]) > 1:
            # Whole processes differ by up to a third on this kind of
            # machine: the paired rounds show how far the medians hold.
            pairs = {
                figure: " ".join(
                    factor(o.get(figure), n.get(figure)) for o, n in zip(old["rounds"][group], row["rounds"][group])
                )
                for figure, group in (("step_ms", "step"), ("trace_s", "step"), ("train_ms", "train"))
            }
            per_round.append(
                f"per round, old/new, {row['backend']} {row['entry']}: step {pairs['step_ms']}; "
                f"trace {pairs['trace_s']}; train {pairs['train_ms'] or '-'}"
            )
    for row in rows:
        for error in row["errors"]:
            print(f"failed: {row['backend']} {row['entry']} {row['label']}: {error}")
    for line in per_round:
        print(line)
    print(
        "\nnew vs old: images/s and GFLOP/s new/old; step ms, trace s and train ms/step old/new (>1: new is better). "
        "fraction of conv = GFLOP/s / conv GFLOP/s of the same process."
    )


if __name__ == "__main__":
    main()
