"""The checks of `HierarchicalVAE`'s constructor arguments (each error names the argument)."""

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


def validate_config(args):
    """Raises a `ValueError` naming the first invalid argument of `HierarchicalVAE(**args)`.

    Example:

    >>> validate_config({"num_layers": 0})
    Traceback (most recent call last):
    ...
    ValueError: `num_layers` must be a positive int. Received: num_layers=0
    """
    def positive_int(name):
        value = args[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")

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
        "num_mixtures",
    ):
        positive_int(name)
    image_shape = args["image_shape"]
    scale = 2 ** args["num_scales"]
    if len(image_shape) != 3 or image_shape[0] % scale or image_shape[1] % scale:
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
        low, high = args[name]
        if not low < high:
            raise ValueError(f"`{name}` must be (low, high) with low < high. Received: {name}={args[name]}")
    for name in ("seed", "nonlocal_feature_seed"):
        value = args[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"`{name}` must be a non-negative int or None. Received: {name}={value!r}")
    crop = args["crop"]
    if not isinstance(crop, int) or crop < 0 or 2 * crop >= min(image_shape[:2]):
        raise ValueError(f"`crop` must be a non-negative int smaller than half the image. Received: crop={crop!r}")
