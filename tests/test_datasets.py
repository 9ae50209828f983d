"""Tests of keras_avae.datasets on tiny files written in each original format.

Every test but one writes its own IDX, MATLAB, pickle, tar.gz and .npz
files into `tmp_path`; the one compares the shipped samples with the real
test splits in ../shared/data (skipped without them).
"""

import gzip
import io
import json
import os
import pathlib
import pickle
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest
import scipy.io

from keras_avae import datasets
from tests.test_case import free_ports

# ---------------------------------------------------------------------------
# Writers of the original formats
# ---------------------------------------------------------------------------


def write_idx(path, array, magic, compress=True):
    array = np.asarray(array)
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return raw


def make_mnist_dir(root, n_train=20, n_test=10, compress=True, seed=0):
    """Distinct images: image i holds i at pixel (0, 0), random elsewhere."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    suffix = ".gz" if compress else ""
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        images[:, 0, 0] = np.arange(n)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images, 2051, compress)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels, 2049, compress)
        arrays[split] = (images, labels)
    return arrays


class _Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 `str` (BINSTRING), as the original batches do."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_py2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + len(obj).to_bytes(4, "little") + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def write_cifar_batch(path, images, labels, python2=True):
    """A pickled batch as CIFAR-10 ships it: R, G, B planes of 32x32 per row.

    `python2=True` mimics the original files (Python 2 protocol-2 pickles with
    `str` keys, `numpy.core.multiarray` globals); `False` is what Python 3
    writes with protocol 2 (`str` keys, `_codecs.encode` for bytes).
    """
    data = images.transpose(0, 3, 1, 2).reshape(len(images), 3072)
    key = (lambda k: k.encode()) if python2 else (lambda k: k)
    batch = {
        key("batch_label"): b"training batch",
        key("labels"): [int(v) for v in labels],
        key("data"): data,
        key("filenames"): [b"x.png"] * len(images),
    }
    if python2:
        buffer = io.BytesIO()
        _Python2Pickler(buffer, protocol=2).dump(batch)
        raw = buffer.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"cnumpy.core.multiarray\n_reconstruct" in raw and b"_codecs" not in raw
    else:
        raw = pickle.dumps(batch, protocol=2)
    path.write_bytes(raw)


def make_cifar_folder(root, n=3, seed=0):
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    arrays = {}
    for i, name in enumerate([f"data_batch_{b}" for b in range(1, 6)] + ["test_batch"]):
        images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, 10, n)
        write_cifar_batch(folder / name, images, labels, python2=i % 2 == 0)
        arrays[name] = (images, labels)
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"airplane"]}, protocol=2))
    train = tuple(np.concatenate([arrays[f"data_batch_{b}"][k] for b in range(1, 6)]) for k in (0, 1))
    return folder, {"train": train, "test": arrays["test_batch"]}


# ---------------------------------------------------------------------------
# MNIST
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_mnist_round_trip_is_pixel_exact(tmp_path, compress):
    arrays = make_mnist_dir(tmp_path, compress=compress)
    for split in ("train", "test"):
        images, labels = datasets.load("mnist", tmp_path, split)
        assert images.dtype == np.uint8 and labels.dtype == np.int64
        assert images.shape == arrays[split][0].shape + (1,)
        np.testing.assert_array_equal(images[..., 0], arrays[split][0])
        np.testing.assert_array_equal(labels, arrays[split][1])


def test_mnist_found_in_named_subfolder(tmp_path):
    arrays = make_mnist_dir(tmp_path / "mnist")
    images, _ = datasets.load("mnist", tmp_path, "test")
    np.testing.assert_array_equal(images[..., 0], arrays["test"][0])


def test_truncated_idx_raises_naming_the_file(tmp_path):
    make_mnist_dir(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))  # Valid gzip, short payload.
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz.*truncated"):
        datasets.load("mnist", tmp_path, "train")
    path.write_bytes(gzip.compress(raw)[:5000])  # Cut gzip stream.
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz.*gzip stream is truncated"):
        datasets.load("mnist", tmp_path, "train")
    path.write_bytes(gzip.compress(raw + b"\0"))
    with pytest.raises(ValueError, match="trailing bytes"):
        datasets.load("mnist", tmp_path, "train")


def test_idx_bad_magic_and_count_mismatch(tmp_path):
    arrays = make_mnist_dir(tmp_path)
    # Labels file where the images file should be: magic 2049, not 2051.
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", arrays["test"][1], 2049)
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: bad IDX magic number 2049.*expected 2051"):
        datasets.load("mnist", tmp_path, "test")
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", arrays["test"][0], 2051)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", arrays["test"][1][:-1], 2049)
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: expected 10 labels"):
        datasets.load("mnist", tmp_path, "test")


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not a directory.*train-images-idx3-ubyte\.gz"):
        datasets.load("mnist", tmp_path / "nowhere", "train")
    with pytest.raises(FileNotFoundError, match=r"No omniglot files.*chardata\.mat, omniglot_105\.npz"):
        datasets.load("omniglot", tmp_path, "train")
    expected = r"cifar-10-batches-py/, cifar-10-python\.tar\.gz, cifar10_partial\.npz"
    with pytest.raises(FileNotFoundError, match=expected):
        datasets.make_dataset("cifar10", "train", tmp_path)
    make_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte\[\.gz\] not found"):
        datasets.load("mnist", tmp_path, "test")


# ---------------------------------------------------------------------------
# OMNIGLOT
# ---------------------------------------------------------------------------


def test_chardata_images_come_out_upright(tmp_path):
    rng = np.random.default_rng(1)
    n_train, n_test = 5, 3
    images = rng.random((n_train + n_test, 28, 28)).astype(np.float32) * 0.5
    images[:, 3, 20] = 1.0  # Asymmetric: top row band, right half.
    images[:, 25, 1] = 0.75  # Bottom left.
    # MATLAB stores image(:) per column: column-major.
    columns = np.stack([im.ravel(order="F") for im in images], axis=1)
    target = np.eye(50)[:, rng.integers(0, 50, n_train + n_test)]
    scipy.io.savemat(
        tmp_path / "chardata.mat",
        {
            "data": columns[:, :n_train].astype(np.float64),
            "testdata": columns[:, n_train:].astype(np.float64),
            "target": target[:, :n_train],
            "testtarget": target[:, n_train:],
        },
    )
    train, train_labels = datasets.load("omniglot", tmp_path, "train")
    test, test_labels = datasets.load("omniglot", tmp_path, "test")
    assert train.shape == (n_train, 28, 28, 1) and train.dtype == np.float32
    np.testing.assert_array_equal(train[..., 0], images[:n_train])
    np.testing.assert_array_equal(test[..., 0], images[n_train:])
    assert np.all(train[:, 3, 20, 0] == 1.0) and np.all(train[:, 25, 1, 0] == 0.75)
    # The IWAE release's own loader gives the same images.
    raw = columns[:, :n_train].T
    iwae = raw.reshape((-1, 28, 28)).reshape((-1, 784), order="F").reshape(-1, 28, 28)
    np.testing.assert_array_equal(train[..., 0], iwae)
    np.testing.assert_array_equal(train_labels, target[:, :n_train].argmax(0))
    np.testing.assert_array_equal(test_labels, target[:, n_train:].argmax(0))


def test_chardata_bad_shape_and_values(tmp_path):
    scipy.io.savemat(tmp_path / "chardata.mat", {"data": np.zeros((100, 4)), "testdata": np.full((784, 2), 3.0)})
    with pytest.raises(ValueError, match=r"chardata\.mat: 'data' must have shape \(784, N\)"):
        datasets.load("omniglot", tmp_path, "train")
    with pytest.raises(ValueError, match=r"'testdata' must hold values in \[0, 1\]"):
        datasets.load("omniglot", tmp_path, "test")
    # Before: NaN passed the range check (NaN < 0 and NaN > 1 are both False).
    with_nan = np.zeros((784, 2))
    with_nan[5, 1] = np.nan
    scipy.io.savemat(tmp_path / "chardata.mat", {"data": with_nan, "testdata": np.zeros((784, 1))})
    with pytest.raises(ValueError, match=r"chardata\.mat: 'data' holds 1 NaN or infinite values"):
        datasets.load("omniglot", tmp_path, "train")
    (tmp_path / "chardata.mat").write_bytes(b"MATLAB 5.0 garbage")
    with pytest.raises(ValueError, match=r"chardata\.mat: not a readable MATLAB file"):
        datasets.load("omniglot", tmp_path, "train")


def write_omniglot_105(path, seed=2):
    rng = np.random.default_rng(seed)
    arrays = {}
    for key, n, alphabets in (("background", 6, ["Latin", "Greek"]), ("evaluation", 4, ["Angelic", "ULOG"])):
        images = (rng.random((n, 105, 105)) < 0.1).astype(np.uint8)
        arrays[key] = images
        arrays[f"{key}_alphabet"] = np.array([alphabets[i % 2] for i in range(n)])
        arrays[f"{key}_drawer"] = np.arange(1, n + 1, dtype=np.uint8)
    np.savez_compressed(path, **arrays)
    return arrays


def test_omniglot_105_downsampled_by_area(tmp_path):
    import tensorflow as tf

    arrays = write_omniglot_105(tmp_path / "omniglot_105.npz")
    for split, key in (("train", "background"), ("test", "evaluation")):
        images, labels = datasets.load("omniglot", tmp_path, split)
        assert images.shape == (len(arrays[key]), 28, 28, 1) and images.dtype == np.float32
        reference = tf.image.resize(arrays[key][..., None].astype(np.float32), (28, 28), method="area").numpy()
        np.testing.assert_allclose(images, reference, atol=1e-6)
        np.testing.assert_allclose(images.mean(), arrays[key].mean(), rtol=1e-5)  # Area is conserved.
        assert images.min() >= 0 and images.max() <= 1
    _, labels = datasets.load("omniglot", tmp_path, "train")
    vocabulary = ["Angelic", "Greek", "Latin", "ULOG"]
    assert [vocabulary[i] for i in labels] == list(arrays["background_alphabet"])


def test_area_downsample_orientation_and_blocks():
    x = np.zeros((1, 105, 105), np.uint8)
    x[0, :15, 90:] = 1  # Top-right corner: output rows 0-3, columns 24-27.
    out = datasets.area_downsample(x, 28)[0]
    np.testing.assert_allclose(out[:4, 24:], 1.0)
    assert out[:4, :24].sum() == 0 and out[4:].sum() == 0
    y = np.arange(36, dtype=np.float32).reshape(1, 6, 6)
    np.testing.assert_allclose(datasets.area_downsample(y, 3)[0], y[0].reshape(3, 2, 3, 2).mean(axis=(1, 3)))
    with pytest.raises(ValueError, match="Received: size=30"):
        datasets.area_downsample(y, 30)


@pytest.mark.parametrize("side, size", [(105, 28), (105, 32), (64, 28), (7, 7)])
def test_area_downsample_is_exact_for_integer_images(side, size):
    # Reference: exact integer sums of covered areas (in units of 1 / size),
    # one division. A float32 product in BLAS order gave 6 / 225 as two
    # values 1 ulp apart on OMNIGLOT, so a binarised pixel could depend on the CPU.
    rng = np.random.default_rng(side + size)
    x = rng.integers(0, 2, size=(3, side, side)).astype(np.uint8)
    x[0] = 1
    overlap = np.zeros((size, side), np.int64)
    for i in range(size):
        for p in range(side):
            overlap[i, p] = max(0, min((i + 1) * side, (p + 1) * size) - max(i * side, p * size))
    sums = np.einsum("ip,npq,jq->nij", overlap, x.astype(np.int64), overlap)
    expected = (sums / float(side * side)).astype(np.float32)
    out = datasets.area_downsample(x, size)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(out[0], 1.0)
    # The shipped OMNIGLOT sample holds these exact levels, k / 225.
    if (side, size) == (105, 28):
        grey = datasets.shipped_sample("omniglot", 100, binarize=None)
        levels = np.round(grey.astype(np.float64) * 225)
        np.testing.assert_array_equal(grey, (levels / 225).astype(np.float32))


def test_omniglot_105_values_out_of_range_are_refused(tmp_path):
    # Before: one NaN pixel spread through the area average to all 784 pixels of its image.
    cases = (
        (np.nan, r"'background' holds 1 NaN or infinite values"),
        (-1.0, r"'background' must hold 0/1 values.*Received: values in \[-1\.0, "),
    )
    for value, message in cases:
        images = np.zeros((2, 105, 105), np.float32)
        images[1, 50, 50] = value
        np.savez(tmp_path / "omniglot_105.npz", background=images, evaluation=images)
        with pytest.raises(ValueError, match=rf"omniglot_105\.npz: {message}"):
            datasets.load("omniglot", tmp_path, "train")


def test_chardata_preferred_over_omniglot_105(tmp_path):
    write_omniglot_105(tmp_path / "omniglot_105.npz")
    scipy.io.savemat(tmp_path / "chardata.mat", {"data": np.zeros((784, 2)), "testdata": np.zeros((784, 1))})
    reader, path = datasets.locate("omniglot", tmp_path, "train")
    assert reader is datasets.read_omniglot_chardata and path.name == "chardata.mat"


# ---------------------------------------------------------------------------
# CIFAR-10
# ---------------------------------------------------------------------------


def test_cifar_folder_and_tar_round_trip(tmp_path):
    folder, expected = make_cifar_folder(tmp_path / "extracted")
    tar_dir = tmp_path / "archive"
    tar_dir.mkdir()
    with tarfile.open(tar_dir / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    for data_dir in (tmp_path / "extracted", folder, tar_dir):
        for split in ("train", "test"):
            images, labels = datasets.load("cifar10", data_dir, split)
            assert images.dtype == np.uint8 and images.shape == expected[split][0].shape
            np.testing.assert_array_equal(images, expected[split][0])
            np.testing.assert_array_equal(labels, expected[split][1])


def test_cifar_partial_npz_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {
        "train_images": rng.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, 7).astype(np.uint8),
        "test_images": rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, 4).astype(np.uint8),
    }
    np.savez_compressed(tmp_path / "cifar10_partial.npz", **arrays)
    for split in ("train", "test"):
        images, labels = datasets.load("cifar10", tmp_path, split)
        np.testing.assert_array_equal(images, arrays[f"{split}_images"])
        np.testing.assert_array_equal(labels, arrays[f"{split}_labels"])


def test_corrupt_cifar_tar_and_pickle(tmp_path):
    folder, _ = make_cifar_folder(tmp_path / "extracted")
    tar_dir = tmp_path / "archive"
    tar_dir.mkdir()
    archive = tar_dir / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cifar-10-python\.tar\.gz: the tar\.gz archive is truncated or corrupt"):
        datasets.load("cifar10", tar_dir, "train")

    batch = folder / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:-2000])
    with pytest.raises(ValueError, match=r"data_batch_2: not a readable CIFAR-10 batch pickle"):
        datasets.load("cifar10", tmp_path / "extracted", "train")
    # A pickle that would run code is refused, not executed.
    batch.write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(ValueError, match=r"data_batch_2.*refers to os\.system"):
        datasets.load("cifar10", tmp_path / "extracted", "train")
    write_cifar_batch(batch, np.zeros((2, 32, 32, 3), np.uint8), [1, 2, 3])
    with pytest.raises(ValueError, match=r"data_batch_2: expected 2 labels"):
        datasets.load("cifar10", tmp_path / "extracted", "train")


# ---------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------


def batches(ds):
    return list(ds.as_numpy_iterator())


def test_binary_padding_and_grey_levels(tmp_path):
    arrays = make_mnist_dir(tmp_path)
    ds = datasets.make_dataset("mnist", "train", tmp_path, batch_size=8, shuffle=False, binarize=None)
    out = batches(ds)
    assert [b.shape for b in out] == [(8, 32, 32, 1)] * 2  # 20 images, remainder dropped (train).
    x = np.concatenate(out)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x[:, 2:30, 2:30, 0], arrays["train"][0][:16] / np.float32(255))
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert np.all(x[:, border] == 0)
    test = batches(datasets.make_dataset("mnist", "test", tmp_path, batch_size=4, binarize=None))
    assert [b.shape[0] for b in test] == [4, 4, 2]  # Test keeps the remainder, in order.
    np.testing.assert_array_equal(np.concatenate(test)[:, 2:30, 2:30, 0] * 255, arrays["test"][0])


def grey_mnist(root, p_value=77, n=64):
    """Images with three regions: p = 0, p = 1 and p = 77/255."""
    images = np.full((n, 28, 28), p_value, np.uint8)
    images[:, :4] = 0
    images[:, -4:] = 255
    root.mkdir(parents=True, exist_ok=True)
    for prefix in ("train", "t10k"):
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images, 2051)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", np.zeros(n, np.uint8), 2049)
    return p_value / 255.0


def test_dynamic_binarisation_redraws_every_batch_and_epoch(tmp_path):
    p = grey_mnist(tmp_path)
    ds = datasets.make_dataset("mnist", "train", tmp_path, batch_size=32, shuffle=False, seed=7, binarize="dynamic")
    epoch1, epoch2 = np.concatenate(batches(ds)), np.concatenate(batches(ds))
    for x in (epoch1, epoch2):
        assert set(np.unique(x)) == {0.0, 1.0}
        inner = x[:, 2:30, 2:30, 0]
        assert np.all(inner[:, :4] == 0) and np.all(inner[:, -4:] == 1)
        grey = inner[:, 4:-4]
        # Binomial mean test: n = 64 * 20 * 28 = 35,840 draws, bound 5 sigma
        # (a false alarm has probability 6e-7; the seed makes it deterministic).
        sigma = np.sqrt(p * (1 - p) / grey.size)
        assert abs(grey.mean() - p) < 5 * sigma, (grey.mean(), p, sigma)
    assert not np.array_equal(epoch1, epoch2)  # A fresh draw each epoch...
    assert not np.array_equal(epoch1[:32], epoch1[32:])  # ...and each batch of identical images.
    # Agreement between two independent draws is p^2 + (1-p)^2 on the grey region.
    agree = (epoch1[:, 6:26, 2:30] == epoch2[:, 6:26, 2:30]).mean()
    assert abs(agree - (p**2 + (1 - p) ** 2)) < 0.02
    # Reproducible from the seed: a rebuilt pipeline replays the same epochs.
    again = datasets.make_dataset("mnist", "train", tmp_path, batch_size=32, shuffle=False, seed=7, binarize="dynamic")
    np.testing.assert_array_equal(np.concatenate(batches(again)), epoch1)


def test_static_binarisation_is_reproducible(tmp_path):
    p = grey_mnist(tmp_path)
    ds = datasets.make_dataset("mnist", "test", tmp_path, batch_size=16, seed=3)  # "auto" -> static on test.
    epoch1, epoch2 = np.concatenate(batches(ds)), np.concatenate(batches(ds))
    np.testing.assert_array_equal(epoch1, epoch2)
    rebuilt = datasets.make_dataset("mnist", "test", tmp_path, batch_size=16, seed=3, binarize="static")
    np.testing.assert_array_equal(np.concatenate(batches(rebuilt)), epoch1)
    grey = epoch1[:, 6:26, 2:30, 0]
    assert set(np.unique(grey)) == {0.0, 1.0}
    assert abs(grey.mean() - p) < 5 * np.sqrt(p * (1 - p) / grey.size)
    other = datasets.make_dataset("mnist", "test", tmp_path, batch_size=16, seed=4, binarize="static")
    assert not np.array_equal(np.concatenate(batches(other)), epoch1)
    # Before: `seed=None` drew another binary test set than `seed=0` (and than
    # `seed=None` under a strategy, the shipped samples and `evaluate --seed 0`).
    unseeded = datasets.make_dataset("mnist", "test", tmp_path, batch_size=16)
    seed_zero = datasets.make_dataset("mnist", "test", tmp_path, batch_size=16, seed=0)
    np.testing.assert_array_equal(np.concatenate(batches(unseeded)), np.concatenate(batches(seed_zero)))


def test_shuffle_is_seeded_and_reshuffles_each_epoch(tmp_path):
    make_mnist_dir(tmp_path, n_train=40)

    def ids(ds):
        return (np.concatenate(batches(ds))[:, 2, 2, 0] * 255).round().astype(int)

    ds = datasets.make_dataset("mnist", "train", tmp_path, batch_size=10, seed=5, binarize=None)
    first, second = ids(ds), ids(ds)
    assert sorted(first) == list(range(40)) and sorted(second) == list(range(40))
    assert not np.array_equal(first, second) and not np.array_equal(first, np.arange(40))
    again = datasets.make_dataset("mnist", "train", tmp_path, batch_size=10, seed=5, binarize=None)
    np.testing.assert_array_equal(ids(again), first)


def test_seeded_order_and_draws_are_pinned(tmp_path):
    """The exact order and binary draws for a seed, as recorded before the
    split of datasets.py into a package: a resumed run must see the same data.
    If this fails, the data order of seeded runs has changed.

    tf.data combines an op seed with TensorFlow's global seed, so the values
    hold for the global seed `keras.utils.set_random_seed(0)` sets.
    """
    import keras

    keras.utils.set_random_seed(0)
    make_mnist_dir(tmp_path, n_train=20)
    ds = datasets.make_dataset("mnist", "train", tmp_path, batch_size=4, seed=7, binarize=None)
    orders = [[int(round(v * 255)) for b in batches(ds) for v in b[:, 2, 2, 0]] for _ in range(2)]
    assert orders == [
        [15, 18, 16, 13, 3, 5, 4, 12, 6, 17, 19, 11, 0, 14, 10, 8, 7, 2, 9, 1],
        [5, 19, 11, 0, 3, 15, 6, 13, 17, 9, 4, 2, 1, 8, 16, 10, 14, 7, 12, 18],
    ]
    ds = datasets.make_dataset("mnist", "train", tmp_path, batch_size=4, seed=7, shuffle=False)
    ink = [[int(b.sum()) for b in batches(ds)] for _ in range(2)]  # dynamic: redrawn every epoch
    assert ink == [[1519, 1585, 1580, 1565, 1547], [1546, 1566, 1614, 1565, 1584]]
    static = datasets.make_dataset("mnist", "test", tmp_path, batch_size=5, seed=7)
    assert [int(b.sum()) for b in batches(static)] == [2001, 1954]


def test_package_reexports_its_modules_public_names():
    import importlib
    import inspect
    import pkgutil

    for info in pkgutil.iter_modules(datasets.__path__):
        module = importlib.import_module(f"{datasets.__name__}.{info.name}")
        for name, member in vars(module).items():
            defined_here = getattr(member, "__module__", None) == module.__name__
            if not name.startswith("_") and defined_here and (inspect.isfunction(member) or inspect.isclass(member)):
                assert getattr(datasets, name, None) is member, f"keras_avae.datasets.{name} is not re-exported"
    assert datasets.NAMES == ("mnist", "omniglot", "cifar10") and datasets.SPLITS == ("train", "test")
    assert datasets.logger.name == "keras_avae.datasets"


def test_cifar_scaling_flips_and_labels(tmp_path):
    folder, expected = make_cifar_folder(tmp_path, n=8)
    ds = datasets.make_dataset("cifar10", "test", tmp_path, batch_size=8, with_labels=True)
    (x, y), = batches(ds)
    np.testing.assert_array_equal(x, expected["test"][0].astype(np.float32) / np.float32(127.5) - np.float32(1))
    assert x.min() >= -1 and x.max() <= 1
    np.testing.assert_array_equal(y, expected["test"][1])

    images = expected["test"][0].astype(np.float32) / np.float32(127.5) - np.float32(1)
    flipped = datasets.make_dataset("cifar10", "test", tmp_path, batch_size=8, random_flip=True, seed=0)
    patterns = []
    for _ in range(4):
        (out,) = batches(flipped)
        same = np.all(out == images, axis=(1, 2, 3))
        mirrored = np.all(out == images[:, :, ::-1], axis=(1, 2, 3))
        assert np.all(same | mirrored)
        patterns.append(tuple(mirrored))
    assert len(set(patterns)) > 1  # Redrawn every epoch.
    assert 0 < np.mean(patterns) < 1


def test_limit_repeat_and_argument_errors(tmp_path):
    make_mnist_dir(tmp_path)
    ds = datasets.make_dataset("mnist", "train", tmp_path, batch_size=4, limit=6, repeat=True, seed=0)
    taken = batches(ds.take(5))
    assert [b.shape for b in taken] == [(4, 32, 32, 1)] * 5
    with pytest.raises(ValueError, match="Received: name='svhn'"):
        datasets.make_dataset("svhn", "train", tmp_path)
    with pytest.raises(ValueError, match="Received: split='valid'"):
        datasets.load("mnist", tmp_path, "valid")
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        datasets.make_dataset("mnist", "train", tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="Received: binarize='dynamic'"):
        datasets.make_dataset("cifar10", "train", tmp_path, binarize="dynamic")
    with pytest.raises(ValueError, match="Received: random_flip=True"):
        datasets.make_dataset("mnist", "train", tmp_path, random_flip=True)
    with pytest.raises(ValueError, match="Received: binarize='yes'"):
        datasets.make_dataset("mnist", "train", tmp_path, binarize="yes")
    # Before: these went through `bool()`, so "false" shuffled and "no" repeated forever.
    for flag in ("shuffle", "drop_remainder", "repeat", "with_labels", "resize_images"):
        with pytest.raises(ValueError, match=rf"`{flag}` must be a bool.*Received: {flag}='false'"):
            datasets.make_dataset("mnist", "train", tmp_path, **{flag: "false"})
    with pytest.raises(ValueError, match=r"`random_flip` must be a bool.*Received: random_flip='no'"):
        datasets.make_dataset("cifar10", "train", tmp_path, random_flip="no")
    with pytest.raises(ValueError, match=r"`data_dir` must be a folder's path or None. Received: data_dir=123"):
        datasets.make_dataset("mnist", "train", 123)
    assert len(batches(datasets.make_dataset("mnist", "test", tmp_path, 4, shuffle=np.bool_(False)))) == 3
    assert datasets.image_shape("cifar10") == (32, 32, 3)


def test_start_batch_addresses_one_endless_stream(tmp_path):
    """A stream started at batch b is the stream from 0 without its first b batches (what a resumed run reads)."""
    make_mnist_dir(tmp_path, n_train=10)

    def stream(start, count, **kwargs):
        ds = datasets.make_dataset(
            "mnist", "train", tmp_path, batch_size=4, seed=3, repeat=True, start_batch=start, with_labels=True, **kwargs
        )
        return [(np.asarray(x), np.asarray(y)) for x, y in ds.take(count)]

    whole = stream(0, 12)
    for start in (1, 2, 5, 7):  # 2.5 batches a pass: starts inside and at the edges of passes
        for (x, y), (x_start, y_start) in zip(whole[start:], stream(start, 12 - start)):
            np.testing.assert_array_equal(x, x_start)
            np.testing.assert_array_equal(y, y_start)
    assert whole[0][0].shape == (4, 32, 32, 1) and set(np.unique(whole[0][0])) <= {0.0, 1.0}
    # Each pass is a permutation of the 10 images, reshuffled from pass to pass.
    labels = np.concatenate([y for _, y in whole])[:40].reshape(4, 10)
    assert all(sorted(row) == sorted(labels[0]) for row in labels) and len({tuple(row) for row in labels}) > 1
    for kwargs, match in (
        (dict(repeat=False, seed=3, start_batch=0), "needs `repeat=True` and a `seed`"),
        (dict(repeat=True, seed=None, start_batch=0), "needs `repeat=True` and a `seed`"),
        (dict(repeat=True, seed=3, start_batch=-1), r"Received: start_batch=-1"),
    ):
        with pytest.raises(ValueError, match=match):
            datasets.make_dataset("mnist", "train", tmp_path, batch_size=4, **kwargs)


def test_every_keeps_a_spread_subset_with_the_whole_splits_binary_images(tmp_path):
    make_mnist_dir(tmp_path, n_test=10)
    whole = np.concatenate(batches(datasets.make_dataset("mnist", "test", tmp_path, batch_size=4, seed=3)))
    grey = np.concatenate(batches(datasets.make_dataset("mnist", "test", tmp_path, batch_size=4, binarize=None)))
    assert not np.array_equal(whole, np.round(grey))  # Bernoulli draws, not rounding: a real comparison below.
    for every, limit, rows in ((3, None, [0, 3, 6, 9]), (3, 2, [0, 3]), (1, 4, [0, 1, 2, 3]), (20, None, [0])):
        ds = datasets.make_dataset("mnist", "test", tmp_path, batch_size=4, seed=3, every=every, limit=limit)
        np.testing.assert_array_equal(np.concatenate(batches(ds)), whole[rows])
    with pytest.raises(ValueError, match="Received: every=0"):
        datasets.make_dataset("mnist", "test", tmp_path, every=0)


def test_input_context_shards_and_batches_per_replica(tmp_path):
    import tensorflow as tf

    make_mnist_dir(tmp_path, n_train=40)
    seen = []
    for pipeline in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline, num_replicas_in_sync=4)
        ds = datasets.make_dataset(
            "mnist", "train", tmp_path, batch_size=8, seed=1, binarize=None, input_context=context
        )
        out = batches(ds)
        assert [b.shape[0] for b in out] == [2] * 10  # Global 8 / 4 replicas; 20 images per shard.
        seen.append(set((np.concatenate(out)[:, 2, 2, 0] * 255).round().astype(int)))
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(40))
    with pytest.raises(ValueError, match="divisible by the 4 replicas. Received: batch_size=6"):
        datasets.make_dataset("mnist", "train", tmp_path, batch_size=6, input_context=context)


_MIRRORED_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from keras_avae import datasets

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    data_dir = sys.argv[1]

    # Grey levels: every global batch of 8 is split 4 + 4 across the replicas.
    plain = list(datasets.make_dataset("mnist", "train", data_dir, batch_size=8, shuffle=False, binarize=None))
    dist = datasets.make_dataset(
        "mnist", "train", data_dir, batch_size=8, shuffle=False, binarize=None, strategy=strategy
    )
    steps = 0
    for step, batch in enumerate(dist):
        parts = strategy.experimental_local_results(batch)
        assert [tuple(p.shape) for p in parts] == [(4, 32, 32, 1)] * 2, [p.shape for p in parts]
        assert {p.device.split("/")[-1] for p in parts} == {"device:CPU:0", "device:CPU:1"}
        np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts]), plain[step].numpy())
        steps += 1
    assert steps == 5, steps
    # The sample grids' first images of a distributed dataset: both replicas' parts
    # (before: none, so a run under a strategy drew no images or reconstructions).
    from keras_avae.training.run_settings import _first_images

    np.testing.assert_array_equal(_first_images(dist, 6), plain[0].numpy()[:6])

    # Shuffled (seed None means 0 under a strategy): every image once per epoch.
    dist = datasets.make_dataset("mnist", "train", data_dir, batch_size=8, binarize=None, strategy=strategy)
    ids = [
        int(round(v * 255))
        for batch in dist
        for p in strategy.experimental_local_results(batch)
        for v in p.numpy()[:, 2, 2, 0]
    ]
    assert sorted(ids) == list(range(40)) and ids != list(range(40)), ids

    # Dynamic binarisation differs between two epochs of the distributed set.
    dist = datasets.make_dataset("mnist", "train", data_dir, batch_size=8, shuffle=False, seed=0, strategy=strategy)
    def epoch():
        parts = [p.numpy() for b in dist for p in strategy.experimental_local_results(b)]
        return np.concatenate(parts)
    assert not np.array_equal(epoch(), epoch())

    # Keras fit takes the distributed dataset.
    class Tiny(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
        def call(self, x):
            return self.dense(keras.ops.reshape(x, (-1, 32 * 32)))
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean(keras.ops.square(y_pred - 1.0))

    with strategy.scope():
        model = Tiny()
        model.compile(optimizer="sgd")
    history = model.fit(dist, epochs=2, verbose=0)
    # One step per global batch: 2 epochs x 5 (no extra step at the end of an epoch).
    assert int(model.optimizer.iterations.numpy()) == 10, model.optimizer.iterations
    print("MIRRORED_OK", len(history.history["loss"]))
    """
)


