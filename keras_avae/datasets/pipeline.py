"""The `tf.data` input pipeline: `make_dataset` and its helpers.

`make_dataset` reads a split (`load`), shards, shuffles, batches and maps
every batch into the models' input range; under a `tf.distribute` strategy
it returns the distributed dataset (see its docstring).
"""

import os

import numpy as np

from keras_avae.datasets.binarization import _check_binarize
from keras_avae.datasets.binarization import _dynamic_binarize
from keras_avae.datasets.binarization import _grey_scale
from keras_avae.datasets.binarization import _resolve_binarize
from keras_avae.datasets.binarization import _static_binarize
from keras_avae.datasets.common import _check_name
from keras_avae.datasets.common import _check_split
from keras_avae.datasets.common import _is_int
from keras_avae.datasets.common import _tf
from keras_avae.datasets.discovery import load

_IMAGE_SHAPES = {"mnist": (32, 32, 1), "omniglot": (32, 32, 1), "cifar10": (32, 32, 3)}
_PAD = 2


def image_shape(name):
    """The `(H, W, C)` of the images `make_dataset(name, ...)` yields.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.

    Returns:
        A tuple: `(32, 32, 1)` for the binary sets (28x28 padded by 2 pixels),
        `(32, 32, 3)` for CIFAR-10.

    Example:

    >>> image_shape("mnist")
    (32, 32, 1)
    """
    _check_name(name)
    return _IMAGE_SHAPES[name]


def _seeds(seed, pipeline_id):
    """Independent (shuffle, random, static) seeds derived from one user seed.

    The static binarisation takes seed 0's when `seed` is None, so a test
    split is the same binary set with and without a strategy and as with
    `seed=0` (`shipped_sample`, `keras-avae evaluate`).
    """
    static = int(np.random.SeedSequence([0 if seed is None else seed]).generate_state(1)[0])
    if seed is None:
        return None, None, static
    state = np.random.SeedSequence([seed, pipeline_id]).generate_state(2)
    return int(state[0]), int(state[1]), static


