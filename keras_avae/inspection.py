"""What a trained hierarchical VAE does inside: the paper's diagnostics as arrays.

"Deep Attentive Variational Inference" (Apostolopoulou et al., ICLR 2022)
judges its models by the KL of each stochastic layer (posterior collapse,
its Appendix E), by which earlier layers each layer attends to (Appendix F)
and by samples and reconstructions (Appendix G). The functions here return
those quantities as NumPy arrays, ready to plot; `keras-avae report` draws
them.

- `kl_per_layer`: the KL of every layer for every image.
- `active_units`: the active units of every layer (Burda et al., 2016).
- `depthwise_attention`: the depth-wise attention weights of the prior and
  the posterior, per pixel and as a layer-by-layer matrix.
- `nonlocal_attention`: the spatial attention maps of the non-local blocks
  for chosen query pixels.
- `interpolate`: decoded images along a line between two images' latents.
- `readjusted_batch_norm` (also `sample(..., readjust_batch_norm=True)`):
  batch-norm statistics re-estimated on prior samples.

Every function runs the model in inference mode, on concrete images checked
as the models' own methods check them, `batch_size` images at a time.
Posterior samples come from the model's seed generator: build or load the
model with a `seed` for numbers that repeat.
"""

import contextlib
import numbers

import numpy as np
from keras import ops

from keras_avae import inference_passes
from keras_avae._validation import check_finite_outputs
from keras_avae._validation import check_positive_int
from keras_avae._validation import to_numpy
from keras_avae.keras_compat import nested_layers
from keras_avae.layers.non_local_block import NonLocalBlock
from keras_avae.models.batch_norm_statistics import readjusted_batch_norm  # noqa: F401 (public here too)
from keras_avae.models.elbo_model import ELBOModel
from keras_avae.models.hierarchical_vae import HierarchicalVAE


def _check_hierarchical(model):
    if not isinstance(model, HierarchicalVAE):
        raise ValueError(
            f"`model` must be a HierarchicalVAE (the attentive and baseline zoo entries). "
            f"Received: model of type {type(model).__name__}"
        )


def _checked(model, x, name="x", hierarchical=True):
    if hierarchical:
        _check_hierarchical(model)
    elif not isinstance(model, ELBOModel):
        # Any other model failed with an AttributeError on `_check_images`.
        raise ValueError(
            f"`model` must be a HierarchicalVAE or a DiscreteVAE. Received: model of type {type(model).__name__}"
        )
    return to_numpy(model._check_images(x, name=name))


def _batches(x, batch_size):
    batch_size = check_positive_int(batch_size, "batch_size")
    for start in range(0, len(x), batch_size):
        yield x[start : start + batch_size]


def kl_per_layer(model, x, batch_size=100):
    """KL(q(z_l | x, z_<l) || p(z_l | z_<l)) of every image and layer, in nats.

    One posterior sample per image (the prior of layer l depends on the
    sampled `z_<l`), as in the ELBO the model trains on. A layer whose KL is
    near 0 for every image has collapsed: it carries no information.

    Args:
        model: a `HierarchicalVAE` or `DiscreteVAE`.
        x: images in the model's input range, `(N, H, W, C)`.
        batch_size: positive int, images per pass.

    Returns:
        NumPy float32 array `(N, L)`.

    Example:

    >>> from keras_avae import datasets, zoo
    >>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> kl_per_layer(model, datasets.mnist_test_sample(10)).shape  # doctest: +SKIP
    (10, 4)
    """
    x = _checked(model, x, hierarchical=False)
    kls = inference_passes.inference_pass(model, "kl_per_layer", lambda b: model(b, training=False)["kl_per_layer"])
    kl = np.concatenate([to_numpy(kls(ops.convert_to_tensor(b))) for b in _batches(x, batch_size)]).astype(np.float32)
    return check_finite_outputs(kl, "images' KL terms")


