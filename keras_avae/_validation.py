"""Eager checks of what users pass to the models' inference methods.

`log_likelihood`, `reconstruct`, `encode` and `sample` (of every keras-avae
model) and `evaluation.importance_sampled_log_likelihood` check their inputs
here, on NumPy copies of concrete values, before any compiled function runs:
a NaN pixel, an empty batch or an infinite temperature is a `ValueError`
naming the argument and what was received, not a NaN result, a backend
internal error or a black image. The checks run outside traced code, so
these methods need concrete inputs (they run eagerly and return NumPy
arrays).

A module of its own (not under `models/`) so `evaluation.py`, which the
models import, can use it too. The layers check their constructor
arguments' numbers and seeds with the helpers at the end.
"""

import collections.abc
import math
import numbers
import sys

import ml_dtypes
import numpy as np
from keras import ops


def concrete_numpy(value, name):
    """A NumPy copy of a concrete array or tensor; a clear error for a traced one.

    Example:

    >>> concrete_numpy([[1, 2]], "x").shape
    (1, 2)
    """
    try:
        return np.asarray(ops.convert_to_numpy(_torch_bfloat16_as_numpy(value)))
    except Exception as error:  # a tf.function or jax.jit tracer, a ragged list
        raise ValueError(
            f"`{name}` must be a concrete array: the inference methods check their inputs and return NumPy "
            f"arrays, so they run eagerly (outside `tf.function` or `jax.jit`). "
            f"Received: {name} of type {type(value).__name__} ({type(error).__name__}: {error})"
        ) from None


def check_not_a_stream_of_batches(x, name):
    """Raises `ValueError` naming `name` and its type when `x` is a dataset, generator or iterator of batches.

    The inference methods (`log_likelihood`, `encode`, `reconstruct`, the
    `inspection` functions) take one batch. NumPy wraps a `tf.data.Dataset`
    or a generator in a 0-d object array, so these were refused as
    "`x` must be a numeric array of images. Received: x of dtype object with
    shape ()", which names neither what was passed nor what to do.

    Example:

    >>> check_not_a_stream_of_batches((b for b in []), "x")
    Traceback (most recent call last):
    ...
    ValueError: `x` must be one batch of images, an array or tensor of shape (batch, H, W, C). Received: x of type generator, ...
    """
    kinds = [collections.abc.Iterator]
    for module, names in (
        ("tensorflow", ("data.Dataset",)),
        ("keras", ("utils.PyDataset",)),
        ("torch", ("utils.data.DataLoader", "utils.data.Dataset")),
    ):
        root = sys.modules.get(module)  # only a library already imported can have made `x`
        for dotted in names if root is not None else ():
            kind = root
            for part in dotted.split("."):
                kind = getattr(kind, part, None)
            if isinstance(kind, type):
                kinds.append(kind)
    if isinstance(x, tuple(kinds)):
        raise ValueError(
            f"`{name}` must be one batch of images, an array or tensor of shape (batch, H, W, C). Received: "
            f"{name} of type {type(x).__name__}, a stream of batches: call the method on each batch "
            "(`keras_avae.evaluation.score_batches` scores an iterable of batches)"
        )


def concrete_images(x, name):
    """`concrete_numpy` of images, refusing a stream of batches by name (`check_not_a_stream_of_batches`).

    >>> concrete_images(np.zeros((1, 2, 2, 1)), "x").shape
    (1, 2, 2, 1)
    """
    check_not_a_stream_of_batches(x, name)
    return concrete_numpy(x, name)