def test_mirrored_strategy_on_two_logical_cpus(tmp_path):
    make_mnist_dir(tmp_path / "mnist", n_train=40)
    script = tmp_path / "mirrored.py"
    script.write_text(_MIRRORED_SCRIPT)
    env = dict(os.environ, KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "mnist")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0 and "MIRRORED_OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


# ---------------------------------------------------------------------------
# tensorflow_datasets (mocked: no network)
# ---------------------------------------------------------------------------


def test_tfds_path_with_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=6):
        images, labels = datasets.load("omniglot", None, "train")
        assert images.shape == (6, 28, 28, 1) and images.dtype == np.float32
        assert 0 <= images.min() and images.max() <= 1 and labels.shape == (6,)
        x = batches(datasets.make_dataset("mnist", "train", None, batch_size=4, seed=0))
        assert [b.shape for b in x] == [(4, 32, 32, 1)]
        assert set(np.unique(x[0])) <= {0.0, 1.0}
        (c,) = batches(datasets.make_dataset("cifar10", "test", None, batch_size=6))
        assert c.shape == (6, 32, 32, 3) and -1 <= c.min() and c.max() <= 1


_MULTI_WORKER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    ports, index = sys.argv[2].split(","), int(sys.argv[3])
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
    )
    import tensorflow as tf
    from keras_avae import datasets

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    dist = datasets.make_dataset("mnist", "train", sys.argv[1], batch_size=8, binarize=None, strategy=strategy)
    for epoch in range(2):
        ids = []
        for batch in dist:
            (local,) = strategy.experimental_local_results(batch)
            assert tuple(local.shape) == (4, 32, 32, 1), local.shape
            ids.extend(int(round(v * 255)) for v in local.numpy()[:, 2, 2, 0])
        print("IDS", epoch, json.dumps(ids), flush=True)
    """
)


@pytest.mark.slow
def test_multi_worker_shards_are_disjoint(tmp_path):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1 split every epoch."""
    make_mnist_dir(tmp_path / "mnist", n_train=40)
    script = tmp_path / "worker.py"
    script.write_text(_MULTI_WORKER_SCRIPT)
    ports = ",".join(map(str, free_ports(2)))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "mnist"), ports, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=240)
            assert worker.returncode == 0, out[-2000:] + err[-4000:]
            outputs.append(out)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    per_worker = [
        {int(line.split()[1]): json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if line.startswith("IDS")}
        for out in outputs
    ]
    for epoch in range(2):
        first, second = per_worker[0][epoch], per_worker[1][epoch]
        assert len(first) == len(second) == 20
        assert sorted(first + second) == list(range(40))  # Disjoint shards covering the epoch.
    assert per_worker[0][0] != per_worker[0][1]  # Reshuffled between epochs.


