"""FAVOR+'s two matrix products in three layouts, forward and backward.

`keras_avae.ops.favor_attention` (one head, not causal) computes
`phi(Q) (phi(K)^T [V, 1])`. The value axis has a few channels (d_v + 1 = 19
in three of the five 32x32 non-local blocks of `mnist-attentive-small`, 37
in the other two), and CPU matrix products whose result has few columns
run slowly. This prints the time of the products and their gradients as
written that way ("columns"), with the small axis as rows in both,
`((V, 1)^T phi(K))` then `(kv^T phi(Q)^T)^T` ("rows", what
`favor_attention` does on TensorFlow and JAX), and with rows for the first
product only ("mixed", what it does on PyTorch, where the result of "rows"
is a transposed view that makes the elementwise ops after it slow), and
checks that all give the same gradients.

Usage:
    KERAS_BACKEND=torch python benchmarks/favor_product_layout.py [--repeats 30] [--values 19]
"""

import argparse
import time

import keras
import numpy as np
from keras import ops

# Batch, positions (32x32), random features.
SHAPE = (32, 1024, 64)


def columns(q, k, v):
    return ops.matmul(q, ops.matmul(ops.transpose(k, (0, 2, 1)), v))


def rows(q, k, v):
    kv_t = ops.matmul(ops.transpose(v, (0, 2, 1)), k)
    return ops.transpose(ops.matmul(kv_t, ops.transpose(q, (0, 2, 1))), (0, 2, 1))


def mixed(q, k, v):
    kv_t = ops.matmul(ops.transpose(v, (0, 2, 1)), k)
    return ops.matmul(q, ops.transpose(kv_t, (0, 2, 1)))


def gradient_function(product, arrays):
    """A function returning the gradients of `sum(product(q, k, v) ** 2)` as NumPy arrays."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def grads(q, k, v):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                loss = tf.reduce_sum(product(q, k, v) ** 2)
            return tape.gradient(loss, [q, k, v])

        tensors = [tf.constant(a) for a in arrays]
        return lambda: [g.numpy() for g in grads(*tensors)]
    if backend == "torch":
        import torch

        tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
        return lambda: [g.numpy() for g in torch.autograd.grad((product(*tensors) ** 2).sum(), tensors)]
    import jax

    grads = jax.jit(jax.grad(lambda q, k, v: (product(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
    return lambda: [np.asarray(g) for g in grads(*arrays)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--values", type=int, default=19, help="d_v + 1, the value channels and the ones column")
    args = parser.parse_args(argv)
    batch, length, features = SHAPE
    values = args.values
    rng = np.random.default_rng(0)
    arrays = [
        rng.random((batch, length, features)).astype("float32"),
        rng.random((batch, length, features)).astype("float32"),
        rng.random((batch, length, values)).astype("float32"),
    ]
    results, times = {}, {}
    for name, product in (("columns", columns), ("rows", rows), ("mixed", mixed)):
        run = gradient_function(product, arrays)
        for _ in range(3):
            results[name] = run()
        durations = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            durations.append(time.perf_counter() - start)
        times[name] = 1000 * float(np.median(durations))
    for name in ("rows", "mixed"):
        for a, b in zip(results["columns"], results[name]):
            np.testing.assert_allclose(a, b, rtol=1e-4)
    print(f"backend {keras.backend.backend()}, (B, L, m, d_v + 1) = {(*SHAPE, values)}, forward + backward, median ms")
    print(
        f"columns {times['columns']:.2f}  rows {times['rows']:.2f}  mixed {times['mixed']:.2f}  "
        f"speed-up over columns: rows {times['columns'] / times['rows']:.2f}x, mixed {times['columns'] / times['mixed']:.2f}x"
    )


if __name__ == "__main__":
    main()