def check_images(x, image_shape, pixel_range, name="x", allow_non_finite=False, single_image=False):
    """Checks a batch of images and returns it as a float32 NumPy array.

    Raises `ValueError` naming `name` for: a non-numeric (or complex) array,
    a wrong rank or image shape, an empty batch, NaN or infinite values
    (unless `allow_non_finite`), or finite values outside `pixel_range`
    (a float64 value too large for float32 too: out of range, not infinite).
    bfloat16 (and the other floats of `ml_dtypes`) are numbers: their values
    convert to float32 exactly. With `single_image`, `x` is one image
    `(H, W, C)`, returned as a batch of one; the messages give its own shape.

    Example:

    >>> check_images(np.zeros((2, 4, 4, 1)), (4, 4, 1), (0.0, 1.0)).dtype
    dtype('float32')
    >>> check_images(np.full((2, 4, 4, 1), np.nan), (4, 4, 1), (0.0, 1.0))
    Traceback (most recent call last):
    ...
    ValueError: `x` contains 32 non-finite values (NaN or inf), in images [0, 1]. Received: x with shape (2, 4, 4, 1)
    """
    array = concrete_images(x, name)
    if not is_real_dtype(array.dtype):
        raise ValueError(
            f"`{name}` must be a numeric array of images. Received: {name} of dtype {array.dtype} "
            f"with shape {array.shape}"
        )
    image_shape = tuple(image_shape)
    shape = tuple(array.shape)  # as received, for the messages
    if single_image:
        if shape != image_shape:
            raise ValueError(f"Expected `{name}` of shape {image_shape}, one image. Received: {name}.shape={shape}")
        array = array[None]
    elif array.ndim != 1 + len(image_shape) or shape[1:] != image_shape:
        raise ValueError(
            f"Expected `{name}` of shape (batch, {', '.join(map(str, image_shape))}). Received: {name}.shape={shape}"
        )
    if array.shape[0] == 0:
        raise ValueError(f"`{name}` is an empty batch: it needs at least one image. Received: {name}.shape={shape}")
    with np.errstate(over="ignore"):  # float64 beyond float32's range: judged on `array` below
        values = array.astype("float32", copy=False)
    _check_pixel_values(values, pixel_range, name, allow_non_finite, received=array, shape=shape)
    return values


def is_real_dtype(dtype):
    """Whether `dtype` holds real numbers: NumPy's ints, floats and bool, and `ml_dtypes`' floats (bfloat16).

    JAX, TensorFlow and PyTorch tensors of bfloat16 reach NumPy as
    `ml_dtypes.bfloat16`, which NumPy does not count as a number.

    >>> is_real_dtype(ml_dtypes.bfloat16), is_real_dtype(np.uint8), is_real_dtype(np.complex64), is_real_dtype(str)
    (True, True, False, False)
    """
    dtype = np.dtype(dtype)
    if dtype.kind in "biuf":
        return True
    return dtype.kind == "V" and _ml_dtypes_finfo(dtype) is not None


def is_narrow_float(dtype):
    """Whether `dtype` is a float with fewer significant bits than float32 (float16, bfloat16, the float8s).

    Their values convert to float32 exactly, but they round pixel levels
    such as `k / 127.5 - 1` (see `keras_avae.evaluation`).

    >>> is_narrow_float(ml_dtypes.bfloat16), is_narrow_float(np.float16), is_narrow_float(np.float32)
    (True, True, False)
    """
    info = _ml_dtypes_finfo(np.dtype(dtype))
    return info is not None and info.nmant < np.finfo(np.float32).nmant


def _ml_dtypes_finfo(dtype):
    """`ml_dtypes.finfo(dtype)` (NumPy's floats too), or `None` for a dtype that is no float."""
    if dtype.kind not in "fV":
        return None
    try:
        return ml_dtypes.finfo(dtype)
    except ValueError:  # a structured or opaque void dtype, ml_dtypes' int4
        return None


