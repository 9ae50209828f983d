"""Data-parallel training throughput on JAX: 1 device against N host devices.

For each device count this starts a fresh process (XLA fixes its host
device count when JAX starts), gives JAX that many CPU devices through
`training.make_strategy(..., cpu_devices=N)` (XLA's host platform device
count), builds `keras_avae.zoo.load(entry, weights=None, seed=0)` inside the
resulting `keras.distribution.DataParallel` scope (no distribution for one
device), compiles it with Adamax and `jax.jit`, and times `train_on_batch`
on one fixed batch of random binary images. It prints the median step time
over `--steps` steps after 2 warm-up steps, and images/s, for the same
global batch on every device count (the batch is split over the devices).

On a GPU machine the devices are the GPUs instead (`--gpu`). On a CPU the
host devices share the same cores, so this measures the overhead of the
data-parallel program rather than a speed-up; the figure that matters is
that it stays close to 1.

Usage:
    KERAS_BACKEND=jax python benchmarks/data_parallel.py
    KERAS_BACKEND=jax python benchmarks/data_parallel.py --entry mnist-attentive-small --devices 1 2 --batch 32
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(entry, devices, batch, steps, gpu):
    """Runs in the child process: median step seconds on `devices` devices."""
    from keras_avae import training

    kind = "mirrored" if devices > 1 else "one-device"
    distribution = training.make_strategy(kind, cpu_devices=None if gpu else devices)
    import contextlib

    import keras
    import numpy as np

    from keras_avae import zoo

    scope = distribution.scope() if distribution is not None else contextlib.nullcontext()
    with scope:
        model = zoo.load(entry, weights=None, seed=0)
        model.compile(optimizer=keras.optimizers.Adamax(1e-3), jit_compile=True)
        shape = (batch, *model.image_shape)
        x = (np.random.default_rng(0).random(shape) > 0.5).astype("float32")
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            model.train_on_batch(x, return_dict=True)
            times.append(time.perf_counter() - start)
    return {
        "devices": training.num_replicas(distribution),
        "step_s": statistics.median(times[2:]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default="mnist-baseline-small")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=32, help="global batch, split over the devices")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu", action="store_true", help="use the GPUs as they are (no host devices)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        result = measure(args.entry, args.child, args.batch, args.steps, args.gpu)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if os.environ.get("KERAS_BACKEND") != "jax":
        sys.exit(f"run with KERAS_BACKEND=jax. Received: KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}")
    print(f"{args.entry}, global batch {args.batch}, median of {args.steps} steps")
    print(f"{'devices':>8} {'step ms':>9} {'images/s':>9} {'vs 1':>6}")
    first = None
    for devices in args.devices:
        command = [sys.executable, os.path.abspath(__file__), "--child", str(devices), "--entry", args.entry]
        command += ["--batch", str(args.batch), "--steps", str(args.steps)] + (["--gpu"] if args.gpu else [])
        env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{devices} devices failed:\n{done.stderr[-3000:]}")
        result = json.loads(lines[-1][len("RESULT ") :])
        rate = args.batch / result["step_s"]
        first = first or rate
        print(f"{result['devices']:>8} {1000 * result['step_s']:>9.1f} {rate:>9.1f} {rate / first:>6.2f}")


if __name__ == "__main__":
    main()
