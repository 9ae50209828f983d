"""Inference passes (`keras_avae.inference_passes`) against the same passes run eagerly.

For one zoo entry this times, in a fresh process per mode, the first call
(compilation included) and the next call of `reconstruct` (32 images),
`encode` (32), `sample` (64), the ELBO of 100 images (what `evaluate` and
`demo` compute next to the NLL) and `inspection.kl_per_layer` (100).
"eager" runs each pass's function directly, as keras-avae did before the
passes existed; "pass" is what the methods run now (one `jax.jit` per
shape on JAX; the function under `torch.no_grad()` on PyTorch; the function
itself on TensorFlow). The model is `zoo.load(name)` with its pretrained
weights where it has them; the images are its data set's shipped sample.

Usage:
    KERAS_BACKEND=jax python benchmarks/inference_speed.py
    KERAS_BACKEND=jax python benchmarks/inference_speed.py --name omniglot-attentive-small
    KERAS_BACKEND=tensorflow python benchmarks/inference_speed.py --tiny
"""

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = ("reconstruct", "encode", "sample", "elbo", "kl_per_layer")


def measure(name, mode, tiny):
    """Seconds of the first and the next call of each method, in this process."""
    import keras_avae
    from keras_avae import datasets
    from keras_avae import evaluation
    from keras_avae import inference_passes
    from keras_avae import inspection

    if mode == "eager":
        inference_passes.inference_pass = lambda model, name, fn, *args, **kwargs: fn
    overrides = dict(num_layers=2, preprocess_filters=4, decoder_filters=4) if tiny else {}
    weights = "pretrained" if keras_avae.zoo.has_pretrained(name) and not tiny else None
    start = time.perf_counter()
    model = keras_avae.zoo.load(name, weights=weights, seed=0, **overrides)
    figures = {"load": time.perf_counter() - start}
    x = datasets.shipped_sample(keras_avae.zoo.describe(name)["dataset"], 100, seed=0)
    calls = {
        "reconstruct": lambda: model.reconstruct(x[:32]),
        "encode": lambda: model.encode(x[:32]),
        "sample": lambda: model.sample(64),
        "elbo": lambda: evaluation._elbo(model, x, len(x)),
        "kl_per_layer": lambda: inspection.kl_per_layer(model, x),
    }
    for method in METHODS:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            calls[method]()
            times.append(time.perf_counter() - start)
        figures[method] = times
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="mnist-attentive-small")
    parser.add_argument("--tiny", action="store_true", help="2 layers, 4 filters, fresh weights: a smoke test")
    parser.add_argument("--child", choices=("eager", "pass"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.name, args.child, args.tiny)))
        return

    import keras

    figures = {}
    for mode in ("eager", "pass"):
        command = [sys.executable, os.path.abspath(__file__), "--name", args.name, "--child", mode]
        done = subprocess.run(command + (["--tiny"] if args.tiny else []), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {mode} process failed:\n{done.stderr[-3000:]}")
        figures[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"backend {keras.backend.backend()}, {args.name}{' (tiny)' if args.tiny else ''}, one process per mode")
    print(f"load: {figures['eager']['load']:.1f} s (eager process), {figures['pass']['load']:.1f} s (pass process)")
    print("| method | eager first s | eager next s | pass first s | pass next s | first speed-up | next speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    totals = [0.0, 0.0]
    for method in METHODS:
        (e1, e2), (p1, p2) = figures["eager"][method], figures["pass"][method]
        totals = [totals[0] + e1, totals[1] + p1]
        print(f"| {method} | {e1:.2f} | {e2:.3f} | {p1:.2f} | {p2:.3f} | {e1 / p1:.1f}x | {e2 / p2:.1f}x |")
    print(f"first calls together: {totals[0]:.1f} s eager, {totals[1]:.1f} s as passes ({totals[0] / totals[1]:.1f}x)")


if __name__ == "__main__":
    main()