def _torch_bfloat16_as_numpy(value):
    """A PyTorch bfloat16 tensor as a NumPy `ml_dtypes.bfloat16` array (the same values); anything else as it is.

    NumPy cannot read a torch bfloat16 tensor ("Got unsupported ScalarType
    BFloat16"): Keras' torch backend converts it so, the other backends'
    `convert_to_numpy` did not. `torch` is looked at only if already imported.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16:
        return value
    return value.detach().cpu().float().numpy().astype(ml_dtypes.bfloat16)


def check_concrete_pixels(x, pixel_range, name="x"):
    """Raises if a concrete `x` has finite values outside `pixel_range`.

    For the building blocks of a model (a distribution's `log_prob`) rather
    than its inference methods: a tensor traced by `jit` or `tf.function`,
    a symbolic one, or one on an accelerator passes unchecked, and so do
    non-finite values (a NaN result in plain view, as in `fit`).

    Example:

    >>> check_concrete_pixels(np.array([[0.5, np.nan]]), (-1.0, 1.0))
    >>> check_concrete_pixels(np.array([[255.0, 0.0]]), (-1.0, 1.0))
    Traceback (most recent call last):
    ...
    ValueError: Expected pixel values of `x` in [-1.0, 1.0]. Received: x with values in [0.0, 255.0]
    """
    array = _concrete_or_none(x)
    if array is not None and (np.issubdtype(array.dtype, np.number) or array.dtype == bool) and array.ndim:
        _check_pixel_values(array, pixel_range, name, allow_non_finite=True)


def _check_pixel_values(array, pixel_range, name, allow_non_finite, received=None, shape=None):
    """`check_images`' checks of the values of `array`, a batch of images along its first axis.

    `received`: the array `array` is a float32 copy of, if any; `shape`: the
    shape to name (the received one, without the batch axis for one image).
    """
    finite = np.isfinite(array)
    all_finite = bool(finite.all())
    if not all_finite and received is not None and received.dtype.kind == "f" and received.dtype.itemsize > 4:
        # The float32 copy turns a float64 value beyond float32's range
        # (1e300) into inf: judge the values received, finite and out of range.
        array = received
        finite = np.isfinite(array)
        all_finite = bool(finite.all())
    shape = tuple(array.shape) if shape is None else shape
    if not all_finite and not allow_non_finite:
        where = ""
        if len(shape) == array.ndim:  # a batch: which images
            bad_images = np.flatnonzero(~finite.reshape(len(array), -1).all(axis=1))
            more = f" and {len(bad_images) - 5} more" if len(bad_images) > 5 else ""
            where = f", in images {bad_images[:5].tolist()}{more}"
        raise ValueError(
            f"`{name}` contains {int((~finite).sum())} non-finite values (NaN or inf){where}. "
            f"Received: {name} with shape {shape}"
        )
    low, high = pixel_range
    values = array if all_finite else array[finite]
    x_min, x_max = (float(values.min()), float(values.max())) if values.size else (low, high)
    if x_min < low or x_max > high:
        raise ValueError(
            f"Expected pixel values of `{name}` in [{low}, {high}]. "
            f"Received: {name} with values in [{x_min}, {x_max}]"
        )


def _concrete_or_none(value):
    """A NumPy copy of a concrete array or tensor in host memory, else `None`.

    `None` for a traced or symbolic tensor (no values yet) and for one on an
    accelerator: reading it back would make every eager step (PyTorch's)
    wait for the device.

    >>> class OnGPU:
    ...     device = "/job:localhost/replica:0/task:0/device:GPU:0"
    ...     def __array__(self, dtype=None, copy=None):
    ...         raise AssertionError("read back")
    >>> _concrete_or_none(OnGPU()) is None, _concrete_or_none(np.float32(2.0))
    (True, array(2., dtype=float32))
    """
    try:
        device = getattr(value, "device", None)  # TF: a name; torch: a torch.device; JAX: a Device
        if any(kind in str(getattr(device, "type", device)).lower() for kind in _ACCELERATORS):
            return None
        return np.asarray(ops.convert_to_numpy(value))
    except Exception:  # a jax.jit tracer, a tf.function or symbolic tensor, a torch meta tensor
        return None


_ACCELERATORS = ("gpu", "cuda", "tpu", "mps", "xpu")


def check_positive_int(value, name):
    """Returns `value` as an int if it is a positive integer (not a bool), else raises.

    Example:

    >>> check_positive_int(np.int64(3), "num_samples")
    3
    >>> check_positive_int(0, "num_samples")
    Traceback (most recent call last):
    ...
    ValueError: `num_samples` must be a positive int. Received: num_samples=0
    """
    if not is_integer(value) or value < 1:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
    return int(value)


def is_integer(value):
    """Whether `value` is an integer, NumPy's included (not a bool).

    >>> is_integer(np.int64(3)), is_integer(True), is_integer(3.0)
    (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_bool(value, name):
    """Raises unless `value` is a Python bool (a truthy string such as "no" would switch a feature on).

    Example:

    >>> check_bool("no", "generative_attention")
    Traceback (most recent call last):
    ...
    ValueError: `generative_attention` must be a bool. Received: generative_attention='no'
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")


def check_finite_number(value, name, condition, wanted):
    """Raises unless `value` is a finite real number (NumPy's too, not a bool) for which `condition` holds.

    Example:

    >>> check_finite_number(0.9, "bn_momentum", lambda v: 0 <= v <= 1, "in [0, 1]")
    >>> check_finite_number(10**400, "l2", lambda v: v >= 0, ">= 0")
    Traceback (most recent call last):
    ...
    ValueError: `l2` must be a finite number >= 0. Received: l2=1000...
    """
    if not (is_finite_real(value) and condition(value)):
        wanted = f" {wanted}" if wanted else ""
        raise ValueError(f"`{name}` must be a finite number{wanted}. Received: {name}={value!r}")


def is_finite_real(value):
    """Whether `value` is a finite real number, NumPy's included (not a bool; an int too large for a float is not).

    >>> is_finite_real(np.float32(0.5)), is_finite_real(True), is_finite_real(10**400)
    (True, False, False)
    """
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)
    except OverflowError:
        return False


def check_crop(crop, image_shape):
    """Raises unless `crop` leaves pixels to score: an int in `[0, min(H, W) / 2)`.

    Example:

    >>> check_crop(np.int64(2), (28, 28, 1))
    >>> check_crop(14, (28, 28, 1))
    Traceback (most recent call last):
    ...
    ValueError: `crop` must be a non-negative int smaller than half the image. Received: crop=14
    """
    if not is_integer(crop) or crop < 0 or 2 * crop >= min(image_shape[:2]):
        raise ValueError(f"`crop` must be a non-negative int smaller than half the image. Received: crop={crop!r}")


def check_image_shape(image_shape):
    """Raises unless `image_shape` is `(H, W, C)`: three positive ints (NumPy ints too).

    Example:

    >>> check_image_shape([28, 28, np.int64(1)])
    >>> check_image_shape((8.9, 8, 1))
    Traceback (most recent call last):
    ...
    ValueError: `image_shape` must be (H, W, C), three positive ints. Received: image_shape=(8.9, 8, 1)
    """
    if (
        not isinstance(image_shape, (list, tuple, np.ndarray))
        or np.ndim(image_shape) != 1
        or len(image_shape) != 3
        or not all(is_integer(s) and s > 0 for s in image_shape)
    ):
        raise ValueError(f"`image_shape` must be (H, W, C), three positive ints. Received: image_shape={image_shape!r}")


def check_temperature(value, name="temperature"):
    """Returns `value` as a float if it is finite and positive, else raises.

    Example:

    >>> check_temperature(0.8)
    0.8
    >>> check_temperature(float("inf"))
    Traceback (most recent call last):
    ...
    ValueError: `temperature` must be a finite positive number. Received: temperature=inf
    """
    try:
        if isinstance(value, (bool, np.bool_, str, bytes)):
            raise TypeError
        number = float(value) if isinstance(value, numbers.Real) else float(concrete_numpy(value, name))
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a finite positive number. Received: {name}={value!r}") from None
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"`{name}` must be a finite positive number. Received: {name}={value!r}")
    return number


def check_concrete_temperature(value, name="temperature"):
    """Raises unless `value` (a number, or an array or tensor of any shape) is finite and positive.

    A tensor traced by `jit` or `tf.function`, or a symbolic one, passes
    unchecked (its values are not known until it runs), and so does one on
    an accelerator (reading it back would stall every eager step).

    Example:

    >>> check_concrete_temperature(np.array([[0.5, 2.0]]))
    >>> check_concrete_temperature(np.float32(-2.0))
    Traceback (most recent call last):
    ...
    ValueError: `temperature` must be finite and positive. Received: temperature=np.float32(-2.0)
    """
    if isinstance(value, (numbers.Number, str, bytes)):
        if not (is_finite_real(value) and value > 0):
            raise ValueError(f"`{name}` must be finite and positive. Received: {name}={value!r}")
        return
    array = _concrete_or_none(value)
    if array is None:
        return
    numeric = np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)  # not bool
    if not (numeric and array.size and np.isfinite(array).all() and (array > 0).all()):
        # A NumPy value reaches `call` as a backend tensor: show its values, not the tensor's repr.
        shown = f"={array.item()!r}" if array.size == 1 else f" of shape {array.shape} and dtype {array.dtype}"
        if numeric and array.size > 1:
            shown += f", with values in [{array.min()}, {array.max()}]"
        raise ValueError(f"`{name}` must be finite and positive. Received: {name}{shown}")


def check_finite_outputs(arrays, what, cause="the model's weights are probably not finite (a diverged run)"):
    """Returns `arrays` (one array or a list, images on the first axis) if all finite, else raises.

    Never a silently black image, an empty bar or a NaN figure.

    Example:

    >>> check_finite_outputs(np.array([[0.5], [np.nan]]), "reconstructions")
    Traceback (most recent call last):
    ...
    FloatingPointError: 1 of the 2 reconstructions hold non-finite values: the model's weights are probably not finite (a diverged run).
    """
    parts = arrays if isinstance(arrays, (list, tuple)) else [arrays]
    count = len(parts[0])
    bad = np.zeros(count, bool)
    for part in parts:
        bad |= ~np.isfinite(np.asarray(part, np.float64).reshape(count, -1)).all(axis=1)
    if bad.any():
        raise FloatingPointError(f"{int(bad.sum())} of the {count} {what} hold non-finite values: {cause}.")
    return arrays


def to_numpy(value):
    """What the inference methods return: NumPy arrays (lists of them stay lists).

    Example:

    >>> to_numpy([np.ones(2), np.zeros(1)])[1]
    array([0.])
    """
    if isinstance(value, (list, tuple)):
        return [to_numpy(v) for v in value]
    return np.asarray(ops.convert_to_numpy(value))


# The largest seed the seeded layers take: they seed a second stream with
# `seed + 1`, which must fit the backends' seed dtypes (int32 on torch,
# uint32 on JAX).
MAX_LAYER_SEED = 2**31 - 2


def is_int(value):
    """Whether `value` is a Python int (not a bool).

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value):
    """Whether `value` is a finite Python int or float (not a bool; an int too large for a float is not).

    >>> is_finite_number(1e-6), is_finite_number(float("inf")), is_finite_number(10**400)
    (True, False, False)
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_layer_seed(seed):
    """Whether `seed` is `None` or an integer (NumPy's too) in `[0, MAX_LAYER_SEED]`.

    >>> is_layer_seed(None), is_layer_seed(np.int64(2**31 - 2)), is_layer_seed(2**31 - 1)
    (True, True, False)
    """
    return seed is None or (is_integer(seed) and 0 <= int(seed) <= MAX_LAYER_SEED)


def check_layer_seed(seed, name="seed"):
    """Returns `seed` as a Python int (or `None`); raises unless `is_layer_seed(seed)`.

    Store what it returns: a NumPy integer would make the config unserialisable as JSON.

    Example:

    >>> check_layer_seed(np.int64(3))
    3
    >>> check_layer_seed(-1, "nonlocal_feature_seed")
    Traceback (most recent call last):
    ...
    ValueError: `nonlocal_feature_seed` must be an integer in [0, 2147483646] or None. Received: nonlocal_feature_seed=-1
    """
    if not is_layer_seed(seed):
        raise ValueError(f"`{name}` must be an integer in [0, {MAX_LAYER_SEED}] or None. Received: {name}={seed!r}")
    return None if seed is None else int(seed)
