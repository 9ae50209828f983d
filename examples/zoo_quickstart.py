"""Load a pretrained zoo model, score real MNIST digits, sample and reconstruct.

The Python-API version of `keras-avae demo`, step by step:

1. `keras_avae.zoo.load(name)` builds the entry's model with its shipped
   pretrained weights (no download);
2. `keras_avae.datasets.mnist_test_sample(n)` gives the first n MNIST test
   digits, shipped with the package, binarised and padded to 32x32;
3. `model.log_likelihood(x, num_samples=K)` estimates log p(x) per image by
   importance sampling with K samples; the script prints the mean negative
   log-likelihood in nats and in bits per dimension;
4. `model.sample(n, temperature=...)` draws digits from the prior and
   `model.reconstruct(x)` encodes and decodes the test digits;
5. `keras_avae.training.save_image_grid` writes them as PNG grids to `--out`.

It checks that the weights are trained (the NLL beats a fair coin per pixel)
and that reconstructions resemble their inputs more than samples do, and
exits non-zero otherwise. It runs on TensorFlow, JAX and PyTorch.

Usage:

    python examples/zoo_quickstart.py --quick
    KERAS_BACKEND=jax python examples/zoo_quickstart.py --out zoo_pngs
    python examples/zoo_quickstart.py --name mnist-baseline-small --num-samples 1000
"""

import argparse
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_avae  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="mnist-attentive-small", help="a pretrained MNIST zoo entry")
    parser.add_argument("--num-images", type=int, default=16, help="test digits to score (1-100)")
    parser.add_argument("--num-samples", type=int, default=100, help="importance samples K per image")
    parser.add_argument("--temperature", type=float, default=0.8, help="prior temperature of the samples")
    parser.add_argument("--out", help="folder for the PNGs (default: a new temporary folder)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's random draws")
    parser.add_argument("--quick", action="store_true", help="4 images, K=3: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_images, args.num_samples = 4, 3
    return args


def main(argv=None):
    args = parse_args(argv)
    if not keras_avae.zoo.has_pretrained(args.name):
        trained = [n for n in keras_avae.zoo.names() if keras_avae.zoo.has_pretrained(n)]
        sys.exit(f"{args.name!r} has no pretrained weights; entries with weights: {', '.join(trained)}")
    out = args.out or tempfile.mkdtemp(prefix="zoo_quickstart_")
    os.makedirs(out, exist_ok=True)
    start = time.time()

    # "default" weights = the entry's shipped pretrained ones; `seed` seeds the
    # latent draws (importance samples, samples) and keeps those weights.
    model = keras_avae.zoo.load(args.name, seed=args.seed)
    x = keras_avae.datasets.mnist_test_sample(args.num_images)  # float32 (n, 32, 32, 1), 0/1
    print(f"{args.name}: {model.count_params():,} parameters, backend {keras.backend.backend()}")

    # log p(x) in nats per image (a NumPy array); K = 1 would be the ELBO.
    log_px = model.log_likelihood(x, num_samples=args.num_samples)
    nll = float(-np.mean(log_px))
    bits = keras_avae.evaluation.bits_per_dim(nll, model.num_data_dims)
    print(f"NLL of {len(x)} MNIST test digits, K={args.num_samples}: {nll:.2f} nats = {bits:.4f} bits/dim")
    # A fair coin per pixel costs log(2) nats each; a trained model is far better.
    coin_nats = model.num_data_dims * math.log(2.0)
    assert np.all(np.isfinite(log_px)), f"non-finite log-likelihoods: {log_px}"
    assert nll < 0.5 * coin_nats, f"NLL {nll:.1f} is not far below a coin flip ({coin_nats:.1f}): untrained weights?"

    samples = ops.convert_to_numpy(model.sample(len(x), temperature=args.temperature))
    reconstructions = ops.convert_to_numpy(model.reconstruct(x))
    low, high = model.pixel_range
    assert samples.shape == x.shape, f"samples have shape {samples.shape}, expected {x.shape}"
    assert low <= samples.min() and samples.max() <= high, "samples outside the model's pixel range"
    # Reconstructions come from each digit's own posterior, samples from the
    # prior: the former should be much closer to the test digits.
    reconstruction_error = np.abs(reconstructions - x).mean()
    sample_error = np.abs(samples - x).mean()
    print(f"Mean |pixel error| vs the digits: reconstructions {reconstruction_error:.3f}, samples {sample_error:.3f}")
    assert reconstruction_error < sample_error, "reconstructions are no closer to the inputs than prior samples"

    samples_png = os.path.join(out, "samples.png")
    reconstructions_png = os.path.join(out, "reconstructions.png")
    keras_avae.training.save_image_grid(samples_png, [samples], value_range=model.pixel_range)
    keras_avae.training.save_image_grid(reconstructions_png, [x, reconstructions], value_range=model.pixel_range)
    for path in (samples_png, reconstructions_png):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG file"
    print(f"Wrote {samples_png} (temperature {args.temperature} samples)")
    print(f"  and {reconstructions_png} (row 1: test digits, row 2: reconstructions)")
    print(f"Done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
