"""Distributed training with tf.distribute: one machine, or several workers.

Mirrored (one machine): every visible GPU holds a replica; each global batch
is split across them and the gradients are all-reduced. Without GPUs,
`--cpu-devices 2` splits the CPU into two logical devices, so the same code
runs (and is tested) on a laptop:

    python examples/distributed_training.py mirrored --data-dir ../shared/data/mnist --output runs/mirrored
    python examples/distributed_training.py mirrored --cpu-devices 2 --quick --output /tmp/mirrored

Multi-worker: each machine runs the same command with its own `TF_CONFIG`
(the cluster's addresses and its own index); worker 0 is the chief and
writes the checkpoints, logs and final model. `launch` starts N workers on
this machine with the right `TF_CONFIG` each (ports on 127.0.0.1), which is
how you try the set-up before using real machines:

    python examples/distributed_training.py launch --workers 2 --quick --output /tmp/two-workers
    # on real machines, one per host:
    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}' \\
        python examples/distributed_training.py multi-worker --data-dir DATA/mnist --output runs/mw

A run killed at any time resumes from its last checkpoint when the same
command is started again. TensorFlow backend only (tf.distribute).
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
    import numpy as np

    from keras_avae import datasets

    replicas = training.num_replicas(strategy)
    global_batch = args.batch_size * replicas
    if args.quick:
        data = (np.random.default_rng(0).random((64, 8, 8, 1)) > 0.5).astype("float32")
        overrides, steps = QUICK, None
    else:
        data = datasets.make_dataset("mnist", "train", args.data_dir, global_batch, seed=0, strategy=strategy)
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
        jit_compile=False if args.quick else "auto",
    )
    iterations = int(model.optimizer.iterations.numpy())
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
    """Starts `--workers` processes of this script, each with its TF_CONFIG."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(args.workers)]
    forwarded = [a for a in argv if a not in ("launch",)]
    forwarded = _drop_option(forwarded, "--workers")
    processes = []
    for index in range(args.workers):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(config), KERAS_BACKEND="tensorflow")
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
    parser.add_argument("--cpu-devices", type=int, help="split the CPU into N logical devices (no GPU)")
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