def test_shipped_mnist_sample_matches_the_test_pipeline(tmp_path):
    grey, labels = datasets.mnist_test_sample(100, binarize=False, with_labels=True)
    raw = np.round(grey[:, 2:30, 2:30, 0] * 255).astype(np.uint8)
    assert raw.shape == (100, 28, 28) and raw.max() == 255 and labels.shape == (100,) and labels.dtype == np.int64
    # The shipped images as MNIST files: the test pipeline must binarise them
    # exactly as mnist_test_sample does, so the demo scores what evaluate scores.
    root = tmp_path / "mnist"
    root.mkdir()
    for prefix in ("train", "t10k"):
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", raw, 2051)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels, 2049)
    for seed in (0, 3):
        piped = np.concatenate(batches(datasets.make_dataset("mnist", "test", str(root), 32, seed=seed)))
        np.testing.assert_array_equal(datasets.mnist_test_sample(100, seed=seed), piped)
    assert not np.array_equal(datasets.mnist_test_sample(10, seed=0), datasets.mnist_test_sample(10, seed=3))
    # Binary draws follow the grey levels: mean ink close to the mean grey.
    assert abs(datasets.mnist_test_sample(100).mean() - grey.mean()) < 0.01
    with pytest.raises(ValueError, match="num_images=101"):
        datasets.mnist_test_sample(101)