def make_dataset(
    name,
    split="train",
    data_dir=None,
    batch_size=32,
    *,
    shuffle=None,
    seed=None,
    repeat=False,
    drop_remainder=None,
    binarize="auto",
    random_flip=False,
    limit=None,
    with_labels=False,
    shuffle_buffer_size=None,
    strategy=None,
    input_context=None,
    resize_images=False,
    every=None,
    start_batch=None,
):
    """A `tf.data.Dataset` of image batches in the models' input range.

    Pipeline: read the split (`load`), optionally keep every `every`-th
    example and the first `limit` of those, shard across input pipelines
    (multi-worker), shuffle with a seed (reshuffled every epoch), batch,
    transform each batch, prefetch.
    Transforms:

    - MNIST / OMNIGLOT: the 28x28 grey levels `p` in [0, 1] are binarised,
      `x = 1[u < p]` with `u ~ U[0, 1)`, and zero-padded by 2 pixels to 32x32.
      `"dynamic"` draws `u` afresh for every batch produced (two epochs see
      different samples; with a `seed` the sequence is reproducible);
      `"static"` draws once, with `seed` (0 when `seed` is None), so the same
      split is the same binary set in every run and epoch; `None` keeps the
      grey levels. `"auto"` is dynamic for train, static for test.
    - CIFAR-10: `k / 127.5 - 1` in [-1, 1]; with `random_flip`, each image is
      mirrored left-right with probability 1/2, redrawn every batch.

    Distribution: with `strategy` (a `tf.distribute.Strategy`) the dataset
    is batched with the global `batch_size` and returned as
    `strategy.experimental_distribute_dataset(dataset)`: every global batch
    is split across the replicas (`batch_size / num_replicas_in_sync` each)
    and, with several workers, the batches are sharded across workers
    (`AutoShardPolicy.DATA`: each worker keeps its own part of every global
    batch, so all workers must shuffle alike; under a strategy `seed=None`
    therefore means `seed=0`). Keras `fit` on the TensorFlow backend takes
    the result directly and runs one step per global batch. (Not
    `distribute_datasets_from_function`: Keras 3.15 reads the step count of
    such a dataset from the per-replica batches, twice the real count on 2
    replicas, and runs an extra step every epoch.) For custom loops built on
    `strategy.distribute_datasets_from_function(fn)`, call `make_dataset`
    inside `fn` with `input_context=context`: the dataset is then sharded
    with `dataset.shard(num_input_pipelines, input_pipeline_id)`, batched
    with `input_context.get_per_replica_batch_size(batch_size)`, and its
    random seeds are derived from `(seed, input_pipeline_id)`.

    Args:
        name: `"mnist"`, `"omniglot"` or `"cifar10"`.
        split: `"train"` or `"test"`.
        data_dir: folder with the original files or with your own PNG/JPEG
            images (see `locate`), or `None` for `tensorflow_datasets`
            (downloads).
        batch_size: the **global** batch size: per-replica batch size x
            `strategy.num_replicas_in_sync` under a strategy.
        shuffle: bool; defaults to `True` for train, `False` for test.
        seed: int or `None`; seeds shuffling, dynamic binarisation, flips and
            static binarisation (`None` means 0 under a `strategy`, and
            always for the static binarisation).
        repeat: bool, repeat indefinitely (then pass `steps_per_epoch`).
        drop_remainder: bool; defaults to `True` for train, `False` for test.
        binarize: `"auto"`, `"dynamic"`, `"static"` or `None` (binary sets
            only; must be `"auto"` or `None` for CIFAR-10).
        random_flip: bool, random horizontal flips (CIFAR-10 only).
        limit: int or `None`, keep only the first `limit` examples.
        every: int or `None`, keep only every `every`-th example (the
            0th, `every`-th, ...), before `limit`: a subset spread over
            the whole split (OMNIGLOT's test split is ordered by alphabet).
            Static binarisation is drawn for the whole split first, so an
            image is the same binary image in every subset.
        with_labels: bool, yield `(images, labels)` instead of images.
        shuffle_buffer_size: defaults to the whole split.
        strategy: a `tf.distribute.Strategy`, or `None`.
        input_context: a `tf.distribute.InputContext`, or `None`.
        resize_images: bool; for a folder of images, resize those of another
            size than 28x28 (grey) or 32x32 (RGB) instead of raising (see
            `read_image_folder`); the original files ignore it.
        start_batch: `None`, or an int >= 0 with `repeat=True` and a `seed`:
            an endless stream that is a function of `seed` alone, started
            at global batch `start_batch` as if that many batches had been
            taken (pass `p` over the data is shuffled from `(seed, p)`,
            batch `b` binarised and flipped from `(seed, b)`). A resumed
            training run continues the stream where it stopped (what
            `keras-avae train` does); every new iterator starts at the same
            place. With `None`, `repeat=True` reshuffles from the
            dataset's own random state.

    Returns:
        A `tf.data.Dataset` (a distributed dataset under `strategy`) of
        float32 batches `(B, 32, 32, C)`: {0, 1} (grey levels in [0, 1] with
        `binarize=None`) for MNIST and OMNIGLOT, [-1, 1] for CIFAR-10; with
        `with_labels`, `(images, int64 labels)`.

    Example:

    >>> train = make_dataset("mnist", "train", "data/mnist", batch_size=64,
    ...     seed=1)                                              # doctest: +SKIP
    >>> model.fit(train, epochs=10)                              # doctest: +SKIP
    """
    settings = dict(
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        repeat=repeat,
        drop_remainder=drop_remainder,
        binarize=binarize,
        random_flip=random_flip,
        limit=limit,
        with_labels=with_labels,
        shuffle_buffer_size=shuffle_buffer_size,
        strategy=strategy,
        input_context=input_context,
        every=every,
        start_batch=start_batch,
    )
    # Checked before the read: a large image folder takes a while to decode.
    _check_arguments(name, split, data_dir=data_dir, resize_images=resize_images, **settings)
    images, labels = load(name, data_dir, split, resize_images=resize_images)
    return _dataset_from_arrays(name, split, images, labels, **settings)


