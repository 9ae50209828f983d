"""The checks of `HierarchicalVAE`'s constructor arguments (each error names the argument)."""

from keras_avae._validation import check_bool
from keras_avae._validation import check_crop
from keras_avae._validation import check_finite_number
from keras_avae._validation import check_image_shape
from keras_avae._validation import check_layer_seed
from keras_avae._validation import is_finite_real
from keras_avae._validation import is_integer

NONLOCAL_PLACES = ("preprocess", "encoder", "decoder", "merge", "postprocess")
LIKELIHOODS = ("logistic_mixture", "bernoulli")

# The constructor arguments `get_config` records, one attribute each.
CONFIG_KEYS = (
    "image_shape",
    "num_layers",
    "latent_channels",
    "num_scales",
    "preprocess_filters",
    "decoder_filters",
    "preprocess_cells",
    "postprocess_cells",
    "cells_per_layer",
    "generative_attention",
    "inference_attention",
    "generative_attention_dim",
    "inference_attention_dim",
    "generative_attention_layer_norm",
    "inference_attention_layer_norm",
    "nonlocal_blocks",
    "nonlocal_key_dim",
    "nonlocal_attention",
    "nonlocal_num_random_features",
    "likelihood",
    "num_mixtures",
    "reference_edge_bug",
    "crop",
    "prior_log_scale_bounds",
    "posterior_log_scale_bounds",
    "log_scale_noise",
    "l2",
    "bn_momentum",
    "bn_epsilon",
    "synchronized_batch_norm",
    "seed",
    "nonlocal_feature_seed",
)

# The switches: a truthy string ("no") would turn them on.
BOOLEAN_KEYS = (
    "generative_attention",
    "inference_attention",
    "generative_attention_layer_norm",
    "inference_attention_layer_norm",
    "reference_edge_bug",
    "synchronized_batch_norm",
)


def validate_config(args):
    """Raises a `ValueError` naming the first invalid argument of `HierarchicalVAE(**args)`.

    Example:

    >>> validate_config({"image_shape": (28, 28)})
    Traceback (most recent call last):
    ...
    ValueError: `image_shape` must be (H, W, C), three positive ints. Received: image_shape=(28, 28)
    """
    def positive_int(name):
        value = args[name]
        if not is_integer(value) or value < 1:
            raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")

    image_shape = args["image_shape"]
    check_image_shape(image_shape)
    for name in (
        "num_layers",
        "latent_channels",
        "num_scales",
        "preprocess_filters",
        "decoder_filters",
        "cells_per_layer",
        "generative_attention_dim",
        "inference_attention_dim",
        "nonlocal_key_dim",
        "nonlocal_num_random_features",
        "num_mixtures",
    ):
        positive_int(name)
    for name in ("preprocess_cells", "postprocess_cells"):
        value = args[name]
        if not is_integer(value) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative int. Received: {name}={value!r}")
    for name in BOOLEAN_KEYS:
        check_bool(args[name], name)
    scale = 2 ** args["num_scales"]
    if image_shape[0] % scale or image_shape[1] % scale:
        raise ValueError(
            f"`image_shape` must be (H, W, C) with H and W divisible by 2**num_scales={scale}. "
            f"Received: image_shape={image_shape}"
        )
    if args["inference_attention"] and args["inference_attention_dim"] % scale:
        raise ValueError(
            f"`inference_attention_dim` must be divisible by 2**num_scales={scale}. "
            f"Received: inference_attention_dim={args['inference_attention_dim']}"
        )
    unknown = set(args["nonlocal_blocks"]) - set(NONLOCAL_PLACES)
    if unknown:
        raise ValueError(
            f"`nonlocal_blocks` entries must be in {NONLOCAL_PLACES}. Received: nonlocal_blocks={args['nonlocal_blocks']}"
        )
    if args["likelihood"] not in LIKELIHOODS:
        raise ValueError(f"`likelihood` must be one of {LIKELIHOODS}. Received: likelihood={args['likelihood']!r}")
    if args["nonlocal_attention"] not in ("softmax", "performer"):
        raise ValueError(
            "`nonlocal_attention` must be 'softmax' or 'performer'. "
            f"Received: nonlocal_attention={args['nonlocal_attention']!r}"
        )
    for name in ("prior_log_scale_bounds", "posterior_log_scale_bounds"):
        bounds = args[name]
        pair = isinstance(bounds, (list, tuple)) and len(bounds) == 2 and all(map(is_finite_real, bounds))
        if not pair or not bounds[0] < bounds[1]:
            raise ValueError(f"`{name}` must be (low, high) with low < high. Received: {name}={bounds!r}")
    # bn_epsilon 0 divides by zero on a constant channel.
    check_finite_number(args["bn_epsilon"], "bn_epsilon", lambda v: v > 0, "> 0")
    check_finite_number(args["bn_momentum"], "bn_momentum", lambda v: 0 <= v <= 1, "in [0, 1]")
    check_finite_number(args["log_scale_noise"], "log_scale_noise", lambda v: v >= 0, ">= 0")
    check_finite_number(args["l2"], "l2", lambda v: v >= 0, ">= 0")
    for name in ("seed", "nonlocal_feature_seed"):
        check_layer_seed(args[name], name)
    check_crop(args["crop"], image_shape)
