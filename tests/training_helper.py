"""Subprocess entry points for tests/test_training.py.

TensorFlow fixes its devices, and `MultiWorkerMirroredStrategy` its
cluster, when it initialises (JAX its host device count and process group
likewise), and a SIGKILL test needs a process to kill, so these runs happen
in fresh interpreters:

    python -m tests.training_helper mirrored-step OUT.json
    python -m tests.training_helper jax-data-parallel-step OUT.json
    python -m tests.training_helper replica-noise OUT.json
    python -m tests.training_helper train OUT_DIR EPOCHS [--strategy KIND] [--cpu-devices N] \
        [--save-freq N] [--batch N] [--coordinator-address A --num-processes N --process-id I]

Each prints one line `RESULT {json}` at the end. A `train` run ends as the
command line does: a refusal (`ValueError`, `RuntimeError`) is one line
`ERROR ...` on stderr with status 2, a stop by SIGINT or SIGTERM one line
`STOPPED ...` with status 130 or 143.
"""

import argparse
import json
import os
import signal
import sys
import time

# Tiny mnist-baseline (no attention): a few thousand weights, 8x8 images.
TINY = dict(
    image_shape=[8, 8, 1],
    num_layers=2,
    latent_channels=2,
    num_scales=1,
    preprocess_filters=4,
    decoder_filters=4,
    preprocess_cells=1,
    postprocess_cells=1,
    cells_per_layer=1,
    crop=0,
)
NUM_IMAGES = 24
BATCH = 8


def images(seed=0):
    import numpy as np

    return (np.random.default_rng(seed).random((NUM_IMAGES, 8, 8, 1)) > 0.5).astype("float32")


def _result(payload):
    print("RESULT " + json.dumps(payload), flush=True)


def training_state(model, skip_seed_states=False):
    """`{group: [[path, values], ...]}` of a model's variables, in creation order (paths differ between models)."""
    import keras
    import numpy as np

    groups = {
        "trainable": model.trainable_variables,
        "non_trainable": model.non_trainable_variables,
        "optimizer": model.optimizer.variables,
    }
    return {
        group: [
            [v.path, np.asarray(keras.ops.convert_to_numpy(v), dtype="float64").tolist()]
            for v in variables
            if not (skip_seed_states and "seed_generator_state" in v.path)
        ]
        for group, variables in groups.items()
    }


