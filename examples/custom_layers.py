"""Using the keras-avae attention layers in your own Keras models.

Four short demonstrations, each checked by assertions (the script exits
non-zero when a check fails):

1. An image classifier that composes `NonLocalBlock(attention="performer")`
   (FAVOR+ self-attention over all pixels) and `DepthwiseAttend` (every pixel
   chooses among the feature maps of the earlier conv stages), trained
   briefly; its test accuracy must beat chance.
2. A causal sequence model built on `PerformerAttention(use_causal_mask=True)`,
   trained on a delayed-copy task (the output at step t is the input at step
   t - 1, so it can only be solved by attending to the past); its loss must
   fall, and changing a future token must leave every earlier output as is.
3. A `NonLocalBlock` subclass that overrides one step, the factory of its
   1x1 query/key/value convolutions, with 3x3 convolutions: it stays the
   identity at initialisation, but it is no longer equivariant to permuting
   the pixels (the base block is); a model using it saves and loads.
4. A `PerformerAttention` subclass that overrides its FAVOR+ step
   (`_compute_favor_attention`) to sharpen the attention; it equals the base
   layer with a doubled query projection.

Without `--data-dir` (or with `--quick`) the images are synthetic: stripes
whose orientation is the label. With `--data-dir` pointing to the MNIST IDX
files they are MNIST digits. Runs on the TensorFlow, JAX and PyTorch backends.

Usage:

    python examples/custom_layers.py --quick
    KERAS_BACKEND=jax python examples/custom_layers.py --data-dir ../shared/data/mnist
"""

