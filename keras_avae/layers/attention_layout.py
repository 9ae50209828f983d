"""How `PerformerAttention` maps `MultiHeadAttention`'s axes and masks onto FAVOR+.

FAVOR+ (`keras_avae.ops.favor_attention`) attends over one sequence axis with
a key padding mask and an optional causal mask. `SequenceLayout` moves the
attention axes of `MultiHeadAttention`'s projected tensors into that one
axis (the other axes join the batch), reads an `attention_mask` in
`MultiHeadAttention`'s layout as a key padding mask or refuses it, and
moves masks the same way; `fill_rows_without_keys` gives fully masked rows
`MultiHeadAttention`'s output.
"""

from keras import ops


class SequenceLayout:
    """Moves the attention axes of projected tensors into one sequence axis.

    A projected tensor `(B, d_1, ..., d_k, N, H)` is transposed to
    `(B, free..., attention..., N, H)` (the free axes are the `d_i` that are
    not attention axes) and reshaped to `(B * prod(free), prod(attention),
    N, H)`; `from_sequences` undoes it. Causal masking follows the
    row-major order of the attention axes. Masks `(B, d_1, ..., d_k)` move
    the same way.

    Example (images `(B, H, W)` projected to 2 heads of size 8):

    >>> layout = SequenceLayout(5, attention_axes=(1, 2))
    >>> x = np.zeros((2, 3, 4, 2, 8), "float32")
    >>> tuple(layout.to_sequences(x).shape)
    (2, 12, 2, 8)
    """

    def __init__(self, rank, attention_axes):
        self.rank = rank  # of the projected tensors
        self.attention = tuple(attention_axes)
        self.free = tuple(axis for axis in range(1, rank - 2) if axis not in self.attention)
        self.order = (0, *self.free, *self.attention)
        self.num_attention_axes = len(self.attention)
        self.num_batch_axes = 1 + len(self.free)
        # (B, T, N, H) with T the attention axis: nothing to move.
        self.identity = not self.free and len(self.attention) == 1

    def to_sequences(self, x):
        if self.identity:
            return x
        shape = ops.shape(x)
        x = ops.transpose(x, self.order + (self.rank - 2, self.rank - 1))
        return ops.reshape(x, (-1, _product(shape[a] for a in self.attention), shape[-2], shape[-1]))

    def from_sequences(self, x, query_shape):
        """`(B', T, N, H)` back to the query's layout `(B, d_1, ..., d_k, N, H)`."""
        if self.identity:
            return x
        x = ops.reshape(x, tuple(query_shape[a] for a in self.order) + tuple(ops.shape(x)[-2:]))
        inverse = [self.order.index(a) for a in range(self.rank - 2)]
        return ops.transpose(x, inverse + [self.rank - 2, self.rank - 1])

    def key_padding(self, attention_mask, key_shape=None):
        """`attention_mask` as a `(B', S)` key padding mask (see `to_sequences`), or a `ValueError`.

        `MultiHeadAttention` reads a mask of rank `r` as `(..., T..., S...)`:
        its last `2 * A` axes are the query's and the key's attention axes,
        and its leading axes broadcast against `(batch axes..., num_heads)`
        from the left. FAVOR+ can apply it only when it does not depend on
        the query position (every query axis of size 1) nor on the head.
        Without `key_shape` (the projected key's shape) it only checks.
        """
        if attention_mask is None:
            return None
        shape = tuple(attention_mask.shape)
        num_axes = self.num_attention_axes
        lead = len(shape) - 2 * num_axes
        query_axes = shape[max(lead, 0) : max(lead, 0) + num_axes]
        if lead < 0 or lead > self.num_batch_axes + 1 or any(size != 1 for size in query_axes):
            raise ValueError(
                "PerformerAttention cannot apply an `attention_mask` that depends on the query position in "
                "linear time. `attention_mask` has MultiHeadAttention's layout (..., T..., S...); pass a key "
                f"padding mask with size-1 query axes, e.g. (B, 1, S) for (B, T, dim) inputs, `value_mask`, or "
                f"Keras masks, and/or `use_causal_mask=True`. Received: attention_mask.shape={shape}"
            )
        if lead == self.num_batch_axes + 1 and shape[lead - 1] != 1:
            raise ValueError(
                "PerformerAttention applies one key padding mask to all heads; the `attention_mask` axis "
                f"of the heads must have size 1. Received: attention_mask.shape={shape}"
            )
        if key_shape is None:
            return None
        mask = ops.cast(attention_mask, "bool")
        # Squeezed, not reshaped: the batch and key sizes may be unknown.
        mask = ops.squeeze(mask, axis=tuple(range(lead, lead + num_axes)))  # drop the query axes
        if lead == self.num_batch_axes + 1:
            mask = ops.squeeze(mask, axis=lead - 1)
            lead -= 1
        for _ in range(self.num_batch_axes - lead):
            mask = ops.expand_dims(mask, lead)
        # Now in `(B, free..., attention...)` order, as `to_sequences` moves
        # the key: broadcast to its positions and flatten the same way.
        mask = ops.broadcast_to(mask, tuple(key_shape[a] for a in self.order))
        return ops.reshape(mask, (-1, _product(key_shape[a] for a in self.attention)))

    def mask_to_sequences(self, mask):
        """A `(B, d_1, ..., d_k)` mask to `(B', L)`."""
        if len(mask.shape) != self.rank - 2:
            raise ValueError(
                f"A mask of the positions must have rank {self.rank - 2} (the input's without its last "
                f"axis). Received: mask.shape={tuple(mask.shape)}"
            )
        if self.identity:
            return mask
        shape = ops.shape(mask)
        mask = ops.transpose(mask, self.order)
        return ops.reshape(mask, (-1, _product(shape[a] for a in self.attention)))


def fill_rows_without_keys(output, value, query_mask, key_mask, causal, uniform):
    """`MultiHeadAttention`'s output for a query row that masks every key.

    A masked query, or one left without a valid key by the key and causal
    masks, gets `MultiHeadAttention`'s softmax of an all-masked row: uniform
    weights over all keys (the mean of the values) on its fused path (no
    dropout, projections of rank 4), zeros on its explicit softmax path
    (attention dropout, or several attention axes: `uniform=False`).
    FAVOR+ itself gives zeros.

    Example (causal; the first query's only key is padding):

    >>> output = np.ones((1, 2, 1, 1), "float32")
    >>> value = np.array([1.0, 5.0], "float32").reshape(1, 2, 1, 1)
    >>> key_mask = np.array([[False, True]])
    >>> filled = fill_rows_without_keys(output, value, None, key_mask, causal=True, uniform=True)
    >>> np.asarray(ops.convert_to_numpy(filled)).ravel().tolist()
    [3.0, 1.0]
    """
    if query_mask is None and key_mask is None:
        return output  # every query sees at least one key (itself, if causal)
    if key_mask is None:
        has_key = query_mask
    else:
        if causal:
            has_key = ops.cumsum(ops.cast(key_mask, "int32"), axis=1) > 0
        else:
            has_key = ops.any(key_mask, axis=1, keepdims=True)
        if query_mask is not None:
            has_key = ops.logical_and(has_key, query_mask)
    if uniform:
        fill = ops.cast(ops.mean(ops.cast(value, "float32"), axis=1, keepdims=True), output.dtype)
    else:
        fill = ops.zeros_like(output)
    return ops.where(has_key[:, :, None, None], output, fill)


def _product(sizes):
    total = 1
    for size in sizes:
        total = total * size
    return total