def test_shipped_omniglot_and_cifar_samples_match_the_test_pipeline(tmp_path):
    # The shipped grey levels (OMNIGLOT) and pixels (CIFAR-10) written as the
    # files the readers take: the test pipeline must prepare them exactly as
    # shipped_sample does, so a card's sample figure is what evaluate scores.
    grey, alphabets = datasets.shipped_sample("omniglot", 100, binarize=None, with_labels=True)
    raw = grey[:, 2:30, 2:30, 0]
    assert raw.shape == (100, 28, 28) and 0.0 < raw.mean() < 0.5 and raw.max() == 1.0
    assert set(np.unique(raw)) - {0.0, 1.0}, "area-averaged strokes have grey edges"
    columns = np.stack([im.ravel(order="F") for im in raw], axis=1).astype(np.float64)
    onehot = np.eye(50)[:, alphabets]
    scipy.io.savemat(
        tmp_path / "chardata.mat", {"data": columns, "testdata": columns, "target": onehot, "testtarget": onehot}
    )
    for seed in (0, 3):
        piped = np.concatenate(batches(datasets.make_dataset("omniglot", "test", str(tmp_path), 32, seed=seed)))
        np.testing.assert_array_equal(datasets.shipped_sample("omniglot", 100, seed=seed), piped)
    assert abs(datasets.shipped_sample("omniglot").mean() - grey.mean()) < 0.01

    pixels, classes = datasets.shipped_sample("cifar10", 100, with_labels=True)
    stored = np.round((pixels + 1.0) * 127.5).astype(np.uint8)
    arrays = {"train_images": stored, "train_labels": classes, "test_images": stored, "test_labels": classes}
    np.savez_compressed(tmp_path / "cifar10_partial.npz", **arrays)
    piped = np.concatenate(batches(datasets.make_dataset("cifar10", "test", str(tmp_path), 32)))
    np.testing.assert_array_equal(pixels, piped)
    assert pixels.shape == (100, 32, 32, 3) and pixels.min() == -1.0 and pixels.max() == 1.0


