"""A run's settings, resolved from `train`'s arguments before any model exists.

The recipe with its overrides, the number of epochs, steps per epoch
(inferred from finite data, and checked against it), the global batch, the
replicas and whether this process is the chief; and the first images of the
data, for the sample grids.
"""

import dataclasses
import math
import pathlib

import keras
import numpy as np

from keras_avae.training.distribute import is_chief
from keras_avae.training.distribute import num_replicas
from keras_avae.training.jax_distribution import _is_data_parallel
from keras_avae.training.recipes import _positive_int
from keras_avae.training.recipes import resolve_recipe


def _first_images(data, n):
    """Up to `n` images from a dataset, an array, or an `(x, ...)` tuple."""
    if data is None:
        return None
    if isinstance(data, (tuple, list)):
        data = data[0]
    if isinstance(data, np.ndarray) or hasattr(data, "__array__") and not hasattr(data, "take"):
        return np.asarray(data[:n])
    if hasattr(data, "take") or hasattr(data, "element_spec"):  # a tf.data.Dataset or a distributed one
        batch = next(iter(data.take(1) if hasattr(data, "take") else data))
        if isinstance(batch, (tuple, list)):
            batch = batch[0]
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        # A distributed dataset's batch holds one part per replica (`PerReplica.values`).
        parts = getattr(batch, "values", None)
        if isinstance(parts, tuple):
            batch = np.concatenate([np.asarray(part) for part in parts])
        return np.asarray(batch)[:n]
    return None


def _dataset_batch_size(dataset):
    """The fixed batch size of a `tf.data.Dataset`, or `None` (not a dataset, or batches of varying size)."""
    if not (hasattr(dataset, "element_spec") and callable(getattr(dataset, "cardinality", None))):
        return None
    shape = keras.tree.flatten(dataset.element_spec)[0].shape
    return shape[0] if shape.rank else None


def _cardinality(dataset):
    """Batches in a dataset (-1: infinite, -2: unknown), or `None` for an input without a length.

    A `tf.data.Dataset` has a `cardinality()` method; the distributed
    dataset a `tf.distribute` strategy makes has a `cardinality` value.
    """
    cardinality = getattr(dataset, "cardinality", None)
    if cardinality is None:
        return None
    return int(cardinality() if callable(cardinality) else cardinality)


def _infer_steps_per_epoch(dataset, steps_per_epoch, batch_size):
    if steps_per_epoch is not None:
        steps_per_epoch = _positive_int("steps_per_epoch", steps_per_epoch)
        _check_enough_batches(dataset, steps_per_epoch, batch_size)
        return steps_per_epoch
    if isinstance(dataset, np.ndarray):
        return max(1, math.ceil(len(dataset) / batch_size))
    cardinality = _cardinality(dataset)
    if cardinality is not None and cardinality > 0:
        return cardinality
    raise ValueError(
        "`steps_per_epoch` is needed for a dataset of unknown or infinite length "
        "(the learning-rate schedule and checkpoints count steps). Received: steps_per_epoch=None"
    )


def _check_enough_batches(dataset, steps_per_epoch, batch_size):
    """Refuses an epoch longer than the data (`fit` would cut it short with a warning only)."""
    cardinality = _cardinality(dataset)
    if isinstance(dataset, np.ndarray):
        batches, what = math.ceil(len(dataset) / batch_size), f"{len(dataset)} images in batches of {batch_size}"
    elif cardinality is not None and cardinality >= 0:
        batches, what = cardinality, "the dataset"
    else:
        return  # infinite (repeated) or unknown length
    if batches < steps_per_epoch:
        raise ValueError(
            f"`steps_per_epoch` asks for {steps_per_epoch} batches per epoch but {what} make {batches}. "
            f"Use fewer steps or more data (or `dataset.repeat()`). Received: steps_per_epoch={steps_per_epoch}"
        )


@dataclasses.dataclass(frozen=True)
class _Run:
    """What `train` resolved from its arguments, before it builds the model."""

    output_dir: pathlib.Path
    name: str | None
    recipe: dict
    epochs: int
    steps_per_epoch: int
    batch_size: int
    replicas: int
    chief: bool
    data: dict | None = None
    batch_from_dataset: bool = False  # the global batch is the dataset's own (recorded as such)
    reproducibility: dict | None = None  # `train`'s seed and whether it asked for deterministic kernels
    new_folders: tuple = ()  # the folders `train` made for `output_dir`, removed again if it fails at once


