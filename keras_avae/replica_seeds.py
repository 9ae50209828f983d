"""A `SeedGenerator` whose draws differ between `tf.distribute` replicas.

Keras's `SeedGenerator` keeps its state in a variable that
`tf.distribute` mirrors: every replica of a `MirroredStrategy` (or of a
multi-worker one) reads the same state and draws the same numbers, so with
R replicas a global batch gets only B / R independent latent draws, each
repeated R times over different images. `ReplicaSeedGenerator` offsets
each draw's seed by the replica's index in the sync group. Replica 0, one
device, JAX and PyTorch draw exactly what `SeedGenerator` draws; the
state advances as it does there (checkpoints and resumes are unchanged).

It is for per-example noise (latent samples, Gumbel noise). Draws that
must agree between replicas, such as FAVOR+ feature redraws (one model,
one set of features), keep a plain `SeedGenerator`.
"""

import keras

# Replica r draws with seed `(s, c + r * _REPLICA_STRIDE)`: a generator's
# counter `c` advances by 1 a draw, so replicas' streams never meet.
_REPLICA_STRIDE = 2**40


class ReplicaSeedGenerator(keras.random.SeedGenerator):
    """`keras.random.SeedGenerator` with a different stream per `tf.distribute` replica.

    Args:
        seed: int or `None`, as for `SeedGenerator`.
        name: the generator's name (default `"seed_generator"`, the name a
            plain `SeedGenerator` gets, so variable paths are the same).

    Example:

    >>> generator = ReplicaSeedGenerator(3)
    >>> plain = keras.random.SeedGenerator(3)
    >>> bool(keras.ops.all(keras.random.normal((4,), seed=generator) == keras.random.normal((4,), seed=plain)))
    True
    """

    def __init__(self, seed=None, name="seed_generator", **kwargs):
        super().__init__(seed, name=name, **kwargs)

    def next(self, ordered=True):
        seed = super().next(ordered)
        replica = _tf_replica_id()
        if replica is None:
            return seed
        ops = self.backend.numpy
        offset = ops.multiply(self.backend.cast(replica, seed.dtype), _REPLICA_STRIDE)
        return ops.add(seed, ops.stack([ops.zeros_like(offset), offset]))


def _tf_replica_id():
    """This replica's index in a multi-replica `tf.distribute` step, else `None`."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context.replica_id_in_sync_group