def active_units(model, x, threshold=0.01, num_samples=8, batch_size=100):
    """Active latent units per layer: `Var_x(E_q[z_u | x]) > threshold` (Burda et al., 2016).

    A unit is one scalar of a layer's latent map `(h, w, c)`. Its activity
    is the variance over the images of its posterior mean; an inactive unit
    encodes the same value whatever the image. The posterior of layer l >= 1
    is conditioned on the layers above: `E_q[z_l | x]` is estimated as the
    average of its posterior means at `num_samples` posterior samples of
    `z_<l` (with one sample, the sampling noise of the layers above would
    count as activity).

    Args:
        model: a `HierarchicalVAE`.
        x: images, `(N, H, W, C)` with N >= 2.
        threshold: non-negative float. Defaults to `0.01` (Burda et al.).
        num_samples: positive int, posterior samples per image.
        batch_size: positive int, images per pass (each repeated
            `num_samples` times).

    Returns:
        A dict: `"active"` int64 `(L,)`, the active units of each layer;
        `"units"` int, the units per layer; `"variance"` float32
        `(L, units)`; `"threshold"`.

    Example:

    >>> from keras_avae import datasets, zoo
    >>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> active_units(model, datasets.mnist_test_sample(100))["active"]  # doctest: +SKIP
    array([..., ..., ..., ...])
    """
    x = _checked(model, x)
    if len(x) < 2:
        raise ValueError(f"`x` must hold at least 2 images to measure a variance. Received: {len(x)} image")
    if isinstance(threshold, (bool, np.bool_)) or not (
        isinstance(threshold, numbers.Real) and np.isfinite(threshold) and threshold >= 0
    ):
        raise ValueError(f"`threshold` must be a non-negative number. Received: threshold={threshold!r}")
    num_samples = check_positive_int(num_samples, "num_samples")
    means = []
    for b in _batches(x, batch_size):
        repeated = model.encode(np.repeat(b, num_samples, axis=0))
        means.append([m.reshape((len(b), num_samples) + m.shape[1:]).mean(axis=1) for m in repeated])
    per_layer = [np.concatenate([m[layer] for m in means]) for layer in range(model.num_layers)]
    variance = np.stack([np.var(z.reshape(len(z), -1).astype(np.float64), axis=0) for z in per_layer])
    return {
        "active": (variance > threshold).sum(axis=1).astype(np.int64),
        "units": int(variance.shape[1]),
        "variance": variance.astype(np.float32),
        "threshold": float(threshold),
    }


