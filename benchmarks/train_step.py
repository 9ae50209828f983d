"""Training-step time and peak memory of the CIFAR-10 zoo variants.

Each variant (cifar10-attentive, cifar10-baseline, cifar10-performer) is
built from the zoo with the same size overrides and trained with
`model.train_on_batch` on random 8-bit images in [-1, 1]; after `--warmup`
steps (compilation) the median of `--steps` step times is reported. Every
variant runs in a fresh subprocess, so the peak resident memory (CPU) or the
framework's peak device memory (GPU) is that variant's alone.

Usage:
    KERAS_BACKEND=jax python benchmarks/train_step.py            # reduced size
    KERAS_BACKEND=jax python benchmarks/train_step.py --full     # paper size
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from device_memory import gpu_peak_bytes  # benchmarks/, this script's folder

VARIANTS = ("cifar10-attentive", "cifar10-baseline", "cifar10-performer")
REDUCED = dict(num_layers=4, preprocess_filters=32, decoder_filters=32, nonlocal_num_random_features=64)


def measure(name, overrides, batch_size, steps, warmup):
    import keras
    import numpy as np

    import keras_avae

    model = keras_avae.zoo.load(name, weights=None, seed=0, **overrides)
    model.compile(optimizer=keras.optimizers.Adamax(1e-2))
    rng = np.random.default_rng(0)
    shape = (batch_size, *model.image_shape)
    x = (rng.integers(0, 256, shape) / 127.5 - 1.0).astype("float32")
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        logs = model.train_on_batch(x, return_dict=True)
        float(logs["loss"])  # wait for the step to finish
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "name": name,
        "params": int(sum(int(np.prod(w.shape)) for w in model.trainable_weights)),
        "median_ms": 1000 * statistics.median(times),
        "images_per_s": batch_size / statistics.median(times),
        "peak_mb": peak_memory_mb(),
        "nelbo": float(logs["nelbo"]),
    }


def peak_memory_mb():
    try:
        peak = gpu_peak_bytes(os.environ.get("KERAS_BACKEND", "tensorflow"))
        if peak is not None:
            return peak / 2**20
    except Exception:  # memory statistics are best-effort per platform
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="paper size instead of the reduced config")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides (JSON values)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = {} if args.full else dict(REDUCED)
    for item in args.set:
        key, value = item.split("=", 1)
        overrides[key] = json.loads(value)

    if args.child:
        print(json.dumps(measure(args.child, overrides, args.batch_size, args.steps, args.warmup)))
        return

    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    size = "paper size" if args.full else f"reduced: {overrides}"
    print(f"backend={backend}, batch={args.batch_size}, {size}, median of {args.steps} steps after {args.warmup}\n")
    print("| variant | trainable params | median step (ms) | images/s | peak memory (MB) |")
    print("|---|---:|---:|---:|---:|")
    for name in args.variants:
        command = [sys.executable, __file__, "--child", name, "--batch-size", str(args.batch_size)]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        command += (["--full"] if args.full else []) + (["--set", *args.set] if args.set else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"| {name} | failed: {done.stderr.strip().splitlines()[-1]} | | | |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['params']:,} | {r['median_ms']:.1f} | {r['images_per_s']:.1f} | {r['peak_mb']:.0f} |")


if __name__ == "__main__":
    main()