def _dataset_from_arrays(
    name,
    split,
    images,
    labels,
    batch_size=32,
    *,
    shuffle=None,
    seed=None,
    repeat=False,
    drop_remainder=None,
    binarize="auto",
    random_flip=False,
    limit=None,
    with_labels=False,
    shuffle_buffer_size=None,
    strategy=None,
    input_context=None,
    every=None,
    start_batch=None,
):
    """`make_dataset` on a split that `load` has already read: `(images, labels)`.

    The arguments are `make_dataset`'s but `data_dir` and `resize_images`,
    which only the read takes. `keras-avae train` reads its split once (to
    count and hash the images) and builds every dataset of the run from
    those arrays: a run builds one, a resumed run two or three, and a
    folder of images would otherwise be decoded each time.
    """
    _check_arguments(
        name,
        split,
        batch_size=batch_size,
        binarize=binarize,
        random_flip=random_flip,
        limit=limit,
        seed=seed,
        shuffle_buffer_size=shuffle_buffer_size,
        strategy=strategy,
        input_context=input_context,
        every=every,
        start_batch=start_batch,
        repeat=repeat,
        shuffle=shuffle,
        drop_remainder=drop_remainder,
        with_labels=with_labels,
    )
    if strategy is not None and seed is None:
        seed = 0  # Every worker must shuffle, binarise and flip alike.
    shuffle = split == "train" if shuffle is None else bool(shuffle)
    drop_remainder = split == "train" if drop_remainder is None else bool(drop_remainder)
    binarize = _resolve_binarize(name, split, binarize)

    grey_scale = _grey_scale(name, images)
    if binarize == "static":
        # Drawn row by row over the whole split, so that a subset (`every`,
        # `limit`) holds the same binary images as the whole split.
        images = _static_binarize(images, grey_scale, _seeds(seed, 0)[2])
        grey_scale = 1.0
    images, labels = images[:: every or 1][:limit], labels[:: every or 1][:limit]
    options = dict(
        name=name,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        repeat=bool(repeat),
        drop_remainder=drop_remainder,
        dynamic=binarize == "dynamic",
        grey_scale=grey_scale,
        random_flip=bool(random_flip),
        with_labels=bool(with_labels),
        shuffle_buffer_size=shuffle_buffer_size or max(1, images.shape[0]),
        start_batch=start_batch,
    )
    tf = _tf()
    if strategy is not None:
        dataset = _pipeline(tf, images, labels, input_context=None, **options)
        dataset_options = tf.data.Options()
        dataset_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        return strategy.experimental_distribute_dataset(dataset.with_options(dataset_options))
    return _pipeline(tf, images, labels, input_context=input_context, **options)


def _check_arguments(
    name,
    split,
    *,
    batch_size,
    binarize,
    random_flip,
    limit,
    seed,
    shuffle_buffer_size,
    strategy,
    input_context,
    resize_images=False,
    every=None,
    start_batch=None,
    repeat=False,
    shuffle=None,
    drop_remainder=None,
    with_labels=False,
    data_dir=None,
):
    """Raises the `ValueError` of `make_dataset`'s first invalid argument."""
    _check_name(name)
    _check_split(split)
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise ValueError(f"`data_dir` must be a folder's path or None. Received: data_dir={data_dir!r}")
    # Strict: `bool("false")` is True, so a string would switch the option on.
    flags = dict(shuffle=shuffle, drop_remainder=drop_remainder, repeat=repeat, random_flip=random_flip)
    flags.update(with_labels=with_labels, resize_images=resize_images)
    for flag, value in flags.items():
        if not isinstance(value, (bool, np.bool_)) and not (value is None and flag in ("shuffle", "drop_remainder")):
            allowed = "a bool or None" if flag in ("shuffle", "drop_remainder") else "a bool"
            raise ValueError(f"`{flag}` must be {allowed}. Received: {flag}={value!r}")
    if not _is_int(batch_size, 1):
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    _check_binarize(name, binarize)
    if random_flip and name != "cifar10":
        raise ValueError(
            f"`random_flip` applies to CIFAR-10 only (mirrored digits and characters are other symbols). "
            f"Received: random_flip={random_flip!r} with name={name!r}"
        )
    if limit is not None and not _is_int(limit, 1):
        raise ValueError(f"`limit` must be a positive int or None. Received: limit={limit!r}")
    if every is not None and not _is_int(every, 1):
        raise ValueError(f"`every` must be a positive int or None. Received: every={every!r}")
    if seed is not None and not _is_int(seed, 0):
        raise ValueError(f"`seed` must be a non-negative int or None. Received: seed={seed!r}")
    if shuffle_buffer_size is not None and not _is_int(shuffle_buffer_size, 1):
        raise ValueError(
            "`shuffle_buffer_size` must be a positive int or None. "
            f"Received: shuffle_buffer_size={shuffle_buffer_size!r}"
        )
    if strategy is not None and input_context is not None:
        raise ValueError("Pass `strategy` or `input_context`, not both. Received: both")
    if start_batch is not None and not _is_int(start_batch, 0):
        raise ValueError(f"`start_batch` must be a non-negative int or None. Received: start_batch={start_batch!r}")
    if start_batch is not None and (not repeat or (seed is None and strategy is None)):
        raise ValueError(
            "`start_batch` addresses an endless stream made from a seed: it needs `repeat=True` and a `seed`. "
            f"Received: start_batch={start_batch}, repeat={repeat!r}, seed={seed!r}"
        )
    for replicas in (getattr(context, "num_replicas_in_sync", None) for context in (strategy, input_context)):
        if replicas and batch_size % replicas:
            raise ValueError(
                f"`batch_size` is the global batch size and must be divisible by the {replicas} replicas. "
                f"Received: batch_size={batch_size}"
            )