def test_shipped_samples_are_the_first_images_of_the_real_test_splits():
    root = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
    if not (root / "omniglot" / "omniglot_105.npz").is_file():
        pytest.skip(f"the real data sets are not beside the repository ({root})")
    omniglot, alphabets = datasets.load("omniglot", root / "omniglot", "test")
    grey, labels = datasets.shipped_sample("omniglot", 100, binarize=None, with_labels=True)
    # The area averaging is a float32 matrix product, which BLAS sums in the
    # order of the CPU's kernel: 1 float32 ulp (2.4e-7) on 3.5% of these
    # pixels on an AVX-512/AMX Xeon. Other images differ by 1/225 or more.
    np.testing.assert_allclose(grey[:, 2:30, 2:30], omniglot[:100], rtol=0, atol=5e-7)
    assert np.abs(grey[:, 2:30, 2:30] - omniglot[1:101]).max() >= 1 / 225
    np.testing.assert_array_equal(labels, alphabets[:100])
    cifar, classes = datasets.load("cifar10", root / "cifar10", "test")
    pixels, labels = datasets.shipped_sample("cifar10", 100, with_labels=True)
    np.testing.assert_array_equal(pixels, cifar[:100].astype(np.float32) / np.float32(127.5) - 1)
    np.testing.assert_array_equal(labels, classes[:100])
    assert labels.dtype == classes.dtype == np.int64  # as `load` gives them (were uint8)


def test_shipped_sample_argument_errors():
    with pytest.raises(ValueError, match="name='svhn'"):
        datasets.shipped_sample("svhn")
    with pytest.raises(ValueError, match="num_images=0"):
        datasets.shipped_sample("cifar10", 0)
    with pytest.raises(ValueError, match="CIFAR-10 is not binarised.*binarize='static'"):
        datasets.shipped_sample("cifar10", binarize="static")
    with pytest.raises(ValueError, match="statically.*binarize='dynamic'"):
        datasets.shipped_sample("omniglot", binarize="dynamic")
    with pytest.raises(ValueError, match="`binarize` must be a bool.*binarize=.static."):
        datasets.mnist_test_sample(binarize="static")
