"""Distributed training: tf.distribute (TensorFlow) or keras.distribution (JAX).

Mirrored (one machine): every visible GPU holds a replica; each global batch
is split across them and the gradients are all-reduced. On TensorFlow this is
`tf.distribute.MirroredStrategy`; on JAX a `keras.distribution.DataParallel`
(one program for the global batch, so batch-norm statistics are the global
batch's). Without GPUs, `--cpu-devices 2` gives the CPU two devices (logical
devices on TensorFlow, XLA host devices on JAX), so the same code runs (and
is tested) on a laptop:

    python examples/distributed_training.py mirrored --data-dir ../shared/data/mnist --output runs/mirrored
    KERAS_BACKEND=jax python examples/distributed_training.py mirrored --cpu-devices 2 --quick --output /tmp/m

Multi-worker: each machine runs the same command; worker 0 is the chief and
writes the checkpoints, logs and final model. TensorFlow workers read the
cluster from `TF_CONFIG`; JAX processes from Keras' variables
`KERAS_DISTRIBUTION_JOB_ADDRESSES` (process 0's "host:port"),
`KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`
(`keras.distribution.initialize`). `launch` starts N workers on this machine
with the right settings each (ports on 127.0.0.1), which is how you try the
set-up before using real machines:

    python examples/distributed_training.py launch --workers 2 --quick --output /tmp/two-workers
    # on real machines, one per host:
    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}' \\
        python examples/distributed_training.py multi-worker --data-dir DATA/mnist --output runs/mw
    KERAS_BACKEND=jax KERAS_DISTRIBUTION_JOB_ADDRESSES=host1:12345 KERAS_DISTRIBUTION_NUM_PROCESSES=2 \\
        KERAS_DISTRIBUTION_PROCESS_ID=0 python examples/distributed_training.py multi-worker --data-dir DATA/mnist \\
        --output runs/mw

A run killed at any time resumes from its last checkpoint when the same
command is started again. TensorFlow and JAX backends (PyTorch trains on one
device).
"""

import argparse
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# A tiny mnist-baseline-small on 8x8 images for --quick (seconds per epoch).
QUICK = dict(image_shape=[8, 8, 1], num_layers=2, latent_channels=2, num_scales=1, crop=0,
             preprocess_filters=4, decoder_filters=4)


def train(args, kind):
    from keras_avae import training

    # The strategy comes first: TensorFlow fixes its devices when it starts.
    strategy = training.make_strategy(kind, cpu_devices=args.cpu_devices)
    import keras
    import numpy as np

    from keras_avae import datasets

    replicas = training.num_replicas(strategy)
    global_batch = args.batch_size * replicas
    # tf.distribute shards a tf.data pipeline itself; on JAX, Keras splits
    # each global batch over the devices (and processes).
    data_strategy = strategy if training.BACKEND == "tensorflow" else None
    if args.quick:
        data = (np.random.default_rng(0).random((64, 8, 8, 1)) > 0.5).astype("float32")
        if getattr(strategy, "num_processes", 1) > 1:
            # Several JAX processes each read their share of a tf.data
            # pipeline of global batches.
            import tensorflow as tf

            data = tf.data.Dataset.from_tensor_slices(data).batch(global_batch, drop_remainder=True)
        overrides, steps = QUICK, None
    else:
        data = datasets.make_dataset("mnist", "train", args.data_dir, global_batch, seed=0, strategy=data_strategy)
        overrides, steps = {}, args.steps_per_epoch
    model = training.train(
        args.entry,
        data,
        args.output,
        epochs=args.epochs,
        steps_per_epoch=steps,
        strategy=strategy,
        batch_size=global_batch,
        config_overrides=overrides,
        verbose=2 if training.is_chief(strategy) else 0,
        # Eager TensorFlow starts fastest for a few tiny steps; JAX compiles.
        jit_compile=False if args.quick and training.BACKEND == "tensorflow" else "auto",
    )
    iterations = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    result = {
        "strategy": kind,
        "replicas": replicas,
        "global_batch": global_batch,
        "chief": training.is_chief(strategy),
        "iterations": iterations,
    }
    print(f"RESULT {json.dumps(result)}", flush=True)


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(args, argv):
    """Starts `--workers` processes of this script, each with its cluster settings."""
    backend = os.environ["KERAS_BACKEND"]
    if backend not in ("tensorflow", "jax"):
        sys.exit(f"launch needs KERAS_BACKEND=tensorflow or jax. Received: KERAS_BACKEND={backend!r}")
    workers = [f"127.0.0.1:{port}" for port in free_ports(args.workers)]
    forwarded = [a for a in argv if a not in ("launch",)]
    forwarded = _drop_option(forwarded, "--workers")
    processes = []
    for index in range(args.workers):
        if backend == "tensorflow":
            config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            cluster = {"TF_CONFIG": json.dumps(config)}
        else:  # process 0 is the coordinator
            cluster = {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": workers[0],
                "KERAS_DISTRIBUTION_NUM_PROCESSES": str(args.workers),
                "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
            }
        env = dict(os.environ, **cluster)
        command = [sys.executable, os.path.abspath(__file__), "multi-worker", *forwarded]
        processes.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in processes]
    if any(codes):
        sys.exit(f"a worker failed: exit codes {codes}")
    print(f"{args.workers} workers finished; the chief wrote {args.output}")


def _drop_option(argv, name):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("mirrored", "multi-worker", "launch"))
    parser.add_argument("--output", required=True, help="run folder (checkpoints, logs, final model)")
    parser.add_argument("--entry", default="mnist-baseline-small")
    parser.add_argument("--data-dir", help="MNIST IDX files (not needed with --quick)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="per replica")
    parser.add_argument("--cpu-devices", type=int, help="give the CPU N devices (no GPU)")
    parser.add_argument("--workers", type=int, default=2, help="launch: processes to start")
    parser.add_argument("--quick", action="store_true", help="random 8x8 images and a tiny model (CI)")
    args = parser.parse_args(argv)
    if not args.quick and not args.data_dir:
        parser.error("--data-dir is required unless --quick")
    if args.mode == "launch":
        launch(args, argv)
    else:
        train(args, args.mode)


if __name__ == "__main__":
    main()