def mirrored_step(out_path):
    """One step under MirroredStrategy on 2 logical CPUs vs one device, same global batch.

    The comparison is made exact by removing the only source of
    per-replica difference that is not a bug: latent sampling. Each replica
    draws its own noise for its half of the batch (`ReplicaSeedGenerator`),
    and a single device draws different noise for the same examples. Here every
    posterior sample uses common random numbers, `z = mu + sigma * eps` with
    a fixed `eps` shared by all examples, so the gradient of each example is
    the same function of the weights on both sides. Batch norm is
    synchronised on the mirrored side (`train` turns it on), so its batch
    statistics are those of the global batch, as on one device.
    """
    from keras_avae import training

    strategy = training.make_strategy("mirrored", cpu_devices=2)  # before TF initialises
    import numpy as np

    from keras_avae.distributions import gaussian

    noise = {}

    def common_sample(self, seed=None, temperature=1.0):
        shape = tuple(self.loc.shape[1:])
        if shape not in noise:
            noise[shape] = np.random.default_rng(len(noise)).standard_normal(shape).astype("float32")
        return self.loc + temperature * self.scale * noise[shape][None]

    gaussian.DiagonalGaussian.sample = common_sample

    recipe = training.resolve_recipe("mnist-baseline", warmup_epochs=0, min_learning_rate=None)
    x = images()[:BATCH]
    models = {}
    with strategy.scope():
        mirrored = training._build_model("mnist-baseline", strategy, dict(TINY))
        mirrored.compile(optimizer=training.make_optimizer(recipe, 1, 1), jit_compile=False)
    models["mirrored"] = mirrored
    for name in ("single", "half"):
        model = training._build_model("mnist-baseline", None, dict(TINY))
        model.set_weights(mirrored.get_weights())
        model.compile(optimizer=training.make_optimizer(recipe, 1, 1), jit_compile=False)
        models[name] = model
    losses = {}
    for name, model in models.items():
        data = x[: BATCH // 2] if name == "half" else x
        history = model.fit(data, batch_size=len(data), epochs=1, shuffle=False, verbose=0)
        losses[name] = history.history["loss"][0]

    # The seed-generator states are bookkeeping of the replicated RNG, not
    # training state: the common-noise sampler does not read them.
    states = {name: training_state(model, skip_seed_states=True) for name, model in models.items()}

    # A NaN in one image of replica 1's half only: the guard must skip the
    # step on both replicas (the finiteness flags are all-reduced), and the
    # monitor must undo the batch-norm statistics both replicas took.
    def replica_values():
        variables = [v for v in mirrored.weights if "seed_generator_state" not in v.path]
        guard = training.find_guard(mirrored.optimizer)
        variables += [v for v in mirrored.optimizer.variables if v is not guard.nonfinite_steps]
        return [np.asarray(c.numpy()) for v in variables for c in strategy.experimental_local_results(v.value)]

    before = replica_values()
    bad = x.copy()
    bad[BATCH - 1, 0, 0, 0] = np.nan
    mirrored.fit(
        bad,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[training.NonFiniteMonitor(verbose=False)],
    )
    after = replica_values()
    nan_step = {
        "unchanged": all(np.array_equal(a, b) for a, b in zip(before, after)),
        "finite": all(np.isfinite(a).all() for a in after),
        "nonfinite_steps": int(training.find_guard(mirrored.optimizer).nonfinite_steps.numpy()),
        "iterations": int(mirrored.optimizer.iterations.numpy()),
    }

    payload = {
        "nan_step": nan_step,
        "replicas": strategy.num_replicas_in_sync,
        "synchronized_batch_norm": mirrored.synchronized_batch_norm,
        "losses": losses,
        "states": states,
    }
    with open(out_path, "w") as f:
        json.dump(payload, f)
    _result({"replicas": payload["replicas"], "losses": losses, "nan_step": nan_step})


def replica_noise(out_path):
    """Draws of `ReplicaSeedGenerator` and of a model's latent noise on 2 mirrored replicas.

    With a plain `SeedGenerator` both replicas draw the same numbers; a
    model given the same images on both replicas then returns the same
    outputs on both. Also what `train` says of batches that do not split
    over the replicas.
    """
    from keras_avae import training

    strategy = training.make_strategy("mirrored", cpu_devices=2)  # before TF initialises
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_avae.replica_seeds import ReplicaSeedGenerator

    with strategy.scope():
        generator = ReplicaSeedGenerator(7)
        model = training._build_model("mnist-baseline", strategy, dict(TINY))
    one_device = keras.random.SeedGenerator(7)

    @tf.function
    def draw():
        return strategy.run(lambda: keras.random.normal((3,), seed=generator))

    def local(values):
        return [np.asarray(v).tolist() for v in strategy.experimental_local_results(values)]

    draws = [local(draw()) for _ in range(2)]
    expected = [keras.ops.convert_to_numpy(keras.random.normal((3,), seed=one_device)).tolist() for _ in range(2)]
    half = images()[: BATCH // 2]
    x = np.concatenate([half, half])  # each replica gets the same 4 images

    @tf.function
    def forward(x):
        return strategy.run(lambda batch: model(batch, training=True)["kl"], args=(x,))

    per_replica = forward(next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(x)))))
    # A dataset whose last batch (5 images) would split 3 + 2 over the replicas.
    try:
        ragged = tf.data.Dataset.from_tensor_slices(images()[:21]).batch(BATCH)
        training.train("mnist-baseline", ragged, out_path + ".run", epochs=1, strategy=strategy, verbose=0)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    payload = {
        "refusal": refusal,
        "draws": draws,
        "one_device": expected,
        "states": local(generator.state.value),
        "outputs": local(per_replica),
    }
    with open(out_path, "w") as f:
        json.dump(payload, f)
    _result({"replicas": strategy.num_replicas_in_sync})