import argparse
import math
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_avae  # noqa: E402
from keras_avae.layers import DepthwiseAttend  # noqa: E402
from keras_avae.layers import NonLocalBlock  # noqa: E402
from keras_avae.layers import PerformerAttention  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="folder with the MNIST IDX files (default: synthetic images)")
    parser.add_argument("--quick", action="store_true", help="tiny synthetic run for smoke tests (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# --- Data -------------------------------------------------------------------


def stripe_images(num_images, seed):
    """Noisy stripes, 28x28x1; the label (0-3) is their orientation.

    The label is a property of the whole image, not of any one pixel, so the
    accuracy measures what the convolutions and attention learned.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, num_images)
    rows, cols = np.mgrid[0:28, 0:28].astype("float32")
    # Horizontal, vertical and the two diagonal orientations.
    row_weight, col_weight = np.array([[1, 0], [0, 1], [1, 1], [1, -1]], "float32")[labels].T
    position = row_weight[:, None, None] * rows + col_weight[:, None, None] * cols
    period = rng.uniform(4.0, 8.0, (num_images, 1, 1))
    phase = rng.uniform(0.0, 2 * np.pi, (num_images, 1, 1))
    images = 0.5 + 0.5 * np.sin(2 * np.pi * position / period + phase)
    images += rng.normal(0.0, 0.3, images.shape)
    return images[..., None].astype("float32"), labels


def image_data(args):
    """(train images, train labels, test images, test labels), float32 images in ~[0, 1]."""
    if args.quick or not args.data_dir:
        num_train = 512 if args.quick else 4096
        train = stripe_images(num_train, args.seed)
        test = stripe_images(num_train // 4, args.seed + 1)
        return (*train, *test)
    train_images, train_labels = keras_avae.datasets.load("mnist", args.data_dir, "train")
    test_images, test_labels = keras_avae.datasets.load("mnist", args.data_dir, "test")
    # A subset keeps a CPU run to a few minutes; (N, 28, 28, 1) uint8 -> [0, 1].
    train_images, train_labels = train_images[:10000], train_labels[:10000]
    test_images, test_labels = test_images[:2000], test_labels[:2000]
    return (
        train_images.reshape(-1, 28, 28, 1).astype("float32") / 255.0,
        train_labels,
        test_images.reshape(-1, 28, 28, 1).astype("float32") / 255.0,
        test_labels,
    )


# --- 1. An image classifier with NonLocalBlock and DepthwiseAttend ------------


def build_classifier(num_classes, nonlocal_block, filters=16, query_dim=8):
    """Conv stages at 14x14, global attention in the middle, depth-wise attention on top.

    `DepthwiseAttend` needs a query `(B, H, W, Q)`, one key `(B, H, W, Q)`
    per context and the contexts `(B, H, W, C)`, all at one resolution: here
    the contexts are the outputs of the three conv stages, and each pixel
    mixes them with its own softmax weights (which stage to listen to).
    """
    images = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(filters, 3, strides=2, padding="same", activation="gelu")(images)
    stages = []
    for i in range(3):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="gelu", name=f"stage_{i}")(x)
        if i == 1:
            # Every pixel attends to all 196 others, in linear time (FAVOR+).
            x = nonlocal_block(x)
        stages.append(x)
    query = keras.layers.Conv2D(query_dim, 1, name="query")(stages[-1])
    keys = [keras.layers.Conv2D(query_dim, 1, name=f"key_{i}")(s) for i, s in enumerate(stages)]
    x = DepthwiseAttend(name="depthwise_attend")(query, keys, stages)
    x = keras.layers.GlobalAveragePooling2D()(x)
    logits = keras.layers.Dense(num_classes)(x)
    return keras.Model(images, logits, name="attentive_classifier")


def train_classifier(model, data, epochs, learning_rate=3e-3):
    train_images, train_labels, test_images, test_labels = data
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(train_images, train_labels, batch_size=64, epochs=epochs, verbose=0)
    _, accuracy = model.evaluate(test_images, test_labels, batch_size=256, verbose=0)
    return accuracy


def classifier_demo(args, data):
    num_classes = int(data[1].max()) + 1
    block = NonLocalBlock(key_dim=8, attention="performer", num_random_features=32, seed=args.seed, name="nonlocal")
    model = build_classifier(num_classes, block)
    accuracy = train_classifier(model, data, epochs=2)
    print(f"[classifier] test accuracy {accuracy:.3f} (chance {1 / num_classes:.3f}, {num_classes} classes)")
    # Well above chance: the conv + attention stack learned something real.
    assert accuracy > 2.0 / num_classes, f"accuracy {accuracy:.3f} is near chance"
    # NonLocalBlock starts as the identity (gamma = 0); training moved it.
    gamma = float(ops.convert_to_numpy(block.gamma))
    print(f"[classifier] NonLocalBlock gamma after training: {gamma:+.4f} (0 at initialisation)")
    assert gamma != 0.0, "the non-local block received no gradient"


# --- 2. A causal sequence model with PerformerAttention ------------------------


class CausalSequenceModel(keras.Model):
    """Token + position embeddings, one causal FAVOR+ attention block, a softmax head."""

    def __init__(self, vocab_size, sequence_length, hidden_dim=32, num_heads=2, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = keras.layers.Embedding(vocab_size, hidden_dim)
        # The task depends on relative order, which attention alone cannot see.
        self.position_embedding = keras.layers.Embedding(sequence_length, hidden_dim)
        self.attention = PerformerAttention(
            num_heads=num_heads, key_dim=hidden_dim // num_heads, num_random_features=64, seed=seed
        )
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(vocab_size)

    def call(self, tokens, training=None):
        positions = ops.arange(ops.shape(tokens)[1])
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        # Causal masking is a call argument, as in keras.layers.MultiHeadAttention.
        x = x + self.attention(x, x, use_causal_mask=True, training=training)
        return self.head(self.norm(x))


def delayed_copy_data(num_sequences, sequence_length, vocab_size, seed):
    """Random tokens 1..V-1; the target at step t is the token at t - 1 (0 at t = 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab_size, (num_sequences, sequence_length)).astype("int32")
    targets = np.concatenate([np.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)
    return tokens, targets


def sequence_demo(args):
    vocab_size, sequence_length = 8, 16
    tokens, targets = delayed_copy_data(512 if args.quick else 4096, sequence_length, vocab_size, args.seed)
    # Fresh random sequences: a low loss on them means the rule was learned.
    test_tokens, test_targets = delayed_copy_data(256, sequence_length, vocab_size, args.seed + 1)
    model = CausalSequenceModel(vocab_size, sequence_length, seed=args.seed)
    model.compile(
        optimizer=keras.optimizers.Adam(2e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    initial_loss = model.evaluate(test_tokens, test_targets, batch_size=256, verbose=0)
    history = model.fit(tokens, targets, batch_size=32, epochs=3 if args.quick else 5, verbose=0)
    final_loss = model.evaluate(test_tokens, test_targets, batch_size=256, verbose=0)
    print(
        f"[sequence] test loss {initial_loss:.3f} -> {final_loss:.3f} after {len(history.epoch)} epochs "
        f"(log V = {math.log(vocab_size):.3f}: guessing)"
    )
    assert final_loss < 0.5 * initial_loss, "the causal model did not learn the delayed copy"

    # Causality, numerically: change the token at `changed` and compare logits.
    # (`predict_on_batch` runs one compiled call: on JAX, much faster than eager.)
    changed = sequence_length // 2
    edited = test_tokens[:8].copy()
    edited[:, changed] = edited[:, changed] % (vocab_size - 1) + 1  # another token in 1..V-1
    before, after = np.split(model.predict_on_batch(np.concatenate([test_tokens[:8], edited])), 2)
    past_change = np.abs(after[:, :changed] - before[:, :changed]).max()
    future_change = np.abs(after[:, changed:] - before[:, changed:]).max()
    print(f"[sequence] editing step {changed}: earlier logits move {past_change:.1e}, later ones {future_change:.1e}")
    assert past_change < 1e-4, "a future token changed an earlier output: the mask leaks"
    assert future_change > 1e-2, "the edit changed nothing: the check above proves nothing"


# --- 3. Subclassing a layer to override one step -------------------------------


@keras.saving.register_keras_serializable(package="examples")
class NeighbourhoodNonLocalBlock(NonLocalBlock):
    """A `NonLocalBlock` whose queries, keys and values see 3x3 neighbourhoods.

    `NonLocalBlock.build` makes its `theta`, `phi` and `g` projections with
    `self._conv(filters, name)`; overriding that one factory changes them
    without touching the attention. (`_conv` is an internal hook, like
    `MultiHeadAttention._compute_attention`: pin the version you subclass.) No constructor argument is added, so the
    inherited `get_config` still describes the layer, and registering the
    class is all a `.keras` file needs to load it.
    """

    def _conv(self, filters, name):
        conv = super()._conv(filters, name)  # keeps the initializer/regularizer handling
        config = conv.get_config()
        config.update(kernel_size=(3, 3), padding="same")
        return keras.layers.Conv2D.from_config(config)


def permute_pixels(x, permutation):
    """Shuffles the H*W positions of a (B, H, W, C) array."""
    b, h, w, c = x.shape
    return x.reshape(b, h * w, c)[:, permutation].reshape(b, h, w, c)


def subclass_demo(args):
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(2, 8, 8, 4)).astype("float32")

    # Changed: with 1x1 projections attention treats the pixels as a set
    # (shuffling the input shuffles the output the same way); 3x3 ones see
    # each pixel's neighbours, so the block now depends on the layout.
    permutation = rng.permutation(64)
    errors = {}
    for cls in (NonLocalBlock, NeighbourhoodNonLocalBlock):
        layer = cls(key_dim=4, attention="performer", num_random_features=32, gamma_initializer="ones", seed=1)
        outputs = ops.convert_to_numpy(layer(np.concatenate([x, permute_pixels(x, permutation)])))
        block_then_shuffled, shuffled_then_block = permute_pixels(outputs[:2], permutation), outputs[2:]
        errors[cls.__name__] = float(np.abs(shuffled_then_block - block_then_shuffled).max())
    print(
        "[subclass] pixel-permutation equivariance error: "
        + ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    )
    assert errors["NonLocalBlock"] < 1e-4, "the base block should be permutation-equivariant"
    assert errors["NeighbourhoodNonLocalBlock"] > 1e-2, "the 3x3 projections should break equivariance"
    assert tuple(layer.theta.kernel.shape) == (3, 3, 4, 4), "the override was not used"  # layer: the subclass

    # Preserved: gamma starts at 0, so the subclass is still exactly the identity.
    block = NeighbourhoodNonLocalBlock(key_dim=4, attention="performer", num_random_features=32, seed=args.seed)
    doubled = np.concatenate([x, x])  # the shape above: eager JAX reuses its compiled ops
    assert np.array_equal(ops.convert_to_numpy(block(doubled)), doubled), "not the identity at initialisation"

    # Used in a model: the inherited get_config and the registration above
    # make it save and load (gamma = 1 so that the 3x3 projections matter).
    inputs = keras.Input(x.shape[1:])
    features = NeighbourhoodNonLocalBlock(
        key_dim=4, attention="performer", num_random_features=32, gamma_initializer="ones", seed=1, name="nonlocal"
    )(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(features)))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
    assert isinstance(restored.get_layer("nonlocal"), NeighbourhoodNonLocalBlock)
    difference = np.abs(model.predict_on_batch(x) - restored.predict_on_batch(x)).max()
    print(f"[subclass] a model using the subclass: its .keras round trip changes the outputs by {difference:.1e}")
    assert difference < 1e-5, "the .keras round trip changed the outputs"


# --- 4. Overriding the FAVOR+ step of PerformerAttention ------------------------


@keras.saving.register_keras_serializable(package="examples")
class SharpenedPerformerAttention(PerformerAttention):
    """FAVOR+ attention at softmax temperature `1 / sharpness`.

    `PerformerAttention._compute_favor_attention` receives the projected
    query, key and value, `(B, T, heads, dim)`, with the key mask and the
    causal flag (its counterpart of `MultiHeadAttention._compute_attention`);
    this override scales the queries before calling it. The new argument is
    added to `get_config`, so the layer saves and loads.
    """

    def __init__(self, *args, sharpness=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharpness = sharpness

    def _compute_favor_attention(self, query, key, value, key_mask=None, use_causal_mask=False, training=None):
        return super()._compute_favor_attention(
            query * self.sharpness, key, value, key_mask=key_mask, use_causal_mask=use_causal_mask, training=training
        )

    def get_config(self):
        return {**super().get_config(), "sharpness": self.sharpness}


def performer_subclass_demo(args):
    x = np.random.default_rng(args.seed).normal(size=(2, 16, 8)).astype("float32")
    kwargs = dict(num_heads=2, key_dim=4, num_random_features=64, seed=args.seed)
    sharpened = SharpenedPerformerAttention(sharpness=2.0, **kwargs)
    actual = ops.convert_to_numpy(sharpened(x, x, use_causal_mask=True))
    # The same function: the base layer with its query projection doubled
    # (weights: query kernel and bias first, as in MultiHeadAttention).
    base = PerformerAttention(**kwargs)
    base(x, x)
    weights = sharpened.get_weights()
    base.set_weights([2.0 * weights[0], 2.0 * weights[1]] + weights[2:])
    difference = np.abs(actual - ops.convert_to_numpy(base(x, x, use_causal_mask=True))).max()
    revived = SharpenedPerformerAttention.from_config(sharpened.get_config())
    print(f"[performer subclass] sharpened queries vs a doubled query projection: max difference {difference:.1e}")
    assert difference < 1e-4, "the override is not the query scaling it claims to be"
    assert revived.sharpness == 2.0 and revived.seed == sharpened.seed, "the config lost the new argument"


def main(argv=None):
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    print(f"Backend: {keras.backend.backend()}")
    data = image_data(args)
    classifier_demo(args, data)
    sequence_demo(args)
    subclass_demo(args)
    performer_subclass_demo(args)
    print("All checks passed.")


if __name__ == "__main__":
    main()
