"""Tune a zoo VAE on MNIST with KerasTuner, then retrain the best configuration.

The search space (`keras_avae.tuning.VAEHyperModel`): stochastic layers,
latent channels, filters, the paper's three attention switches and the
learning rate. Each trial trains a few epochs and is scored by its
validation negative ELBO (nats); the best configuration is then retrained
for longer and scored on test images by importance sampling.

Usage:
    python examples/tune_mnist.py --data-dir ../shared/data/mnist --trials 6
    python examples/tune_mnist.py --quick            # generated data, 2 tiny trials

`--quick` uses random 8x8 binary images and tiny models, for CI; it checks
the mechanics, not the numbers.
"""

import argparse
import math
import os
import tempfile

import keras
import keras_tuner
import numpy as np

from keras_avae import datasets
from keras_avae import evaluation
from keras_avae.tuning import OBJECTIVE
from keras_avae.tuning import VAEHyperModel

# A search space that fits a 2-core CPU: small models, all switches searched.
SPACE = {
    "num_layers": [2, 4],
    "latent_channels": [8, 20],
    "filters": [8, 16],
    "learning_rate": (2e-3, 1e-2),
}
QUICK = dict(image_shape=[8, 8, 1], num_scales=1, crop=0)
QUICK_SPACE = {"num_layers": [1, 2], "latent_channels": [2], "filters": [4], "learning_rate": (1e-3, 1e-2)}


def mnist_arrays(data_dir, split, limit, seed, binarize):
    """Binarised, padded MNIST (the first `limit` images of `split`) as one NumPy array."""
    data = datasets.make_dataset(
        "mnist", split, data_dir, 500, shuffle=False, seed=seed, limit=limit, binarize=binarize,
        drop_remainder=False,
    )
    return np.concatenate(list(data.as_numpy_iterator()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="folder with the MNIST IDX files")
    parser.add_argument("--entry", default="mnist-attentive-small", help="zoo entry the search starts from")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per trial")
    parser.add_argument("--train-images", type=int, default=6000)
    parser.add_argument("--val-images", type=int, default=1000)
    parser.add_argument("--retrain-epochs", type=int, default=4)
    parser.add_argument("--test-images", type=int, default=200)
    parser.add_argument("--num-samples", type=int, default=100, help="K for the test NLL")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="tuner folder (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="generated data, 2 tiny trials (CI)")
    args = parser.parse_args(argv)
    if not args.quick and not args.data_dir:
        parser.error("--data-dir is required unless --quick")

    keras.utils.set_random_seed(0)
    if args.quick:
        rng = np.random.default_rng(0)
        images = (rng.random((40, 8, 8, 1)) > 0.5).astype("float32")
        x_train, x_val, x_test = images[:24], images[24:32], images[32:]
        space, overrides = QUICK_SPACE, QUICK
        # 24 images in batches of 10: a short last batch, as on MNIST (6000 / 32).
        args.trials, args.epochs, args.retrain_epochs, args.num_samples, args.batch_size = 2, 1, 1, 3, 10
    else:
        # One binarisation of the training images (fit sees the same draw
        # every epoch here); validation: the next training images, held out
        # from the search; test: the first test images, as `keras-avae evaluate`.
        x_train = mnist_arrays(args.data_dir, "train", args.train_images, 0, "dynamic")
        held_out = mnist_arrays(args.data_dir, "train", args.train_images + args.val_images, 1, "static")
        x_val = held_out[-args.val_images :]
        x_test = mnist_arrays(args.data_dir, "test", args.test_images, 0, "static")
        space, overrides = SPACE, {}
    steps = math.ceil(len(x_train) / args.batch_size)  # what `fit` runs on arrays, the last batch short

    def hypermodel_for(epochs):
        return VAEHyperModel(
            args.entry,
            steps_per_epoch=steps,
            epochs=epochs,
            search_space=space,
            overrides=overrides,
            jit_compile=False if args.quick else "auto",  # tiny models: compiling costs more than it saves
        )

    hypermodel = hypermodel_for(args.epochs)
    directory = args.out or tempfile.mkdtemp(prefix="keras-avae-tune-")
    tuner = keras_tuner.RandomSearch(
        hypermodel, objective=OBJECTIVE, max_trials=args.trials, seed=0, directory=directory, project_name=args.entry
    )
    tuner.search(
        x_train, validation_data=(x_val, None), epochs=args.epochs, batch_size=args.batch_size, verbose=0
    )

    print(f"Search: {args.trials} trials of {args.epochs} epochs on {len(x_train)} images; objective val_nelbo (nats)")
    trials = sorted(
        (t for t in tuner.oracle.trials.values() if t.score is not None), key=lambda t: t.score
    )
    for trial in trials:
        print(f"  val_nelbo {trial.score:8.2f}  {trial.hyperparameters.values}")
    best = tuner.get_best_hyperparameters(1)[0]

    # Retrain the best configuration for longer, on its own schedule.
    retrain = hypermodel_for(args.retrain_epochs)
    model = retrain.build(best)
    retrain.fit(best, model, x_train, validation_data=(x_val, None), epochs=args.retrain_epochs,
                batch_size=args.batch_size, verbose=0)
    log_px = np.concatenate(
        [model.log_likelihood(x_test[i : i + 25], num_samples=args.num_samples) for i in range(0, len(x_test), 25)]
    )
    nll = float(-log_px.mean())
    assert np.isfinite(nll), nll
    print(f"Best configuration retrained for {args.retrain_epochs} epochs: {best.values}")
    print(
        f"Test NLL {nll:.2f} nats ({evaluation.bits_per_dim(nll, model.num_data_dims):.4f} bits/dim) "
        f"on {len(x_test)} images, K={args.num_samples}"
    )
    print(f"Tuner folder: {os.path.join(directory, args.entry)}")


if __name__ == "__main__":
    main()
