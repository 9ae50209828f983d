"""Every `WeightNormConv2D` kernel of a forward pass computed at once (PyTorch)."""

import contextlib
import contextvars
import functools

import keras

# layer id -> its normalised kernel, for the pass in progress (or None).
_SHARED_KERNELS = contextvars.ContextVar("keras_avae_shared_kernels", default=None)


def shared_kernel(layer):
    """The kernel `batched_normalized_kernels` computed for `layer` in this pass, or `None`.

    Example:

    >>> from keras_avae.layers import WeightNormConv2D
    >>> conv = WeightNormConv2D(2, 3)
    >>> conv.build((1, 4, 4, 1))
    >>> shared_kernel(conv) is None  # outside batched_normalized_kernels
    True
    """
    kernels = _SHARED_KERNELS.get()
    return None if kernels is None else kernels.get(id(layer))


@contextlib.contextmanager
def batched_normalized_kernels(layers):
    """Inside, each of `layers` (built `WeightNormConv2D`s) convolves with a kernel computed for all at once.

    Weight normalisation is a dozen small ops per kernel, forward and
    backward; a `mnist-baseline-small` training step normalises 57 kernels,
    and on PyTorch each op costs Python, dispatch and autograd bookkeeping
    that dwarf its arithmetic (about 7% of that step, measured by freezing
    the normalised kernels). Here kernels of the same shape are stacked and
    normalised together in one autograd node with hand-written gradients:
    a few ops per distinct shape instead of a dozen per kernel. The values
    and gradients are those of `WeightNormConv2D.normalized_kernel`.
    Elsewhere than PyTorch (compiled steps fuse these ops), with kernels
    that are not float32, or when already inside, it does nothing.

    Args:
        layers: the `WeightNormConv2D` layers of the pass.

    Example:

    >>> from keras_avae.layers import WeightNormConv2D
    >>> conv = WeightNormConv2D(2, 3)
    >>> conv.build((1, 4, 4, 1))
    >>> with batched_normalized_kernels([conv]):
    ...     tuple(conv(keras.ops.ones((1, 4, 4, 1))).shape)
    (1, 4, 4, 2)
    """
    if keras.backend.backend() != "torch" or _SHARED_KERNELS.get() is not None or not layers:
        yield
        return
    from keras import ops

    kernels = [ops.convert_to_tensor(layer.kernel) for layer in layers]
    log_gs = [ops.convert_to_tensor(layer.log_g) for layer in layers]
    if any(str(t.dtype) != "torch.float32" for t in kernels + log_gs):
        yield
        return
    normalized = normalize_kernels(kernels, log_gs)
    token = _SHARED_KERNELS.set({id(layer): kernel for layer, kernel in zip(layers, normalized)})
    try:
        yield
    finally:
        _SHARED_KERNELS.reset(token)


def normalize_kernels(kernels, log_gs):
    """`v / ||v|| * exp(log_g)` for float32 torch kernels `(k, k, C, F)` and their `log_g`, as one autograd node.

    Returns the normalised kernels, each a `(k, k, C, F)` view of
    `(F, C, k, k)` memory (torch's convolution layout, so a convolution
    takes it without a copy).

    Example:

    >>> import torch
    >>> v, log_g = torch.ones(1, 1, 4, 2), torch.zeros(2)
    >>> normalize_kernels([v], [log_g])[0][0, 0, :, 0].tolist()
    [0.5, 0.5, 0.5, 0.5]
    """
    return _grouped_weight_norm()(len(kernels), *kernels, *log_gs)


@functools.cache
def _grouped_weight_norm():
    """An autograd function: `n, v_1..v_n, log_g_1..log_g_n` -> the n normalised kernels.

    Each result `v / ||v|| * exp(log_g)` is a `(k, k, C, F)` view of
    `(F, C, k, k)` memory, torch's convolution layout. Kernels of one shape
    are stacked and computed as one tensor; with `s = exp(log_g) / ||v||`
    and `r = sum(dW * v)` per channel, `dv = s dW - v s r / ||v||^2` and
    `d log_g = s r`. A kernel the pass did not use gets no gradient.
    """
    import torch

    def groups(shapes):
        by_shape = {}
        for i, shape in enumerate(shapes):
            by_shape.setdefault(tuple(shape), []).append(i)
        return list(by_shape.values())

    class GroupedWeightNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, n, *tensors):
            kernels, log_gs = tensors[:n], tensors[n:]
            ctx.n = n
            ctx.groups = groups([k.shape for k in kernels])
            ctx.set_materialize_grads(False)
            outputs = [None] * n
            saved = []
            for members in ctx.groups:
                # (G, F, C, k, k): torch's layout, so each result is contiguous.
                v = torch.stack([kernels[i].permute(3, 2, 0, 1) for i in members])
                inverse_norm = torch.rsqrt(v.square().sum((2, 3, 4)) + 1e-12)
                scale = torch.exp(torch.stack([log_gs[i] for i in members])) * inverse_norm
                w = v * scale[:, :, None, None, None]
                for i, kernel in zip(members, w.unbind(0)):
                    outputs[i] = kernel.permute(2, 3, 1, 0)
                saved += [v, scale, inverse_norm]
            ctx.save_for_backward(*saved)
            return tuple(outputs)

        @staticmethod
        def backward(ctx, *grads):
            grad_kernels, grad_log_gs = [None] * ctx.n, [None] * ctx.n
            saved = ctx.saved_tensors
            for g, members in enumerate(ctx.groups):
                v, scale, inverse_norm = saved[3 * g : 3 * g + 3]
                used = [j for j, i in enumerate(members) if grads[i] is not None]
                if not used:
                    continue
                if len(used) < len(members):
                    v, scale, inverse_norm = v[used], scale[used], inverse_norm[used]
                members = [members[j] for j in used]
                dw = torch.stack([grads[i].permute(3, 2, 0, 1) for i in members])
                projection = (dw * v).sum((2, 3, 4))
                grad_log_g = scale * projection
                coefficient = grad_log_g * inverse_norm * inverse_norm
                dv = dw * scale[:, :, None, None, None] - v * coefficient[:, :, None, None, None]
                for j, i in enumerate(members):
                    grad_kernels[i] = dv[j].permute(2, 3, 1, 0)
                    grad_log_gs[i] = grad_log_g[j]
            return (None, *grad_kernels, *grad_log_gs)

    return GroupedWeightNorm.apply