def depthwise_attention(model, x, batch_size=100):
    """The depth-wise attention weights of the prior and the posterior (paper Fig. 10-11).

    Generative (prior, eq. 7-9): layer l >= 1 attends, at every latent
    pixel, over the contexts of layers 0..l-1. Inference (posterior, eq.
    10-11): layer l attends over its own bottom-up feature and those of the
    deeper layers l+1..L-1, then the pre-processed image (column L).

    Args:
        model: a `HierarchicalVAE` with `generative_attention` or
            `inference_attention`.
        x: images, `(N, H, W, C)`.
        batch_size: positive int, images per pass.

    Returns:
        A dict with `"generative"` and/or `"inference"` (those the model
        has), each a dict:
        - `"per_pixel"`: L entries; generative: `None` for layer 0, else
          float32 `(N, h, w, l)`; inference: `(N, h, w, L + 1 - l)`. Each
          pixel's weights sum to 1.
        - `"matrix"`: float32, generative `(L, L)`, inference `(L, L + 1)`:
          row l is layer l's weights averaged over images and pixels, placed
          at the columns of the layers it attends to (zeros elsewhere; the
          generative row 0 is all zeros).
        - `"attended"`: bool, the shape of `"matrix"`: True at the cells
          that hold a layer's weight (a weight that rounds to 0 is still
          attended; a cell outside the model's structure is not).
        - `"gates"`: float32 `(L,)`, each layer's learned gate on its
          attention output (0: the attention does not reach the layer; the
          generative layer 0 has none and shows 0).

    Example:

    >>> from keras_avae import datasets, zoo
    >>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> depthwise_attention(model, datasets.mnist_test_sample(10))["generative"]["matrix"].shape  # doctest: +SKIP
    (4, 4)
    """
    x = _checked(model, x)
    kinds = [k for k, on in (("generative", model._gk > 0), ("inference", model._ik > 0)) if on]
    if not kinds:
        raise ValueError(
            f"`model` has no depth-wise attention. Received: a model with generative_attention="
            f"{model.generative_attention}, inference_attention={model.inference_attention}, "
            f"num_layers={model.num_layers}"
        )
    L = model.num_layers
    collected = {kind: [[] for _ in range(L)] for kind in kinds}

    def attention_pass(b):
        result = model.top_down(model.bottom_up(b, training=False), training=False, return_attention=True)
        return {f"{kind}_attention": result[f"{kind}_attention"] for kind in kinds}

    attention = inference_passes.inference_pass(model, "depthwise_attention", attention_pass)
    for b in _batches(x, batch_size):
        result = attention(ops.convert_to_tensor(b))
        for kind in kinds:
            for layer, scores in enumerate(result[f"{kind}_attention"]):
                if scores is not None:
                    collected[kind][layer].append(to_numpy(ops.cast(scores, "float32")))
    out = {}
    for kind in kinds:
        per_pixel = [np.concatenate(parts) if parts else None for parts in collected[kind]]
        check_finite_outputs([w for w in per_pixel if w is not None], f"images' {kind} attention weights")
        matrix = np.zeros((L, L if kind == "generative" else L + 1), np.float32)
        attended = np.zeros(matrix.shape, bool)
        for layer, weights in enumerate(per_pixel):
            if weights is not None:
                first = 0 if kind == "generative" else layer
                matrix[layer, first : first + weights.shape[-1]] = weights.mean(axis=(0, 1, 2))
                attended[layer, first : first + weights.shape[-1]] = True
        cells = [None, *model.prior_cells] if kind == "generative" else model.posterior_cells
        gate_weights = [None if cell is None else cell.gate for cell in cells]
        gates = np.array([0.0 if g is None else float(to_numpy(g)) for g in gate_weights], np.float32)
        out[kind] = {"per_pixel": per_pixel, "matrix": matrix, "attended": attended, "gates": gates}
    return out


def nonlocal_blocks(model):
    """The model's `NonLocalBlock`s by path (in the order Keras tracks them).

    An unbuilt `HierarchicalVAE` or `DiscreteVAE` is built first (as its
    first call would): Keras gives layers their paths when they are built.

    Example:

    >>> from keras_avae import zoo
    >>> sorted(nonlocal_blocks(zoo.load("mnist-attentive-small")))[:2]  # doctest: +SKIP
    ['hierarchical_vae/decoder_1_0/node0_nonlocal', 'hierarchical_vae/decoder_1_0/node1_nonlocal']
    """
    if isinstance(model, ELBOModel):
        model.build()  # a no-op once built
    blocks = [layer for layer in nested_layers(model) if isinstance(layer, NonLocalBlock)]
    # Unbuilt blocks all have path `None`: keyed by it, they collapsed into one entry.
    if any(block.path is None for block in blocks):
        raise ValueError(
            f"`model` must be built: its non-local blocks have no paths yet. Received: an unbuilt model of "
            f"type {type(model).__name__}"
        )
    return {block.path: block for block in blocks}


@contextlib.contextmanager
def _recording_inputs(blocks):
    """Keeps the last input of each block while active (wraps the instances' `call`)."""
    inputs = {}

    def recorder(path, call):
        def recorded(x, *args, **kwargs):
            inputs[path] = x
            return call(x, *args, **kwargs)

        return recorded

    for path, block in blocks.items():
        block.call = recorder(path, block.call)
    try:
        yield inputs
    finally:
        for block in blocks.values():
            del block.call


