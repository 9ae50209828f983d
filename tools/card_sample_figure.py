"""Prints a model card's `shipped_sample_nelbo_nats`: the shipped sample's mean negative ELBO.

The figure is the mean negative ELBO (nats) of the first 100 test images
of the entry's data set shipped with the package
(`keras_avae.datasets.shipped_sample`), one pass with every seed state of
the model at (7, 0), on TensorFlow. `tests/models/test_zoo.py` recomputes it through
`zoo.load(name)` with default arguments and compares it to 4 decimals, so
a default load that is not the trained model fails.

Usage (TensorFlow backend, from the repository root):
    python tools/card_sample_figure.py omniglot-baseline-small \\
        --weights runs/omniglot-baseline-small/model.weights.h5   # before shipping
    python tools/card_sample_figure.py omniglot-baseline-small    # the shipped file
"""

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's keras_avae
os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def shipped_sample_nelbo(name, weights=None):
    """The card figure of zoo entry `name` with `weights` (default: the shipped file)."""
    import keras
    import numpy as np

    from keras_avae import datasets
    from keras_avae import zoo
    from keras_avae.evaluation import _nelbo_under_fixed_seeds

    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"The card figure is a TensorFlow figure. Received: KERAS_BACKEND={keras.backend.backend()}")
    model = zoo.load(name) if weights is None else zoo.load(name, weights=weights)
    x = datasets.shipped_sample(zoo.describe(name)["dataset"], 100)
    # Every seed state, not only `model.seed_generator`: a DiscreteVAE's
    # Gumbel sampler draws from its own, which a default load seeds at random.
    return float(np.mean(_nelbo_under_fixed_seeds(model, x)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a zoo entry")
    parser.add_argument("--weights", help="a .weights.h5 file (default: the entry's shipped weights)")
    args = parser.parse_args(argv)
    print(f"{args.name}: shipped_sample_nelbo_nats {round(shipped_sample_nelbo(args.name, args.weights), 4)}")


if __name__ == "__main__":
    main()