def _resolve_run(
    model,
    dataset,
    output_dir,
    epochs,
    steps_per_epoch,
    strategy,
    batch_size,
    recipe_overrides,
    data_info=None,
    validation_data=None,
    reproducibility=None,
):
    """The run's recipe, length and global batch; makes the run folder (chief only)."""
    output_dir = pathlib.Path(output_dir)
    name = model if isinstance(model, str) else None
    recipe = resolve_recipe(name, **recipe_overrides)
    epochs = _positive_int("epochs", recipe["epochs"] if epochs is None else epochs)
    replicas = num_replicas(strategy)
    chief = is_chief(strategy)
    batched = _dataset_batch_size(dataset)
    from_dataset = batch_size is None and batched is not None
    if batch_size is None:
        # A dataset's own batch is the run's global batch (recorded, and compared on resume).
        batch_size = batched or recipe["batch_size_per_replica"] * replicas
    batch_size = _positive_int("batch_size", batch_size)
    if batched is not None and batched != batch_size:
        raise ValueError(
            f"The dataset yields batches of {batched} images, so the global batch is {batched}. Pass "
            f"batch_size={batched} (or None), or batch the dataset by {batch_size}. Received: batch_size={batch_size}"
        )
    steps_per_epoch = _infer_steps_per_epoch(dataset, steps_per_epoch, batch_size)
    if replicas > 1 or _is_data_parallel(strategy):
        _check_replica_input(dataset, batch_size, replicas, strategy)
        if validation_data is not None:
            # Else a last validation batch that cannot split fails in `fit` after a whole epoch.
            # (A dataset of batches of unknown size, such as `make_dataset`'s test split, passes.)
            _check_replica_input(validation_data, batch_size, replicas, strategy, "validation_data", False)
    if recipe["global_clipnorm"] is not None and replicas > 1 and keras.backend.backend() == "tensorflow":
        raise ValueError(
            "`global_clipnorm` under a multi-replica tf.distribute strategy would clip each replica's part of "
            "the gradient before they are summed (a threshold up to the replica count larger, and another "
            "step than on one device). Train on one device, or on JAX's keras.distribution, which clips the "
            f"global gradient. Received: global_clipnorm={recipe['global_clipnorm']}, {replicas} replicas"
        )
    if data_info is not None and not isinstance(data_info, dict):
        raise ValueError(f"`data_info` must be a dict or None. Received: data_info={data_info!r}")
    new_folders = ()
    if chief:
        new_folders = _missing_folders(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
    return _Run(
        output_dir,
        name,
        recipe,
        epochs,
        steps_per_epoch,
        batch_size,
        replicas,
        chief,
        data=data_info,
        batch_from_dataset=from_dataset,
        reproducibility=reproducibility,
        new_folders=new_folders,
    )


def _missing_folders(path):
    """`path` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return tuple(missing)


def _check_replica_input(dataset, batch_size, replicas, strategy, argument="dataset", unknown_size_fails=True):
    """Refuses input whose batches do not split evenly over the replicas.

    `tf.distribute` takes each replica's mean loss over its share and weighs
    the replicas equally, so a batch split 3 + 2 weighs images unequally
    without an error; JAX's `DataParallel` cannot split it at all.
    """
    if isinstance(dataset, (tuple, list)) and dataset:
        dataset = dataset[0]  # `validation_data=(x,)` or `(x, y)`
    if _is_data_parallel(strategy) and strategy.num_processes > 1 and not hasattr(dataset, "element_spec"):
        raise ValueError(
            "Several processes need a tf.data.Dataset of global batches (each process reads its share; "
            f"`datasets.make_dataset` makes one). Received: {argument} of type "
            f"{type(dataset).__name__}"
        )
    if batch_size % replicas:
        raise ValueError(
            f"The global batch must split evenly over the {replicas} devices. Received: batch_size={batch_size}"
        )
    if isinstance(dataset, np.ndarray) and len(dataset) % batch_size % replicas:
        raise ValueError(
            f"The last batch of {len(dataset) % batch_size} images cannot be split over the {replicas} devices; "
            f"use a number of images that is a multiple of {replicas}. Received: {argument} of {len(dataset)} "
            f"images, batch_size={batch_size}"
        )
    if hasattr(dataset, "element_spec") and callable(getattr(dataset, "cardinality", None)):
        # A tf.data.Dataset (a distributed one is split already): its batch
        # size must be fixed, or a short last batch may not split.
        size = _dataset_batch_size(dataset)
        if (size is None and unknown_size_fails) or (size is not None and size % replicas):
            raise ValueError(
                f"Every batch of `{argument}` must split evenly over the {replicas} devices: batch it into a "
                f"multiple of {replicas} images with `drop_remainder=True` (or use `datasets.make_dataset`). "
                f"Received: {argument} batches of {'unknown size' if size is None else f'{size} images'}"
            )