def nonlocal_attention(model, x, query_pixels, batch_size=100):
    """Attention maps of every non-local block for chosen query pixels.

    Runs the model on `x` (posterior pass), keeps each block's input and
    computes `NonLocalBlock.attention_map` there: exact in softmax mode, the
    FAVOR+ estimate the block computes with in performer mode.

    Args:
        model: a `HierarchicalVAE` with non-local blocks.
        x: images, `(N, H, W, C)`.
        query_pixels: list of `(row, col)` in image coordinates; each is
            mapped to a block's resolution `(h_b, w_b)` as
            `(row * h_b // H, col * w_b // W)`.
        batch_size: positive int, images per pass.

    Returns:
        A dict from block path, in the order the forward pass runs the
        blocks, to a dict: `"query_pixels"` (the positions in
        the block's resolution), `"maps"` float32 `(N, Q, h_b, w_b)`, each
        summing to 1, `"gamma"` (the block's learned output scale; 0 means
        the attention does not reach the output) and `"attention"`
        (`"softmax"` or `"performer"`).

    Example:

    >>> from keras_avae import datasets, zoo
    >>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> maps = nonlocal_attention(model, datasets.mnist_test_sample(2), [(16, 16)])  # doctest: +SKIP
    """
    x = _checked(model, x)
    blocks = nonlocal_blocks(model)
    if not blocks:
        raise ValueError(f"`model` has no non-local block. Received: nonlocal_blocks={model.nonlocal_blocks}")
    height, width = model.image_shape[:2]
    pixels = _pixel_list(query_pixels)
    if not pixels or any(len(p) != 2 or not (0 <= p[0] < height and 0 <= p[1] < width) for p in pixels):
        raise ValueError(
            f"`query_pixels` must be a non-empty list of (row, col) in [0, {height}) x [0, {width}). "
            f"Received: query_pixels={query_pixels!r}"
        )
    maps = {path: [] for path in blocks}
    positions = {}
    for b in _batches(x, batch_size):
        # Without autograd on PyTorch: the kept inputs would hold the graph of
        # the whole pass (100 MNIST images through `mnist-attentive-small`
        # raised the peak memory by 1.4 GB instead of 0.3 GB).
        with inference_passes._no_gradients():
            with _recording_inputs(blocks) as inputs:
                model(ops.convert_to_tensor(b), training=False)
            order = list(inputs)  # dicts keep insertion order: the order of the calls
            for path, block in blocks.items():
                h_b, w_b = inputs[path].shape[1:3]
                positions[path] = [(r * h_b // height, c * w_b // width) for r, c in pixels]
                maps[path].append(
                    check_finite_outputs(to_numpy(block.attention_map(inputs[path], positions[path])), "attention maps")
                )
    return {
        path: {
            "query_pixels": positions[path],
            "maps": np.concatenate(maps[path]).astype(np.float32),
            "gamma": float(to_numpy(blocks[path].gamma)),
            "attention": blocks[path].attention,
        }
        for path in order
    }


def interpolate(model, x_a, x_b, steps=8, mode="mean"):
    """Images decoded along straight lines between the latents of `x_a` and `x_b`.

    `model.interpolate(x_a, x_b, steps, mode)` (see
    `HierarchicalInference.interpolate`): every layer's posterior mean is
    interpolated linearly, both ends included, and the L latents decoded
    together.

    Returns:
        NumPy float32 array `(steps, H, W, C)` for single images `(H, W, C)`,
        `(B, steps, H, W, C)` for batches.

    Example:

    >>> from keras_avae import datasets, zoo
    >>> model = zoo.load("mnist-attentive-small", seed=0)  # doctest: +SKIP
    >>> x = datasets.mnist_test_sample(2)  # doctest: +SKIP
    >>> interpolate(model, x[0], x[1], steps=5).shape  # doctest: +SKIP
    (5, 32, 32, 1)
    """
    _check_hierarchical(model)
    return model.interpolate(x_a, x_b, steps=steps, mode=mode)


def _pixel_list(query_pixels):
    """`query_pixels` as a list of int tuples, or `None` where an entry is not a sequence of integers.

    `None` fails the caller's check, which names the argument: a bare
    `(16, 16)` (one pixel, not a list of them) or a float coordinate must
    not be truncated or raise a `TypeError` from deep inside.
    """
    try:
        pixels = [tuple(p) for p in query_pixels]
    except TypeError:
        return None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for p in pixels for v in p):
        return None
    return [tuple(int(v) for v in p) for p in pixels]
