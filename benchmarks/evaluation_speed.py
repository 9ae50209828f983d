"""Importance-sampling speed: milliseconds per (image, sample) pair.

For each zoo entry (fresh weights, random binary 32x32 images) this times
`keras_avae.evaluation.importance_sampled_log_likelihood`, which is
XLA-compiled on TensorFlow and `jax.jit`-compiled on JAX, against the same
computation run eagerly
(`model.log_weights(x, model.bottom_up(x), K)`). The first call of each is
a warm-up (tracing and compilation); the median of `--repeats` calls is
reported. Evaluating N test images with K samples costs about
N * K * (ms per pair) milliseconds.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/evaluation_speed.py
    KERAS_BACKEND=jax python benchmarks/evaluation_speed.py
    KERAS_BACKEND=tensorflow python benchmarks/evaluation_speed.py \\
        --names mnist-baseline-small --batch-size 5 --num-samples 4 --repeats 1 --tiny
"""

import argparse
import statistics
import time


def median_seconds(fn, repeats):
    fn()  # warm-up: tracing, compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", nargs="+", default=["mnist-baseline-small", "mnist-attentive-small"])
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--num-samples", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="2 layers, 4 filters: a smoke test of the script")
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    from keras import ops

    import keras_avae
    from keras_avae import evaluation

    x = (np.random.default_rng(0).random((args.batch_size, 32, 32, 1)) > 0.5).astype("float32")
    pairs = args.batch_size * args.num_samples
    print(f"backend {keras.backend.backend()}, batch {args.batch_size}, K {args.num_samples}, repeats {args.repeats}")
    print("| entry | eager ms/pair | evaluation ms/pair | speed-up |")
    print("|---|---:|---:|---:|")
    for name in args.names:
        tiny = dict(num_layers=2, preprocess_filters=4, decoder_filters=4) if args.tiny else {}
        model = keras_avae.zoo.load(name, weights=None, seed=0, **tiny)

        def eager():
            features = model.bottom_up(x, training=False)
            ops.convert_to_numpy(model.log_weights(x, features, args.num_samples))

        def evaluate():
            evaluation.importance_sampled_log_likelihood(
                model, x, num_samples=args.num_samples, chunk_size=args.num_samples
            )

        eager_ms = 1000 * median_seconds(eager, args.repeats) / pairs
        evaluate_ms = 1000 * median_seconds(evaluate, args.repeats) / pairs
        print(f"| {name} | {eager_ms:.2f} | {evaluate_ms:.2f} | {eager_ms / evaluate_ms:.1f}x |")


if __name__ == "__main__":
    main()
