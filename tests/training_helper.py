"""Subprocess entry points for tests/test_training.py.

TensorFlow fixes its devices, and `MultiWorkerMirroredStrategy` its
cluster, when it initialises, and a SIGKILL test needs a process to kill, so
these runs happen in fresh interpreters:

    python -m tests.training_helper mirrored-step OUT.json
    python -m tests.training_helper train OUT_DIR EPOCHS [--strategy KIND] [--save-freq N] [--batch N]

Each prints one line `RESULT {json}` at the end. A `train` run ends as the
command line does: a refusal (`ValueError`, `RuntimeError`) is one line
`ERROR ...` on stderr with status 2, a stop by SIGINT or SIGTERM one line
`STOPPED ...` with status 130 or 143.
"""

import argparse
import json
import os
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


def mirrored_step(out_path):
    """One step under MirroredStrategy on 2 logical CPUs vs one device, same global batch.

    The comparison is made exact by removing the only source of
    per-replica difference that is not a bug: latent sampling. Each replica
    draws its own noise for its half of the batch (the seed state is
    replicated, so replica 0 and 1 would even draw the same numbers), and a
    single device draws different noise for the same examples. Here every
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

    def state(model):
        groups = {
            "trainable": model.trainable_variables,
            "non_trainable": model.non_trainable_variables,
            "optimizer": model.optimizer.variables,
        }
        # Lists in creation order (paths differ between the models). The
        # seed-generator states are bookkeeping of the replicated RNG, not
        # training state: the common-noise sampler does not read them.
        return {
            group: [
                [v.path, np.asarray(v.numpy(), dtype="float64").tolist()]
                for v in variables
                if "seed_generator_state" not in v.path
            ]
            for group, variables in groups.items()
        }

    states = {name: state(model) for name, model in models.items()}

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


def train_run(args):
    """`training.train` on the tiny model, as the CLI would call it."""
    from keras_avae import training

    strategy = training.make_strategy(args.strategy) if args.strategy else None
    import keras
    import numpy as np

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
        images(),
        args.output_dir,
        epochs=args.epochs,
        strategy=strategy,
        batch_size=args.batch,
        config_overrides=dict(TINY),
        save_freq=save_freq,
        num_images=4,
        callbacks=[CountBatches()],
        verbose=0,
        jit_compile=False,
    )
    optimizer = model.optimizer
    iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
    _result(
        {
            "iterations": iterations,
            "batches": CountBatches.batches,
            "kl_weight": float(keras.ops.convert_to_numpy(model.kl_weight)),
            "learning_rate": float(training._learning_rate_at(optimizer, iterations)),
            "replicas": training.num_replicas(strategy),
            "chief": training.is_chief(strategy),
            "finite": bool(all(np.isfinite(keras.ops.convert_to_numpy(w)).all() for w in model.weights)),
        }
    )


def main(argv=None):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    step = sub.add_parser("mirrored-step")
    step.add_argument("out")
    run = sub.add_parser("train")
    run.add_argument("output_dir")
    run.add_argument("epochs", type=int)
    run.add_argument("--strategy", default=None)
    run.add_argument("--save-freq", type=int, default=None)
    run.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args(argv)
    if args.mode == "mirrored-step":
        mirrored_step(args.out)
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
    sys.exit(main())
