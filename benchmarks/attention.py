"""FAVOR+ (`PerformerAttention`) against exact `keras.layers.MultiHeadAttention`.

For each sequence length and method, a fresh subprocess builds one layer
(self-attention on a `(batch, length, heads * key_dim)` input), compiles one
training step (forward, mean-squared loss, gradients with respect to the
weights and the input) and reports the median wall time of `--repeats` steps
and the peak memory: on CPU the growth of the process's peak resident set
size (`ru_maxrss`) over its value just before the first step; on a GPU the
framework's peak device memory. The step is `jax.jit` of
`jax.value_and_grad` on JAX, a `tf.function(jit_compile=True)` with a
`GradientTape` on TensorFlow, and eager `backward()` on PyTorch; the backend
is `KERAS_BACKEND`.

Exact attention is skipped (and reported as such) when its (T, T) scores
would not fit in the available memory, and any run that exceeds `--timeout`
seconds is reported as timed out.

    KERAS_BACKEND=jax python benchmarks/attention.py
    KERAS_BACKEND=jax python benchmarks/attention.py --lengths 1024 4096 --causal
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from device_memory import gpu_peak_bytes  # benchmarks/, this script's folder

METHODS = ("exact", "favor")
# Upper estimate of the number of B * N * T^2 float32 tensors alive at the
# peak of exact attention's forward + backward pass (measured on JAX/CPU at
# T = 16384: about 5), used only to refuse runs that cannot fit.
EXACT_SCORE_COPIES = 6


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per measurement (after one warm-up)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--key-dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=256, help="FAVOR+ random features per head")
    parser.add_argument("--causal", action="store_true", help="benchmark causal (masked) attention")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per (method, length)")
    # Internal: one measurement, run in a fresh process by the driver.
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# === Worker: one (method, length) in this process ===


def _peak_rss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _make_step(layer, x, causal, backend):
    """A compiled forward + backward step; returns a function that runs it to completion."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss_fn(trainable, x):
            out, _ = layer.stateless_call(trainable, non_trainable, x, x, use_causal_mask=causal)
            return jnp.mean(jnp.square(out))

        grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
        x = jnp.asarray(x)
        return lambda: jax.block_until_ready(grad_fn(trainable, x))
    if backend == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)

        @tf.function(jit_compile=True)
        def grad_fn(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_mean(tf.square(layer(x, x, use_causal_mask=causal)))
            return loss, tape.gradient(loss, [*layer.trainable_variables, x])

        return lambda: [t.numpy() for t in tf.nest.flatten(grad_fn(x))]
    if backend == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.tensor(x, device=device, requires_grad=True)

        def step():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            loss = torch.mean(torch.square(layer(x, x, use_causal_mask=causal)))
            loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            return loss.item()

        return step
    raise ValueError(f"Unsupported backend: {backend}")


def run_worker(args):
    import keras
    import numpy as np

    from keras_avae.layers import PerformerAttention

    backend = keras.backend.backend()
    shape = (args.batch, args.length, args.heads * args.key_dim)
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    if args.worker == "favor":
        layer = PerformerAttention(args.heads, args.key_dim, num_random_features=args.features, seed=0)
    else:
        layer = keras.layers.MultiHeadAttention(args.heads, args.key_dim)
    layer.build(shape, shape)
    step = _make_step(layer, x, args.causal, backend)

    rss_before = _peak_rss_bytes()
    start = time.perf_counter()
    step()  # compilation + first run
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    gpu_peak = gpu_peak_bytes(backend)
    result = {
        "backend": backend,
        "device": "gpu" if gpu_peak is not None else "cpu",
        "median_s": statistics.median(times),
        "first_step_s": compile_s,
        "memory_bytes": gpu_peak if gpu_peak is not None else _peak_rss_bytes() - rss_before,
    }
    print("RESULT " + json.dumps(result), flush=True)


# === Driver: one subprocess per measurement, then the table ===


def _available_memory_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(args, method, length):
    """Runs one measurement in a fresh process; returns its result dict or a status string."""
    if method == "exact":
        needed = EXACT_SCORE_COPIES * 4 * args.batch * args.heads * length**2
        available = _available_memory_bytes()
        if available is not None and needed > 0.7 * available:
            return f"skipped: needs ~{needed / 2**30:.0f} GiB, {available / 2**30:.0f} GiB free"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        method,
        "--length",
        str(length),
        "--repeats",
        str(args.repeats),
        "--batch",
        str(args.batch),
        "--heads",
        str(args.heads),
        "--key-dim",
        str(args.key_dim),
        "--features",
        str(args.features),
    ] + (["--causal"] if args.causal else [])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out (> {args.timeout:.0f} s)"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    if done.returncode < 0:
        return f"killed by signal {-done.returncode} (out of memory?)"
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"failed: {tail[:80]}"


def _time_cell(result):
    return f"{result['median_s'] * 1e3:.1f}" if isinstance(result, dict) else result


def _memory_cell(result):
    return f"{result['memory_bytes'] / 2**20:.0f}" if isinstance(result, dict) else "-"


def crossover(lengths, results):
    """Shortest length from which on FAVOR+ is faster at every longer measured length.

    A length where exact attention could not run (skipped, timed out, out of
    memory) while FAVOR+ did counts as FAVOR+ being faster.
    """

    def favor_faster(length):
        favor, exact = results[("favor", length)], results[("exact", length)]
        return isinstance(favor, dict) and (not isinstance(exact, dict) or favor["median_s"] < exact["median_s"])

    found = None
    for length in sorted(lengths, reverse=True):
        if not favor_faster(length):
            break
        found = length
    return found


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    results = {}
    for length in args.lengths:
        for method in METHODS:
            results[(method, length)] = measure(args, method, length)
            print(f"# {method:5s} L={length}: {_time_cell(results[(method, length)])}", file=sys.stderr, flush=True)
    done = [r for r in results.values() if isinstance(r, dict)]
    backend = done[0]["backend"] if done else os.environ.get("KERAS_BACKEND", "?")
    device = done[0]["device"] if done else "?"
    memory = "peak device memory" if device == "gpu" else "peak RSS growth"
    print(
        f"\nForward + backward, backend {backend} on {device}: batch {args.batch}, {args.heads} heads, "
        f"key_dim {args.key_dim}, {args.features} random features, {'causal' if args.causal else 'non-causal'}, "
        f"median of {args.repeats}.\n"
    )
    print(f"| length | exact (ms) | FAVOR+ (ms) | speed-up | exact {memory} (MiB) | FAVOR+ {memory} (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        exact, favor = results[("exact", length)], results[("favor", length)]
        speedup = (
            f"{exact['median_s'] / favor['median_s']:.2f}x"
            if isinstance(exact, dict) and isinstance(favor, dict)
            else "-"
        )
        print(
            f"| {length} | {_time_cell(exact)} | {_time_cell(favor)} | {speedup} "
            f"| {_memory_cell(exact)} | {_memory_cell(favor)} |"
        )
    length = crossover(args.lengths, results)
    if length is None:
        print("\nCrossover: none, FAVOR+ is not faster at the longest measured length.")
    elif length == min(args.lengths):
        print(f"\nCrossover: FAVOR+ is faster at every measured length, from {length} on.")
    else:
        print(f"\nCrossover: FAVOR+ is faster from length {length} on (every longer measured length too).")


if __name__ == "__main__":
    main()