def _addressable_batches(tf, images, labels, batch_size, shuffle, shuffle_seed, start_batch):
    """`((images, labels), batch_index)` from global batch `start_batch` of an endless stream.

    Stateless: pass `p` over the examples is shuffled from `(shuffle_seed,
    p)`, so any batch is found without producing the ones before it (only
    the skipped part of one pass of indices is read).
    """
    count = int(images.shape[0])
    first_pass, offset = divmod(start_batch * batch_size, count)

    def order(pass_index):
        indices = tf.range(count, dtype=tf.int64)
        if shuffle:
            seed = tf.stack([tf.constant(shuffle_seed, tf.int64), pass_index])
            indices = tf.random.experimental.stateless_shuffle(indices, seed=seed)
        return indices

    indices = tf.data.Dataset.counter(first_pass).map(order).unbatch().skip(offset)
    images, labels = tf.constant(images), tf.constant(labels)
    batches = indices.batch(batch_size, drop_remainder=True).map(
        lambda i: (tf.gather(images, i), tf.gather(labels, i))
    )
    return tf.data.Dataset.zip(batches, tf.data.Dataset.counter(start_batch))


def _pipeline(
    tf,
    images,
    labels,
    *,
    name,
    batch_size,
    shuffle,
    seed,
    repeat,
    drop_remainder,
    dynamic,
    grey_scale,
    random_flip,
    with_labels,
    shuffle_buffer_size,
    input_context,
    start_batch=None,
):
    pipeline_id = 0
    if input_context is not None:
        pipeline_id = input_context.input_pipeline_id
        if input_context.num_input_pipelines > 1:
            shards = input_context.num_input_pipelines
            images, labels = images[pipeline_id::shards], labels[pipeline_id::shards]
        batch_size = input_context.get_per_replica_batch_size(batch_size)
    shuffle_seed, random_seed, _ = _seeds(seed, pipeline_id)
    if start_batch is not None:
        ds = _addressable_batches(tf, images, labels, batch_size, shuffle, shuffle_seed, start_batch)
    else:
        ds = tf.data.Dataset.from_tensor_slices((images, labels))
        if shuffle:
            ds = ds.shuffle(shuffle_buffer_size, seed=shuffle_seed, reshuffle_each_iteration=True)
        if repeat:
            ds = ds.repeat()
        ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    paddings = [[0, 0], [_PAD, _PAD], [_PAD, _PAD], [0, 0]]

    def transform(pair, pair_seed=None):
        x, y = pair
        x = tf.cast(x, tf.float32)
        if name == "cifar10":
            x = x / 127.5 - 1.0
            if random_flip:
                flip = tf.random.stateless_uniform(tf.shape(x)[:1], seed=pair_seed) < 0.5
                x = tf.where(flip[:, None, None, None], tf.reverse(x, axis=[2]), x)
        else:
            x = x / grey_scale
            if dynamic:
                x = _dynamic_binarize(tf, x, pair_seed)
            x = tf.pad(x, paddings)
        return (x, y) if with_labels else x

    if start_batch is not None:
        # Batch b's seed pair is (random_seed, b): the same wherever the stream starts.
        ds = ds.map(
            lambda pair, index: transform(pair, tf.stack([tf.constant(random_seed, tf.int64), index])),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    elif dynamic or random_flip:
        # One stateless seed pair per batch, from a stream that is redrawn on
        # every iteration (epoch) yet reproducible from `seed`.
        stream = tf.data.Dataset.random(seed=random_seed, rerandomize_each_iteration=True).batch(2)
        ds = tf.data.Dataset.zip(ds, stream).map(transform, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        ds = ds.map(lambda x, y: transform((x, y)), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)
