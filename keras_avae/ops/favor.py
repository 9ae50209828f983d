"""FAVOR+: linear-time softmax attention with positive orthogonal random features.

Reference: Choromanski et al., "Rethinking Attention with Performers",
ICLR 2021 (https://arxiv.org/abs/2009.14794).

For `q, k` in R^d and `w ~ N(0, I_d)`,
`E[exp(w.q - |q|^2/2) exp(w.k - |k|^2/2)] = exp(q.k)`, so with m random rows
`W`, `phi(x) = m^-1/2 exp(W x - |x|^2/2)` gives an unbiased estimate
`phi(q).phi(k)` of the softmax kernel `exp(q.k)` with strictly positive
features. Attention then factorises as
`D^-1 (phi(Q) (phi(K)^T V))` with `D = diag(phi(Q) (phi(K)^T 1))`, which costs
O(L m d) instead of O(L^2 d). Orthogonal rows of `W` lower the estimator's
variance without biasing it.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_avae._validation import check_bool
from keras_avae._validation import is_finite_real
from keras_avae.ops.channels import split_channels

_KERNELS = ("softmax", "relu")
_SCALINGS = ("chi", "sqrt")
# Sequence chunk of the causal prefix sums: memory O(L/C * m * d_v + L * C)
# instead of O(L * m * d_v) for one running sum per position.
_CAUSAL_CHUNK_SIZE = 128


def orthogonal_random_features(num_features, dim, seed=None, scaling="chi", dtype="float32"):
    """Draws a `(num_features, dim)` matrix of orthogonal random features.

    Rows come in blocks of `dim` exactly orthogonal directions (the rows of
    `Q^T` for the QR decomposition of a Gaussian `dim x dim` matrix, with the
    signs fixed so that `Q` is Haar-distributed); `ceil(num_features / dim)`
    independent blocks are stacked and truncated to `num_features` rows. Each
    row is then given a length: the norm of a fresh `N(0, I_dim)` vector
    (`scaling="chi"`, so every row is marginally `N(0, I_dim)` and the FAVOR+
    softmax estimator stays unbiased) or `sqrt(dim)` (`scaling="sqrt"`, the
    Performer paper's "regularized" variant).

    Args:
        num_features: positive int, the number of rows m.
        dim: positive int, the dimension d of the vectors to project.
        seed: int, `keras.random.SeedGenerator` or `None`. An int seed draws
            the Gaussians with NumPy on the host, so it gives the same matrix
            on every backend, eagerly and under `jit_compile` (TensorFlow's
            stateless random ops give different numbers under XLA). Use a
            `SeedGenerator` for fresh draws inside a compiled function.
        scaling: `"chi"` or `"sqrt"`, how rows are scaled (see above).
        dtype: dtype of the result.

    Returns:
        A `(num_features, dim)` tensor.

    Example:

    >>> w = orthogonal_random_features(6, 4, seed=0)
    >>> tuple(w.shape)
    (6, 4)
    """
    if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features <= 0:
        raise ValueError(f"`num_features` must be a positive integer. Received: num_features={num_features}")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
        raise ValueError(f"`dim` must be a positive integer. Received: dim={dim}")
    if scaling not in _SCALINGS:
        raise ValueError(f"`scaling` must be one of {_SCALINGS}. Received: scaling={scaling!r}")
    if isinstance(seed, bool) or (isinstance(seed, int) and seed < 0):
        raise ValueError(f"`seed` must be a non-negative int, a SeedGenerator or None. Received: seed={seed!r}")
    if isinstance(seed, int):
        return ops.convert_to_tensor(_numpy_orthogonal_features(num_features, dim, seed, scaling), dtype)
    num_blocks = -(-num_features // dim)
    block_size = num_blocks * dim * dim
    total = block_size + (num_features * dim if scaling == "chi" else 0)
    gaussian = keras.random.normal((total,), seed=seed, dtype="float32")
    blocks = ops.reshape(gaussian[:block_size], (num_blocks, dim, dim))
    q, r = ops.linalg.qr(blocks)
    # QR routines leave the signs of R's diagonal arbitrary; flipping Q's
    # columns to make it positive makes Q Haar-distributed (Mezzadri 2007).
    signs = ops.where(ops.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0)
    q = q * ops.expand_dims(signs, axis=-2)
    directions = ops.reshape(ops.transpose(q, (0, 2, 1)), (num_blocks * dim, dim))[:num_features]

    if scaling == "chi":
        norms = ops.norm(ops.reshape(gaussian[block_size:], (num_features, dim)), axis=-1)
    else:
        norms = ops.full((num_features,), math.sqrt(dim), dtype="float32")
    return ops.cast(directions * ops.expand_dims(norms, -1), dtype)


def _numpy_orthogonal_features(num_features, dim, seed, scaling="chi"):
    """`orthogonal_random_features` for an int seed, as a float32 NumPy array.

    Computed on the host, so that layers whose features are fixed compute
    them once, outside any traced function, the same on every backend.
    """
    num_blocks = -(-num_features // dim)
    block_size = num_blocks * dim * dim
    # One draw split in two: two draws from the same integer seed would reuse
    # the same random stream for the directions and the norms.
    total = block_size + (num_features * dim if scaling == "chi" else 0)
    gaussian = np.random.default_rng(seed).standard_normal(total, dtype=np.float32)
    q, r = np.linalg.qr(gaussian[:block_size].reshape(num_blocks, dim, dim))
    # See above: positive diagonal of R, so that Q is Haar-distributed.
    q = q * np.where(np.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0)[:, None, :]
    directions = np.transpose(q, (0, 2, 1)).reshape(num_blocks * dim, dim)[:num_features]
    if scaling == "chi":
        norms = np.linalg.norm(gaussian[block_size:].reshape(num_features, dim), axis=-1)
    else:
        norms = np.full((num_features,), math.sqrt(dim), dtype=np.float32)
    return (directions * norms[:, None]).astype(np.float32)


def favor_feature_map(x, random_features, kernel="softmax", is_query=True, scale=None, eps=1e-6):
    """FAVOR+ feature map `phi(x)` of queries or keys, in float32.

    `x` is first multiplied by `sqrt(scale)` so that `phi(q).phi(k)`
    estimates the kernel of the logits `scale * q.k`. Then, with `W` the
    `(m, d)` random features:

    - `kernel="softmax"`: `phi(x) = m^-1/2 (exp(W x - |x|^2/2 - c) + eps)`;
      with `eps = 0`, `phi(q).phi(k) exp(c_q + c_k)` is an unbiased estimate
      of `exp(scale * q.k)`. The stabiliser `c` is the maximum of the
      exponent over the features of each row for queries, and over the
      features and the whole sequence (per leading index and head) for keys,
      under `stop_gradient`. Both cancel in attention's ratio and keep `exp`
      in `(0, 1]`, so `eps` is relative to the largest feature and its bias
      does not grow with m.
    - `kernel="relu"`: `phi(x) = m^-1/2 (relu(W x) + eps)`, the Performer's
      generalised ReLU kernel (no exponential, no stabiliser).

    Args:
        x: tensor `(..., L, N, d)`: sequence, heads, head size.
        random_features: `(m, d)` tensor, e.g. from
            `orthogonal_random_features`.
        kernel: `"softmax"` or `"relu"`.
        is_query: whether `x` holds queries (per-row stabiliser) or keys (one
            stabiliser per leading index and head).
        scale: logit scale; default `1 / sqrt(d)`.
        eps: constant in [0, 1] added to every feature (before the
            `m^-1/2` factor), keeping the attention normaliser away from zero.

    Returns:
        The float32 features, shape `(..., L, N, m)`.

    Example:

    >>> import numpy as np
    >>> w = orthogonal_random_features(16, 8, seed=0)
    >>> x = np.random.normal(size=(2, 5, 3, 8))
    >>> tuple(favor_feature_map(x, w).shape)
    (2, 5, 3, 16)
    """
    return _feature_map(x, random_features, kernel, is_query, scale, eps)


def favor_attention(
    query,
    key,
    value,
    random_features,
    kernel="softmax",
    causal=False,
    key_mask=None,
    scale=None,
    eps=1e-6,
    value_kernel=None,
    value_bias=None,
):
    """FAVOR+ attention, approximating `softmax(scale * Q K^T) V` in linear time.

    Non-causal: `D^-1 (phi(Q) (phi(K)^T V))` with
    `D = phi(Q) (phi(K)^T 1)`. Causal (each query attends to keys at its own
    and earlier positions): the same with prefix sums over the sequence,
    computed chunk by chunk (exact sums inside a chunk, a running state
    between chunks) so that memory does not grow as `L * m * d_v`. Features,
    sums and the division run in float32.

    Note that in the causal case the keys' stabiliser is a maximum over the
    whole sequence, so keys whose logits are far (more than ~80 in float32)
    below that maximum underflow to `eps` features.

    Args:
        query: `(B, T, N, d)` tensor (MultiHeadAttention's projected layout),
            or `(B, T, d)` for a single head without a head axis (then `key`
            and `value` are `(B, S, d)` and `(B, S, d_v)`, and so is the result).
        key: `(B, S, N, d)` tensor.
        value: `(B, S, N, d_v)` tensor.
        random_features: `(m, d)` tensor of random features.
        kernel: `"softmax"` or `"relu"` (see `favor_feature_map`).
        causal: if `True` (requires `T == S`), query `t` attends only to keys
            `s <= t`.
        key_mask: optional `(B, S)` boolean or 0/1 tensor, `True`/1 for valid
            keys. Masked keys' features are zeroed, so they leave the
            numerator and the normaliser. `None` means all keys are valid.
        scale: softmax logit scale; default `1 / sqrt(d)`.
        eps: constant in [0, 1] added to every feature (see
            `favor_feature_map`).
        value_kernel: optional `(d_v, d_out)` matrix: attend over the
            projected values `value @ value_kernel + value_bias` instead of
            `value`. Attention is linear in the values and its weights sum
            to one, so for one head without `causal` the projection is
            applied to the `(d_v + 1, m)` summary `phi(K)^T [V, 1]` rather
            than to all S values (the same result up to float rounding).
        value_bias: optional `(d_out,)` bias of that projection (only with
            `value_kernel`).

    Returns:
        `(B, T, N, d_v)` tensor (`d_out` with `value_kernel`) in `query`'s
        dtype. A query with no valid key gets zeros (`value_bias` included).

    Example:

    >>> import numpy as np
    >>> q = np.random.normal(size=(2, 10, 4, 8)).astype("float32")
    >>> v = np.random.normal(size=(2, 10, 4, 6)).astype("float32")
    >>> w = orthogonal_random_features(64, 8, seed=2)
    >>> tuple(favor_attention(q, q, v, w, causal=True).shape)
    (2, 10, 4, 6)
    """
    check_bool(causal, "causal")
    _check_attention_shapes(query, key, value, key_mask)
    if causal and query.shape[1] is not None and key.shape[1] is not None and query.shape[1] != key.shape[1]:
        raise ValueError(
            "`causal=True` requires as many queries as keys. "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    single_head = len(query.shape) == 3
    value_map = _value_map(value_kernel, value_bias, value.shape[-1])
    valid = None
    if key_mask is not None:
        valid = ops.cast(key_mask, "bool")[:, :, None] if single_head else ops.cast(key_mask, "bool")[:, :, None, None]
    v = ops.cast(value, "float32")
    if single_head and not causal:
        out = _single_head_attention(query, key, v, random_features, kernel, scale, eps, valid, value_map)
        return ops.cast(out, query.dtype)
    if value_kernel is not None:
        # Causal sums and several heads: project the values themselves.
        v = ops.matmul(v, ops.cast(value_kernel, "float32"))
        if value_bias is not None:
            v = v + ops.cast(value_bias, "float32")
    if single_head:  # causal
        expand = lambda x: None if x is None else ops.expand_dims(x, 2)  # noqa: E731
        out = favor_attention(expand(query), expand(key), expand(v), random_features, kernel, True, key_mask, scale, eps)
        return ops.cast(out[:, :, 0, :], query.dtype)
    q_prime = _feature_map(query, random_features, kernel, True, scale, eps, normalise=False)
    k_prime = _feature_map(key, random_features, kernel, False, scale, eps, valid=valid, normalise=False)
    if causal:
        numerator, denominator = _causal_sums(q_prime, k_prime, v)
    else:
        kv = ops.einsum("bsnm,bsnd->bnmd", k_prime, v)
        numerator = ops.einsum("btnm,bnmd->btnd", q_prime, kv)
        denominator = ops.einsum("btnm,bnm->btn", q_prime, ops.sum(k_prime, axis=1))
    # Features are non-negative, so the normaliser is zero only when every
    # term of the numerator is zero too (no valid key): return 0, not NaN.
    denominator = ops.where(denominator > 0, denominator, ops.ones_like(denominator))
    return ops.cast(numerator / ops.expand_dims(denominator, -1), query.dtype)


def _check_attention_shapes(query, key, value, key_mask):
    """Raises for shapes that do not fit `(B, T, N, d)`, `(B, S, N, d)`, `(B, S, N, d_v)`, `(B, S)`.

    Only known sizes are compared. Without it, TensorFlow raised from inside
    an einsum, and JAX and PyTorch broadcast a batch or a head of size 1.
    """
    shapes = {name: tuple(x.shape) for name, x in (("query", query), ("key", key), ("value", value))}
    if key_mask is not None:
        shapes["key_mask"] = tuple(key_mask.shape) if hasattr(key_mask, "shape") else np.shape(key_mask)  # a list
    received = ", ".join(f"{name}.shape={shape}" for name, shape in shapes.items())
    rank = len(shapes["query"])
    if rank not in (3, 4) or len(shapes["key"]) != rank or len(shapes["value"]) != rank:
        raise ValueError(
            f"`query`, `key` and `value` must be (B, T, N, d), (B, S, N, d) and (B, S, N, d_v) tensors, or "
            f"(B, T, d), (B, S, d) and (B, S, d_v) for one head. Received: {received}"
        )
    if key_mask is not None and len(shapes["key_mask"]) != 2:
        raise ValueError(f"`key_mask` must be a (B, S) tensor. Received: {received}")
    # (array, axis) pairs whose known sizes must agree: batch, sequence, channels, heads.
    groups = [
        [("query", 0), ("key", 0), ("value", 0), ("key_mask", 0)],
        [("key", 1), ("value", 1), ("key_mask", 1)],
        [("query", rank - 1), ("key", rank - 1)],
    ]
    if rank == 4:
        groups.append([("query", 2), ("key", 2), ("value", 2)])
    for group in groups:
        group = [(name, axis) for name, axis in group if name in shapes]
        sizes = {shapes[name][axis] for name, axis in group} - {None}
        if len(sizes) > 1:
            axes = ", ".join(f"{name} axis {axis}" for name, axis in group)
            raise ValueError(f"These sizes must be equal: {axes}. Received: {received}")


def _single_head_attention(query, key, value, random_features, kernel, scale, eps, valid, value_map=None):
    """Non-causal `favor_attention` of `(B, T, d)` queries: `(B, T, d_v)` float32.

    Two matrix products in all: the normaliser rides along the numerator
    as a column of ones appended to the values, and the `eps` added to
    every feature is added to the (small) products instead of to the
    `(B, L, m)` features: `(phi + eps) M = phi M + eps 1 (1^T M)`. Keys
    outside `valid` must contribute nothing, not `eps`, so with a mask the
    keys' `eps` is added to their features as in `_feature_map`.
    `value_map` (see `_value_map`) projects the values' `(d_v + 1, m)`
    summary, ones row included, so the normaliser stays that of the
    projected values.
    """
    key_eps = eps if valid is not None else 0.0
    k_prime = _feature_map(key, random_features, kernel, False, scale, key_eps, valid, False, sequence_axis=-2)
    batch, length = ops.shape(value)[0], ops.shape(value)[1]
    value_dim = value.shape[-1]
    values_and_ones = ops.concatenate([value, ops.ones((batch, length, 1), dtype="float32")], axis=-1)
    # The small (d_v + 1) axis as rows, `(kv)^T` (and on TensorFlow and JAX
    # `(phi(Q) kv)^T` too): CPU matrix products whose result has a handful
    # of columns run slowly (the two products alone, forward and backward
    # at 32x32 positions and d_v + 1 = 5, 2-core CPU: about 2x faster so on
    # PyTorch, 1.4-1.6x on JAX, 1.1-1.2x on TensorFlow,
    # `benchmarks/favor_product_layout.py --values 5`).
    kv_t = _batch_matmul(values_and_ones, k_prime, transpose_a=True)  # (B, d_v + 1, m)
    if valid is None:
        kv_t = kv_t + eps * ops.expand_dims(ops.sum(values_and_ones, axis=1), -1)
    if value_map is not None:
        kv_t = ops.matmul(value_map, kv_t)  # (B, d_out + 1, m)
        value_dim = value_map.shape[0] - 1
    q_prime = _feature_map(query, random_features, kernel, True, scale, 0.0, normalise=False)
    if keras.backend.backend() == "torch":
        # `(B, T, d_v + 1)` straight from the product: a transposed result
        # is a strided view on torch, and the elementwise ops that mix it
        # with contiguous tensors (the caller's residual, the gradients)
        # are slow: adding a transposed (32, 1024, 36) tensor to a
        # contiguous one took 1.8 ms against 0.1 ms for two contiguous
        # ones, where this product costs about 0.7 ms more than `(kv^T
        # phi(Q)^T)` (2-core CPU).
        out = ops.matmul(q_prime, ops.transpose(kv_t, (0, 2, 1)))
        out = out + eps * ops.expand_dims(ops.sum(kv_t, axis=2), 1)
    else:
        out_t = _batch_matmul(kv_t, q_prime, transpose_b=True)
        out_t = out_t + eps * ops.sum(kv_t, axis=2, keepdims=True)
        out = ops.transpose(out_t, (0, 2, 1))
    numerator, denominator = split_channels(out, [value_dim, 1])
    # Features are non-negative, so the normaliser is zero only when every
    # term of the numerator is zero too (no valid key): return 0, not NaN.
    denominator = ops.where(denominator > 0, denominator, ops.ones_like(denominator))
    # A product with the (B, T, 1) reciprocal: its gradient costs two passes
    # over the (B, T, d_v) output where a division's costs about five.
    return numerator * (1.0 / denominator)


def _value_map(value_kernel, value_bias, value_dim):
    """`[[K^T, b], [0, 1]]`, `(d_out + 1, d_v + 1)` float32, from `favor_attention`'s value projection.

    Applied to `[V, 1]^T` it gives `[V K + 1 b^T, 1]^T`: the projected values
    and the ones row of the normaliser. `None` without a `value_kernel`.
    """
    if value_kernel is None:
        if value_bias is not None:
            raise ValueError(f"`value_bias` needs a `value_kernel`. Received: value_bias with shape {tuple(value_bias.shape)}")
        return None
    if len(value_kernel.shape) != 2 or value_kernel.shape[0] != value_dim:
        raise ValueError(
            f"`value_kernel` must have shape (d_v, d_out) = ({value_dim}, d_out) for values with {value_dim} channels. "
            f"Received: value_kernel with shape {tuple(value_kernel.shape)}"
        )
    out_dim = value_kernel.shape[1]
    if value_bias is None:
        value_bias = ops.zeros((out_dim,), dtype="float32")
    elif tuple(value_bias.shape) != (out_dim,):
        raise ValueError(f"`value_bias` must have shape ({out_dim},). Received: value_bias with shape {tuple(value_bias.shape)}")
    top = ops.concatenate(
        [ops.transpose(ops.cast(value_kernel, "float32")), ops.expand_dims(ops.cast(value_bias, "float32"), -1)], axis=1
    )
    ones_row = ops.convert_to_tensor(np.eye(1, value_dim + 1, value_dim, dtype=np.float32))
    return ops.concatenate([top, ones_row], axis=0)


def _scaled_random_features(random_features, scale, dim):
    """The logit scale (default `1 / sqrt(dim)`) and `sqrt(scale) W` in float32.

    Scaling the (m, d) features rather than x by sqrt(scale) saves a pass
    over the inputs: W (sqrt(s) x) = (sqrt(s) W) x.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    return scale, ops.cast(random_features, "float32") * math.sqrt(scale)


def _unmasked_query_features(projection, kernel):
    """Features from `projection = W x` for queries without a mask (and for any ReLU features)."""
    if kernel == "relu":
        return ops.relu(projection)
    # The query stabiliser is the maximum over the features of
    # `W x - s |x|^2 / 2`; the second term is constant along them, so it
    # cancels and `exponent - stabiliser = W x - max(W x)` exactly.
    return ops.exp(projection - ops.stop_gradient(ops.max(projection, axis=-1, keepdims=True)))


def _batch_matmul(a, b, transpose_a=False, transpose_b=False):
    """`a @ b` for `(B, ., .)` tensors, `a` or `b` read transposed in its last two axes.

    TensorFlow's batch matrix product reads a transposed operand in place,
    in the forward and the backward pass, where a separate transpose copies
    the `(B, L, m)` features each time (a TensorFlow `mnist-attentive-small`
    step was 2.4% faster without them, in paired steps in one process). On
    PyTorch the transpose is a strided view, and XLA folds it into the
    product.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    if transpose_a:
        a = ops.transpose(a, (0, 2, 1))
    if transpose_b:
        b = ops.transpose(b, (0, 2, 1))
    return ops.matmul(a, b)


def _project(x, random_features):
    """`x @ W^T` over the last axis, as one 2-D matrix product (no einsum transposes)."""
    shape = ops.shape(x)
    flat = ops.matmul(ops.reshape(x, (-1, x.shape[-1])), ops.transpose(random_features))
    return ops.reshape(flat, (*shape[:-1], random_features.shape[0]))


def check_favor_eps(eps):
    """Raises unless `eps` (added to every feature) is a real number in [0, 1].

    Larger values swamp the features (and overflow float32 past about 3e38,
    giving NaN attention).

    >>> check_favor_eps(1e39)
    Traceback (most recent call last):
    ...
    ValueError: `eps` must be a non-negative float of at most 1. Received: eps=1e+39
    """
    if not is_finite_real(eps) or not 0 <= eps <= 1:
        raise ValueError(f"`eps` must be a non-negative float of at most 1. Received: eps={eps!r}")


def _validate(kernel, scale, eps):
    if kernel not in _KERNELS:
        raise ValueError(f"`kernel` must be one of {_KERNELS}. Received: kernel={kernel!r}")
    if scale is not None and not (is_finite_real(scale) and scale > 0):
        raise ValueError(f"`scale` must be a finite positive number or None. Received: scale={scale!r}")
    check_favor_eps(eps)


def _feature_map(x, random_features, kernel, is_query, scale, eps, valid=None, normalise=True, sequence_axis=-3):
    """`favor_feature_map`, with keys outside `valid` left out of the stabiliser and zeroed.

    `normalise=False` leaves out the constant `m^-1/2`, which cancels in
    attention's ratio: one pass less over the `(..., L, N, m)` features.
    `sequence_axis` is -3 for `(..., L, N, d)` inputs, -2 for one head
    without a head axis, `(B, L, d)`.
    """
    _validate(kernel, scale, eps)
    if random_features.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"`random_features` must have one column per channel of the queries and keys ({x.shape[-1]}). "
            f"Received: random_features.shape={tuple(random_features.shape)}"
        )
    num_features = random_features.shape[0]
    x = ops.cast(x, "float32")
    scale, weights = _scaled_random_features(random_features, scale, x.shape[-1])
    projection = _project(x, weights)
    if kernel == "relu" or (is_query and valid is None):
        features = _unmasked_query_features(projection, kernel)
    else:
        half_norm = (0.5 * scale) * ops.sum(ops.square(x), axis=-1, keepdims=True)
        row_max = ops.max(projection, axis=-1, keepdims=True)
        if valid is not None:
            # Padding keys must neither set the stabiliser (their values are
            # arbitrary) nor reach exp; a finite floor keeps gradients clean.
            row_max = ops.where(valid, row_max, -1e30)
        # The maximum of `W x - s |x|^2 / 2` over the features (and, for keys,
        # the sequence), from the (..., L, N, 1) row maxima: no full pass.
        if is_query:
            stabiliser = row_max - half_norm
        else:
            stabiliser = ops.max(row_max - half_norm, axis=sequence_axis, keepdims=True)
        # `W x - max(W x)` plus a per-row offset that is at most 0 in float32
        # too (the stabiliser is the maximum of the very same values), so the
        # features stay in (0, 1]. Subtracting `half_norm + stabiliser` instead
        # cancels two numbers of size |x|^2: past entries of about 1e3 the
        # features exceeded 1, and near 6e4 they reached inf (NaN attention).
        # Only the (..., 1) column is negated: torch's gradient of a
        # subtraction negates the whole (..., L, N, m) gradient.
        row_max = ops.stop_gradient(row_max)
        offset = (row_max - half_norm) - ops.stop_gradient(stabiliser)
        exponent = projection + ops.negative(row_max - offset)
        if valid is not None:
            exponent = ops.where(valid, exponent, -1e30)
        features = ops.exp(exponent)
    # eps is relative to the largest softmax feature (1 after stabilisation),
    # so its bias does not grow with the number of features.
    if eps:
        features = features + eps
    if normalise:
        features = features / math.sqrt(num_features)
    if valid is not None:
        features = features * ops.cast(valid, "float32")
    return features


def _causal_sums(q_prime, k_prime, v):
    """Causal numerator `(B, T, N, d_v)` and normaliser `(B, T, N)` by chunked prefix sums."""
    batch, length, heads, num_features = ops.shape(q_prime)
    value_dim = ops.shape(v)[-1]
    chunk = _CAUSAL_CHUNK_SIZE
    if isinstance(length, int) and length <= chunk:
        chunk = length
    # Zero-padding at the end changes no prefix sum of a real position.
    pad = (-length) % chunk
    if not isinstance(pad, int) or pad:
        q_prime = ops.pad(q_prime, ((0, 0), (0, pad), (0, 0), (0, 0)))
        k_prime = ops.pad(k_prime, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = ops.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    # With a static length, the batch is the reshapes' inferred axis, so that
    # TensorFlow keeps the static length when the batch size is unknown.
    if isinstance(length, int):
        batch, num_chunks = -1, (length + pad) // chunk
    else:
        num_chunks = -1
    q_c = ops.reshape(q_prime, (batch, num_chunks, chunk, heads, num_features))
    k_c = ops.reshape(k_prime, (batch, num_chunks, chunk, heads, num_features))
    v_c = ops.reshape(v, (batch, num_chunks, chunk, heads, value_dim))

    # State carried into each chunk: the sums over all earlier chunks.
    kv_chunk = ops.einsum("bcinm,bcind->bcnmd", k_c, v_c)
    k_chunk = ops.sum(k_c, axis=2)
    kv_before = _exclusive_cumsum(kv_chunk)
    k_before = _exclusive_cumsum(k_chunk)
    numerator = ops.einsum("bcinm,bcnmd->bcind", q_c, kv_before)
    denominator = ops.einsum("bcinm,bcnm->bcin", q_c, k_before)

    # Inside a chunk: exact lower-triangular (C x C) kernel scores.
    scores = ops.einsum("bcinm,bcjnm->bcnij", q_c, k_c)
    scores = scores * ops.tril(ops.ones((chunk, chunk), dtype="float32"))
    numerator = numerator + ops.einsum("bcnij,bcjnd->bcind", scores, v_c)
    denominator = denominator + ops.transpose(ops.sum(scores, axis=-1), (0, 1, 3, 2))

    padded = num_chunks * chunk if isinstance(length, int) else -1
    numerator = ops.reshape(numerator, (batch, padded, heads, value_dim))[:, :length]
    denominator = ops.reshape(denominator, (batch, padded, heads))[:, :length]
    return numerator, denominator


def _exclusive_cumsum(x):
    """Sums over the chunks strictly before each chunk (axis 1)."""
    total = ops.cumsum(x, axis=1)
    return ops.concatenate([ops.zeros_like(total[:, :1]), total[:, :-1]], axis=1)
