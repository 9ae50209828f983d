"""`keras-avae train`: trains a zoo entry into a run folder (resuming a killed run there)."""

import hashlib
import sys
import time

import numpy as np

from keras_avae.cli.arguments import _parse_sets
from keras_avae.cli.arguments import UsageError
from keras_avae.cli.backend import _import_backend
from keras_avae.cli.checks import _check_dir
from keras_avae.cli.checks import _check_name


def _cmd_train(args):
    _check_name(args.name)
    _check_dir(args.data_dir, "--data-dir")
    _import_backend(args, tensorflow=True)
    from keras_avae import training

    # The strategy first: TensorFlow must not initialise before the CPU
    # split, nor JAX before its host devices or process group are set.
    strategy = training.make_strategy(
        args.strategy,
        args.cpu_devices,
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    from keras_avae import datasets, zoo
    from keras_avae.datasets.pipeline import _dataset_from_arrays

    config_overrides, recipe_overrides = training.split_overrides(args.name, _parse_sets(args.set))
    config_overrides.setdefault("seed", args.seed)
    epochs = _epochs(args.epochs, recipe_overrides.pop("epochs", None))
    recipe = training.resolve_recipe(args.name, **recipe_overrides)
    replicas = training.num_replicas(strategy)
    global_batch = (args.batch_size or recipe["batch_size_per_replica"]) * replicas
    data = zoo.describe(args.name)["dataset"]
    # Read (an image folder: decoded) once: every dataset of the run is
    # built from these arrays, which are also the ones counted and hashed.
    images, labels = datasets.load(data, args.data_dir, "train", resize_images=args.resize_images)
    examples = len(images)
    data_info = {"dataset": data, "limit": args.limit, "seed": args.seed}
    # The training images themselves: a resume on other images (files added
    # to or changed in an image folder, another copy of a data set) is
    # refused. Runs recorded before this entry resume unchecked.
    data_info["train_images_sha256"] = _images_sha256(images[: args.limit])
    random_flip = "horizontal_flip" in (recipe.get("augmentation") or [])
    if random_flip:
        # Recorded only when on, so that the runs before flips existed
        # resume; a CIFAR-10 run recorded without them is refused.
        data_info["random_flip"] = True
    if datasets.locate(data, args.data_dir, "train")[0] is datasets.read_image_folder:
        data_info.update(source="image_folder", resize_images=args.resize_images)
    batches = min(examples, args.limit or examples) // global_batch  # full batches only
    steps = args.steps_per_epoch or recipe.get("steps_per_epoch") or max(1, batches)
    _check_enough_data(args.limit, examples, global_batch, steps)

    def train_data(start_batch):
        # One endless stream over the epochs, made from --seed: a resumed
        # run continues it at the batch where it stopped.
        return _dataset_from_arrays(
            data,
            "train",
            images,
            labels,
            global_batch,
            seed=args.seed,
            limit=args.limit,
            # tf.distribute shards the pipeline itself; on JAX, Keras splits
            # each global batch over the devices and processes.
            strategy=strategy if training.BACKEND == "tensorflow" else None,
            repeat=True,
            start_batch=start_batch,
            random_flip=random_flip,
        )

    backup = training.AtomicBackupAndRestore(f"{args.output}/backup")
    before = backup.read_state()
    start = time.time()
    training.train(
        args.name,
        train_data,
        args.output,
        epochs=epochs,
        steps_per_epoch=steps,
        strategy=strategy,
        batch_size=global_batch,
        config_overrides=config_overrides,
        save_freq=args.save_freq,
        verbose=args.verbose,
        data_info=data_info,
        seed=args.seed,
        deterministic=args.deterministic,
        **recipe_overrides,
    )
    after = backup.read_state()
    if before is not None and after["iterations"] == before["iterations"]:
        print(f"Nothing to train: {args.output} holds a finished run; final model in {args.output}", file=sys.stderr)
    else:
        print(f"Trained {args.name} in {time.time() - start:.0f} s; final model in {args.output}", file=sys.stderr)


def _images_sha256(images):
    """A sha256 of the images' shape, dtype and values (C order)."""
    digest = hashlib.sha256(f"{images.shape}{images.dtype}".encode())
    digest.update(np.ascontiguousarray(images).data)
    return digest.hexdigest()


def _epochs(flag, setting):
    """`--epochs`, or `--set epochs=N` (the same recipe value); both must agree."""
    if flag is not None and setting is not None and flag != setting:
        raise UsageError(f"--epochs {flag} and --set epochs={setting} disagree; give one of them")
    return flag if flag is not None else setting


def _check_enough_data(limit, examples, batch_size, steps_per_epoch):
    """Refuses, before training, data that cannot fill one batch or one epoch."""
    used = min(examples, limit or examples)
    batches = used // batch_size
    source = f"limit={limit} keeps {used}" if limit else f"the split has {used}"
    # Without --limit the split itself is too small (a small folder of images):
    # more data or smaller batches help, not a larger --limit.
    remedy = "a larger --limit" if limit else "more images or a smaller --batch-size"
    if batches == 0:
        raise ValueError(
            f"{'`limit` too small' if limit else 'Too few training images'}: {source} training images, fewer "
            f"than one batch of {batch_size}. Use {remedy}. Received: limit={limit}, batch_size={batch_size} (global)"
        )
    if batches < steps_per_epoch:
        raise ValueError(
            f"`steps_per_epoch`={steps_per_epoch} needs {steps_per_epoch * batch_size} images per epoch "
            f"({steps_per_epoch} batches of {batch_size}) but {source}: {batches} batches. Use a smaller "
            f"--steps-per-epoch or {remedy}. Received: steps_per_epoch={steps_per_epoch}, limit={limit}"
        )