def jax_data_parallel_step(out_path):
    """One step under `keras.distribution.DataParallel` on 2 host devices vs one device (JAX).

    Unlike `mirrored_step`, nothing needs replacing: JAX compiles one
    program for the global batch, so batch norm normalises with the global
    batch's statistics, and its partitionable random numbers draw the same
    latent noise split over two devices as on one (both models have the same
    seed). The one-device model runs in the same process, on its first
    device, without a distribution. As a control it then trains again from
    the same start on the first device's half twice over: what that device
    would learn from its own half's statistics and gradients alone (the
    same shapes, so no second compilation).
    """
    from keras_avae import training

    distribution = training.make_strategy("mirrored", cpu_devices=2)  # before JAX initialises
    import keras
    import numpy as np

    recipe = training.resolve_recipe("mnist-baseline", warmup_epochs=0, min_learning_rate=None)
    x = images()[:BATCH]
    config = dict(TINY, seed=0)  # the same latent noise in both models
    with distribution.scope():
        parallel = training._build_model("mnist-baseline", distribution, config)
        parallel.compile(optimizer=training.make_optimizer(recipe, 1, 1))
    single = training._build_model("mnist-baseline", None, config)
    single.set_weights(parallel.get_weights())
    single.compile(optimizer=training.make_optimizer(recipe, 1, 1))
    single.optimizer.build(single.trainable_variables)
    start = [np.array(keras.ops.convert_to_numpy(v)) for v in single.variables + single.optimizer.variables]

    def one_step(model, data):
        return model.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"][0]

    losses, states = {}, {}
    with distribution.scope():
        losses["parallel"] = one_step(parallel, x)
    states["parallel"] = training_state(parallel)
    losses["single"] = one_step(single, x)
    states["single"] = training_state(single)
    for variable, value in zip(single.variables + single.optimizer.variables, start):
        variable.assign(value)
    losses["half"] = one_step(single, np.concatenate([x[: BATCH // 2]] * 2))
    states["half"] = training_state(single)
    devices = sorted(len(v.value.sharding.device_set) for v in parallel.weights)

    # A NaN in the second device's half of the batch only: the guard skips
    # the step and the monitor undoes the batch-norm statistics, everywhere.
    def values():
        guard = training.find_guard(parallel.optimizer)
        variables = [v for v in parallel.weights + parallel.optimizer.variables if v is not guard.nonfinite_steps]
        return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]

    before = values()
    bad = x.copy()
    bad[BATCH - 1, 0, 0, 0] = np.nan
    with distribution.scope():
        parallel.fit(
            bad, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[training.NonFiniteMonitor(verbose=False)]
        )
    after = values()
    nan_step = {
        "unchanged": all(np.array_equal(a, b) for a, b in zip(before, after)),
        "finite": all(np.isfinite(a).all() for a in after),
        "nonfinite_steps": int(keras.ops.convert_to_numpy(training.find_guard(parallel.optimizer).nonfinite_steps)),
        "iterations": int(keras.ops.convert_to_numpy(parallel.optimizer.iterations)),
    }
    payload = {
        "replicas": training.num_replicas(distribution),
        "devices": [devices[0], devices[-1]],
        "synchronized_batch_norm": parallel.synchronized_batch_norm,
        "losses": losses,
        "nan_step": nan_step,
        "states": states,
    }
    with open(out_path, "w") as f:
        json.dump(payload, f)
    _result({k: payload[k] for k in ("replicas", "devices", "losses", "nan_step")})


def train_run(args):
    """`training.train` on the tiny model, as the CLI would call it."""
    from keras_avae import training

    cluster = dict(
        coordinator_address=args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id
    )
    cluster = {k: v for k, v in cluster.items() if v is not None}
    strategy = training.make_strategy(args.strategy, args.cpu_devices, **cluster) if args.strategy else None
    import keras
    import numpy as np

    data = images()
    if getattr(strategy, "num_processes", 1) > 1:  # several JAX processes read shares of tf.data batches
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices(data).batch(args.batch, drop_remainder=True)
    elif args.strategy == "multi-worker":  # TensorFlow workers get what the CLI passes: a distributed dataset
        import tensorflow as tf

        batches = tf.data.Dataset.from_tensor_slices(data).batch(args.batch, drop_remainder=True)
        data = strategy.experimental_distribute_dataset(batches)

    class CountBatches(keras.callbacks.Callback):
        batches = 0

        def on_train_batch_end(self, batch, logs=None):
            CountBatches.batches += 1
            delay = float(os.environ.get("KAVAE_TEST_BATCH_DELAY", "0"))
            if delay:
                time.sleep(delay)

    save_freq = "epoch" if args.save_freq is None else args.save_freq
    model = training.train(
        "mnist-baseline",
        data,
        args.output_dir,
        epochs=args.epochs,
        strategy=strategy,
        batch_size=args.batch,
        config_overrides=dict(TINY),
        save_freq=save_freq,
        num_images=4,
        callbacks=[CountBatches()],
        verbose=0,
        # What the command line uses: jax.jit on JAX, graph mode without XLA
        # on a TensorFlow CPU, eager on PyTorch.
        jit_compile="auto",
    )
    optimizer = model.optimizer
    iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
    weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
    placement = {}
    if training.BACKEND == "jax":
        import jax

        placement = {"devices": len(model.weights[0].value.sharding.device_set), "processes": jax.process_count()}
    _result(
        {
            "iterations": iterations,
            "batches": CountBatches.batches,
            "kl_weight": float(keras.ops.convert_to_numpy(model.kl_weight)),
            "learning_rate": float(training._learning_rate_at(optimizer, iterations)),
            "replicas": training.num_replicas(strategy),
            "chief": training.is_chief(strategy),
            "finite": bool(all(np.isfinite(w).all() for w in weights)),
            # Equal in every process of a multi-process run.
            "weights_sum": float(sum(np.abs(w.astype("float64")).sum() for w in weights)),
            **placement,
        }
    )


def main(argv=None):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    step = sub.add_parser("mirrored-step")
    step.add_argument("out")
    sub.add_parser("jax-data-parallel-step").add_argument("out")
    sub.add_parser("replica-noise").add_argument("out")
    run = sub.add_parser("train")
    run.add_argument("output_dir")
    run.add_argument("epochs", type=int)
    run.add_argument("--strategy", default=None)
    run.add_argument("--save-freq", type=int, default=None)
    run.add_argument("--batch", type=int, default=BATCH)
    run.add_argument("--cpu-devices", type=int, default=None)
    run.add_argument("--coordinator-address", default=None)
    run.add_argument("--num-processes", type=int, default=None)
    run.add_argument("--process-id", type=int, default=None)
    args = parser.parse_args(argv)
    if args.mode == "mirrored-step":
        mirrored_step(args.out)
        return 0
    if args.mode == "jax-data-parallel-step":
        jax_data_parallel_step(args.out)
        return 0
    if args.mode == "replica-noise":
        replica_noise(args.out)
        return 0
    try:
        train_run(args)
    except (ValueError, RuntimeError) as error:
        print(f"ERROR {error}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as stop:
        print(f"STOPPED {stop}", file=sys.stderr, flush=True)
        return getattr(stop, "exit_status", 130)
    return 0


if __name__ == "__main__":
    # A test runner started as a background job (`cmd &` in a script) has
    # SIGINT ignored, and `train` leaves ignored signals alone, as it should
    # for background jobs. These runs stand for a terminal's: Ctrl-C applies.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
