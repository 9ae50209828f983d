"""`keras-avae evaluate`: the importance-sampled NLL of a split, printed as one JSON object."""

import json
import os
import sys

from keras_avae.cli.arguments import _parse_sets
from keras_avae.cli.backend import _import_backend
from keras_avae.cli.checks import _check_dir
from keras_avae.cli.checks import _check_name
from keras_avae.cli.checks import _check_weights
from keras_avae.cli.checks import _load_model


def _cmd_evaluate(args):
    _check_name(args.name)
    _check_dir(args.data_dir, "--data-dir")
    _check_weights(args)
    _parse_sets(args.set)
    _import_backend(args, tensorflow=True)
    import hashlib

    import keras

    from keras_avae import datasets, evaluation, zoo
    from keras_avae.datasets.binarization import _fixed_binarize

    backend = keras.backend.backend()
    weights = zoo.pretrained_path(args.name) if args.weights == "pretrained" else args.weights
    with open(weights, "rb") as f:
        weights_sha256 = hashlib.sha256(f.read()).hexdigest()
    # What a progress file must match to be resumed: the same model, weights and images.
    run_info = {
        "name": args.name,
        "weights_sha256": weights_sha256,
        "set": sorted(args.set or []),
        "split": args.split,
        "limit": args.limit,
        "batch_size": args.batch_size,
        # Only when given: progress files written before --every existed stay resumable.
        **({"every": args.every} if args.every else {}),
        # Each backend draws its own samples. Only when not TensorFlow: the
        # files written before the backend was recorded (TensorFlow) resume.
        **({"backend": backend} if backend != "tensorflow" else {}),
    }

    if args.progress:  # before the model is built: a refusal costs nothing
        _extend_a_smaller_limit(args.progress, run_info, args.num_samples, args.seed, args.chunk_size)
    model = _load_model(args)
    data = zoo.describe(args.name)["dataset"]
    # Static binarisation with a fixed seed: the same binary images every run,
    # whatever the batch size or subset (for the train split too).
    test = datasets.make_dataset(
        data,
        args.split,
        args.data_dir,
        args.batch_size,
        shuffle=False,
        drop_remainder=False,  # every image, for the train split too
        binarize=_fixed_binarize(data),
        seed=args.seed,
        limit=args.limit,
        every=args.every,
        resize_images=args.resize_images,
    )

    def report(images, log_px, seconds):
        print(
            f"evaluate: {images} images, NLL so far {-log_px.mean():.2f} nats, {seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    scores = evaluation.score_batches(
        model,
        test,
        num_samples=args.num_samples,
        seed=args.seed,
        progress_path=args.progress,
        run_info=run_info,
        chunk_size=args.chunk_size,
        report=report if args.verbose else None,
    )
    result = {
        "name": args.name,
        "weights": args.weights,
        "split": args.split,
        "num_samples": args.num_samples,
        **evaluation.summarize(scores["log_px"], scores["elbo"], model.num_data_dims),
        "seconds": round(scores["seconds"], 1),
        "resumed_images": scores["resumed_images"],
    }
    print(json.dumps(result, allow_nan=False))


def _extend_a_smaller_limit(path, run_info, num_samples, seed, chunk_size=None):
    """Lets a run with a larger `--limit` (or none) continue the progress file of a smaller one.

    The first images of a split come in the same batches whatever the
    limit, and each batch is sampled from `(seed, batch index)`, so the
    scored batches are the ones this run would score first, provided they
    are all full (a short last batch holds other images than this run's
    batch of the same index). `score_batches` still checks every batch's
    pixel sum. The file then belongs to this run: its `limit` is rewritten.
    """
    from keras_avae import evaluation

    if not os.path.exists(path):
        return
    saved, state = evaluation._load_progress(path)
    identity = evaluation._progress_identity(run_info, num_samples, seed, chunk_size)
    old, new = saved.get("limit"), identity["limit"]
    if {**saved, "limit": new} != identity or old is None or (new is not None and new <= old):
        return  # the same run, or another one: score_batches resumes or refuses it
    images, batches = len(state["log_px"]), len(state["checksums"])
    wanted = "all images" if new is None else f"--limit {new}"
    if images != batches * identity["batch_size"]:
        raise ValueError(
            f"`--progress {path}` scored --limit {old} in batches of {identity['batch_size']} with a short last "
            f"batch ({images} images in {batches} batches), so a run with {wanted} would batch those images "
            "differently. Use another file, or delete it to start over."
        )
    evaluation._write_progress(path, identity, state)
    print(f"evaluate: {path} scored {images} images with --limit {old}; continuing with {wanted}", file=sys.stderr)
