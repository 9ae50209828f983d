"""Tests of folders of your own PNG/JPEG images (`read_image_folder`, `--data-dir`).

Every test writes its own tiny images with Pillow into `tmp_path`.
"""

import json
import logging
import math
import os

import numpy as np
import PIL.Image
import pytest

from keras_avae import datasets
from tests.test_case import backend_independent
from tests.test_cli import BACKEND
from tests.test_cli import TINY_SETS
from tests.test_cli import assert_one_line_error
from tests.test_cli import run_main
from tests.test_cli import sets
from tests.test_datasets import batches
from tests.test_datasets import make_mnist_dir


def write_images(folder, n, size=(28, 28), rgb=False, seed=0, prefix="img", suffix=".png"):
    """`n` random images `{prefix}_{i:03d}{suffix}`; pixel (0, 0) (red in RGB) holds `i`, to tell them apart.

    Returns `{relative file name: array}`.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0], 3) if rgb else (size[1], size[0])
    written = {}
    for i in range(n):
        array = rng.integers(0, 256, shape, dtype=np.uint8)
        array[0, 0] = i
        name = f"{prefix}_{i:03d}{suffix}"
        PIL.Image.fromarray(array).save(folder / name)
        written[name] = array
    return written


def ids(images):
    """The ids written at pixel (0, 0) (grey levels in [0, 1] or RGB bytes)."""
    first = images[:, 0, 0, 0]
    return sorted(np.round(first * 255).astype(int).tolist() if first.dtype == np.float32 else first.tolist())


# ---------------------------------------------------------------------------
# The reader
# ---------------------------------------------------------------------------


def test_grey_levels_read_back_exactly(tmp_path):
    written = write_images(tmp_path, 40)
    parts = [datasets.read_image_folder(tmp_path, split, "grey") for split in ("train", "test")]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    assert images.dtype == np.float32 and images.shape == (40, 28, 28, 1)
    assert labels.dtype == np.int64 and np.all(labels == 0)  # no class subfolders
    expected = {array[0, 0]: array for array in written.values()}
    for image in images:
        i = int(round(float(image[0, 0, 0]) * 255))
        np.testing.assert_array_equal(image[..., 0], expected[i].astype(np.float32) / np.float32(255))
    # Sorted by file name within a split.
    train_ids = [int(round(float(v) * 255)) for v in parts[0][0][:, 0, 0, 0]]
    assert train_ids == sorted(train_ids)


def test_rgb_bytes_read_back_exactly_from_train_and_test_folders(tmp_path):
    train = write_images(tmp_path / "train", 6, size=(32, 32), rgb=True, seed=1)
    test = write_images(tmp_path / "test", 3, size=(32, 32), rgb=True, seed=2, suffix=".PNG")
    for split, written in (("train", train), ("test", test)):
        images, labels = datasets.read_image_folder(tmp_path, split, "rgb")
        assert images.dtype == np.uint8 and images.shape == (len(written), 32, 32, 3)
        np.testing.assert_array_equal(images, np.stack([written[name] for name in sorted(written)]))
        assert labels.tolist() == [0] * len(written)
    # RGB files for a grey entry: converted to brightness, Pillow's "L" conversion.
    rgb = PIL.Image.fromarray(train["img_000.png"])
    small = tmp_path / "grey"
    (small / "train").mkdir(parents=True)
    (small / "test").mkdir()
    rgb.resize((28, 28)).save(small / "train" / "a.png")
    rgb.resize((28, 28)).save(small / "test" / "a.jpeg", quality=95)
    grey, _ = datasets.read_image_folder(small, "train", "grey")
    expected = np.asarray(rgb.resize((28, 28)).convert("L"), np.float32) / np.float32(255)
    np.testing.assert_array_equal(grey[0, ..., 0], expected)
    jpeg, _ = datasets.read_image_folder(small, "test", "grey")
    assert jpeg.shape == (1, 28, 28, 1) and 0 <= jpeg.min() and jpeg.max() <= 1


def test_hash_split_is_deterministic_disjoint_and_stable(tmp_path):
    write_images(tmp_path, 200)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden.png").write_bytes(b"not an image either")
    train, _ = datasets.read_image_folder(tmp_path, "train", "grey")
    test, _ = datasets.read_image_folder(tmp_path, "test", "grey")
    train_ids, test_ids = ids(train), ids(test)
    assert not set(train_ids) & set(test_ids)
    assert sorted(train_ids + test_ids) == list(range(200))
    assert 8 <= len(test_ids) <= 36, len(test_ids)  # about 10% of 200
    again, _ = datasets.read_image_folder(tmp_path, "test", "grey")
    assert ids(again) == test_ids
    # New files do not move the old ones ("img_..." sorts before "new_...").
    write_images(tmp_path, 100, prefix="new", seed=5)
    more_train, _ = datasets.read_image_folder(tmp_path, "train", "grey")
    more_test, _ = datasets.read_image_folder(tmp_path, "test", "grey")
    assert len(more_train) + len(more_test) == 300 and len(more_test) > len(test)
    np.testing.assert_array_equal(more_train[: len(train)], train)
    np.testing.assert_array_equal(more_test[: len(test)], test)


def test_class_labels_from_subfolders(tmp_path):
    for c, name in enumerate(["cat", "dog", "zebra"]):
        write_images(tmp_path / "flat" / name, 30, seed=c, prefix=name)
    seen = {}
    for split in ("train", "test"):
        images, labels = datasets.read_image_folder(tmp_path / "flat", split, "grey")
        for image, label in zip(images, labels):
            seen.setdefault(int(label), []).append(image)
    assert sorted(seen) == [0, 1, 2] and sum(len(v) for v in seen.values()) == 90
    # The labels follow the sorted class names; the test split misses "b":
    # the indices still count it.
    write_images(tmp_path / "split" / "train" / "a", 2, seed=3)
    write_images(tmp_path / "split" / "train" / "b", 2, seed=4)
    write_images(tmp_path / "split" / "train" / "c", 2, seed=5)
    write_images(tmp_path / "split" / "test" / "a", 1, seed=6)
    write_images(tmp_path / "split" / "test" / "c" / "deeper", 1, seed=7)
    _, train_labels = datasets.read_image_folder(tmp_path / "split", "train", "grey")
    _, test_labels = datasets.read_image_folder(tmp_path / "split", "test", "grey")
    assert train_labels.tolist() == [0, 0, 1, 1, 2, 2] and test_labels.tolist() == [0, 2]
    # Files directly in the split's folder form the class "" (index 0).
    write_images(tmp_path / "split" / "test", 1, seed=8, prefix="loose")
    _, test_labels = datasets.read_image_folder(tmp_path / "split", "test", "grey")
    assert test_labels.tolist() == [1, 3, 0]


def test_symlinked_class_folders_are_read_and_link_cycles_end(tmp_path):
    # Before: os.walk did not enter linked folders, so their class vanished.
    write_images(tmp_path / "store" / "dogs", 30, seed=1, prefix="dog")
    write_images(tmp_path / "data" / "cat", 30, seed=0, prefix="cat")
    (tmp_path / "data" / "dog").symlink_to(tmp_path / "store" / "dogs", target_is_directory=True)
    (tmp_path / "data" / "cat" / "loop").symlink_to(tmp_path / "data", target_is_directory=True)
    parts = [datasets.read_image_folder(tmp_path / "data", split, "grey") for split in ("train", "test")]
    labels = np.concatenate([p[1] for p in parts])
    assert np.bincount(labels).tolist() == [30, 30]
    linked = np.concatenate([p[0][p[1] == 1] for p in parts])
    assert ids(linked) == list(range(30))


def test_a_folder_that_cannot_be_listed_is_refused(tmp_path, monkeypatch):
    # Before: os.walk skipped a folder it could not list, and its class with it.
    write_images(tmp_path / "data" / "cat", 30, prefix="cat")
    write_images(tmp_path / "data" / "dog", 30, prefix="dog")
    scandir = os.scandir

    def unlistable_dogs(path="."):
        if os.fspath(path).endswith("dog"):  # chmod would not stop root
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", unlistable_dogs)
    with pytest.raises(OSError, match=r"data/dog: this folder cannot be listed \(Permission denied\), so its images"):
        datasets.read_image_folder(tmp_path / "data", "train", "grey")


def test_one_file_reached_through_two_links_is_refused(tmp_path):
    # Before: a sibling link to a class folder read its files again, as another
    # class, and the hash split sent some copies to test while they were in train.
    write_images(tmp_path / "flat" / "digits", 30)
    (tmp_path / "flat" / "digits_link").symlink_to(tmp_path / "flat" / "digits", target_is_directory=True)
    with pytest.raises(ValueError, match=r"digits/img_000\.png and digits_link/img_000\.png are the same file"):
        datasets.read_image_folder(tmp_path / "flat", "train", "grey")
    write_images(tmp_path / "split" / "train", 3)
    (tmp_path / "split" / "test").mkdir()
    (tmp_path / "split" / "test" / "leak.png").symlink_to(tmp_path / "split" / "train" / "img_001.png")
    with pytest.raises(ValueError, match=r"test/leak\.png and train/img_001\.png are the same file"):
        datasets.read_image_folder(tmp_path / "split", "test", "grey")


@pytest.mark.parametrize("names", [("Train", "Test"), ("training", "testing"), ("train", "Test")])
def test_split_folders_spelt_otherwise_are_refused(tmp_path, names):
    # Before: `Train/` and `Test/` were two classes, and 90% of Test/ went to training.
    for name in names:
        write_images(tmp_path / name, 20)
    listed = ", ".join(f"{n}/" for n in names)  # the train folder first
    with pytest.raises(ValueError, match=rf"has the split folders {listed}\. Use both train/ and test/"):
        datasets.read_image_folder(tmp_path, "train", "grey")


def test_images_beside_the_split_folders_are_refused(tmp_path):
    # Before: the 50 images in extra/ and the folder itself were skipped without a word.
    write_images(tmp_path / "train", 3)
    write_images(tmp_path / "test", 2)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "empty").mkdir()
    write_images(tmp_path / ".hidden", 2)
    assert len(datasets.read_image_folder(tmp_path, "train", "grey")[0]) == 3  # nothing stray yet
    write_images(tmp_path / "extra" / "deeper", 2)
    write_images(tmp_path, 2, prefix="loose")
    for split in ("train", "test"):
        with pytest.raises(ValueError, match=r"outside its train/ and test/ folders.*: extra/, loose_000\.png, "
                           r"loose_001\.png\. Move them into train/ or test/"):
            datasets.read_image_folder(tmp_path, split, "grey")


def test_transparent_images_are_refused_opaque_alpha_is_dropped(tmp_path):
    # Before: a glyph drawn in the alpha channel over black pixels loaded as a blank image.
    glyph = np.zeros((28, 28, 4), np.uint8)
    glyph[8:20, 12:16, 3] = 255
    (tmp_path / "train").mkdir()
    write_images(tmp_path / "test", 1)
    PIL.Image.fromarray(glyph).save(tmp_path / "train" / "glyph.png")
    for kind in ("grey", "rgb"):
        with pytest.raises(ValueError, match=r"glyph\.png: 736 of its 784 pixels are transparent.*Flatten it"):
            datasets.read_image_folder(tmp_path, "train", kind, resize=True)
    palette = PIL.Image.fromarray(np.arange(784, dtype=np.uint8).reshape(28, 28) % 4).convert("P")
    palette.save(tmp_path / "train" / "glyph.png", transparency=0)
    with pytest.raises(ValueError, match=r"glyph\.png: 196 of its 784 pixels are transparent"):
        datasets.read_image_folder(tmp_path, "train", "grey")
    glyph[..., 3], glyph[..., 0] = 255, 200
    PIL.Image.fromarray(glyph).save(tmp_path / "train" / "glyph.png")
    images, _ = datasets.read_image_folder(tmp_path, "train", "rgb", resize=True)
    np.testing.assert_array_equal(images[0, ..., 0], np.full((32, 32), 200))


def test_sixteen_bit_grey_keeps_its_levels_and_its_transparency_is_refused(tmp_path):
    levels = np.random.default_rng(0).integers(0, 65536, (28, 28), dtype=np.uint16)
    levels[0, 0] = 1234
    (tmp_path / "train").mkdir()
    write_images(tmp_path / "test", 1)
    PIL.Image.fromarray(levels).save(tmp_path / "train" / "deep.png")
    assert PIL.Image.open(tmp_path / "train" / "deep.png").mode == "I;16"
    grey, _ = datasets.read_image_folder(tmp_path, "train", "grey")
    np.testing.assert_allclose(grey[0, ..., 0], levels / 65535, rtol=1e-6)  # not clipped to 255 / 65535
    rgb, _ = datasets.read_image_folder(tmp_path, "train", "rgb", resize=True)
    assert rgb.dtype == np.uint8 and rgb.max() > 250  # scaled to bytes, not clipped at 255 of 65535
    # Before: a 16-bit grey PNG's transparent level (tRNS) was read as ink
    # without a word, while 8-bit images with transparency were refused.
    PIL.Image.fromarray(levels).save(tmp_path / "train" / "deep.png", transparency=1234)
    count = int(np.count_nonzero(levels == 1234))
    for kind in ("grey", "rgb"):
        with pytest.raises(ValueError, match=rf"deep\.png: {count} of its 784 pixels are transparent"):
            datasets.read_image_folder(tmp_path, "train", kind, resize=True)


def write_rgb16_png(path, levels, transparent=None):
    """A 16-bit RGB PNG of uint16 `levels` (H, W, 3), with a tRNS colour key (Pillow cannot write one)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in levels)
    header = struct.pack(">IIBBBBB", levels.shape[1], levels.shape[0], 16, 2, 0, 0, 0)
    trns = chunk(b"tRNS", struct.pack(">HHH", *transparent)) if transparent else b""
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + trns + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )


def test_sixteen_bit_rgb_transparency_is_refused(tmp_path):
    # Before: a 16-bit RGB PNG's transparent colour (tRNS, 16-bit) was compared
    # with its pixels as Pillow reads them (8-bit): no pixel matched, and the
    # transparent pixels were read as that colour without a word.
    (tmp_path / "train").mkdir()
    write_images(tmp_path / "test", 1)
    levels = np.full((28, 28, 3), 0x8000, np.uint16)
    write_rgb16_png(tmp_path / "train" / "deep.png", levels)
    images, _ = datasets.read_image_folder(tmp_path, "train", "rgb", resize=True)
    np.testing.assert_array_equal(images, 128)  # opaque: read (the high bytes)
    for key in [(0xFFFF, 0xFFFF, 0xFFFF), (0, 0, 0x00FF)]:
        levels[:3] = key
        write_rgb16_png(tmp_path / "train" / "deep.png", levels, transparent=key)
        assert PIL.Image.open(tmp_path / "train" / "deep.png").mode == "RGB"
        for kind in ("grey", "rgb"):
            with pytest.raises(ValueError, match=r"deep\.png: 84 of its 784 pixels are transparent"):
                datasets.read_image_folder(tmp_path, "train", kind, resize=True)


def test_files_of_other_formats_under_an_image_name_are_refused(tmp_path):
    # Before: Pillow opened a float TIFF named .png, and it was read as a
    # black image (its levels in [0, 1] truncated by the conversion to grey).
    write_images(tmp_path / "train", 2)
    write_images(tmp_path / "test", 1)
    levels = np.random.default_rng(0).random((28, 28)).astype(np.float32)
    PIL.Image.fromarray(levels).save(tmp_path / "train" / "scan.png", format="TIFF")
    with pytest.raises(ValueError, match=r"scan\.png: a TIFF file, not a PNG/JPEG image"):
        datasets.read_image_folder(tmp_path, "train", "grey")
    # A JPEG named .png (a PNG named .jpg likewise) is still read.
    array = np.random.default_rng(1).integers(0, 256, (28, 28), dtype=np.uint8)
    PIL.Image.fromarray(array).save(tmp_path / "train" / "scan.png", format="JPEG", quality=100)
    images, _ = datasets.read_image_folder(tmp_path, "train", "grey")
    expected = np.asarray(PIL.Image.open(tmp_path / "train" / "scan.png").convert("L"), np.float32) / 255
    np.testing.assert_array_equal(images[2, ..., 0], expected)


def test_animated_pngs_are_refused_naming_the_file_and_its_frames(tmp_path):
    # Before: a 2-frame APNG was read as its first frame without a word.
    write_images(tmp_path / "train", 2)
    write_images(tmp_path / "test", 1)
    frames = [PIL.Image.fromarray(np.full((28, 28), level, np.uint8)) for level in (10, 200)]
    frames[0].save(tmp_path / "train" / "blink.png", save_all=True, append_images=frames[1:])
    assert PIL.Image.open(tmp_path / "train" / "blink.png").n_frames == 2
    for kind in ("grey", "rgb"):
        with pytest.raises(ValueError, match=r"blink\.png: an animated PNG image of 2 frames, and only its first "
                           r"frame would be read\. Save the frames"):
            datasets.read_image_folder(tmp_path, "train", kind, resize=True)
    # A one-frame APNG is a still image, and a camera's MPO JPEG its first image (the photo).
    frames[1].save(tmp_path / "train" / "blink.png", save_all=True)
    frames[0].save(tmp_path / "train" / "photo.jpg", format="MPO", save_all=True, append_images=frames[1:])
    assert PIL.Image.open(tmp_path / "train" / "photo.jpg").n_frames == 2
    images, _ = datasets.read_image_folder(tmp_path, "train", "grey")
    np.testing.assert_array_equal(images[0, ..., 0], np.full((28, 28), 200 / 255, np.float32))
    np.testing.assert_allclose(images[3, ..., 0], 10 / 255, atol=2 / 255)  # JPEG: lossy


def test_images_of_other_formats_are_named_in_a_warning(tmp_path, caplog):
    # Before: a folder of PNG and WebP files trained on the PNGs alone without a word.
    write_images(tmp_path / "cat", 20)
    write_images(tmp_path / "dog", 20, suffix=".webp")
    write_images(tmp_path / "dog", 1, prefix="scan", suffix=".BMP")
    (tmp_path / "notes.txt").write_text("not an image")
    with caplog.at_level(logging.WARNING, logger="keras_avae.datasets"):
        parts = [datasets.read_image_folder(tmp_path, split, "grey") for split in ("train", "test")]
    assert sum(len(images) for images, _ in parts) == 20
    assert "skipped 21 image file(s) of formats other than PNG/JPEG" in caplog.text
    assert "dog/img_000.webp" in caplog.text and "and 16 more" in caplog.text and "notes.txt" not in caplog.text


def test_jpeg_and_png_files_under_other_names_are_named_in_a_warning(tmp_path, caplog):
    # Before: JPEGs saved as `.jfif` (Windows) or `.jpe`, and `.apng` files,
    # were left out of the data without a word.
    write_images(tmp_path / "cat", 20)
    write_images(tmp_path / "dog", 2, prefix="shot", suffix=".jfif")
    write_images(tmp_path / "dog", 1, prefix="scan", suffix=".JPE")
    write_images(tmp_path / "dog", 1, prefix="anim", suffix=".apng")
    with caplog.at_level(logging.WARNING, logger="keras_avae.datasets"):
        parts = [datasets.read_image_folder(tmp_path, split, "grey") for split in ("train", "test")]
    assert sum(len(images) for images, _ in parts) == 20
    assert "skipped 4 image file(s)" in caplog.text and "named other than .png/.jpg/.jpeg" in caplog.text
    for name in ("dog/anim_000.apng", "dog/scan_000.JPE", "dog/shot_000.jfif", "dog/shot_001.jfif"):
        assert name in caplog.text
    # Beside train/ and test/ (where PNG files are refused), as within them.
    write_images(tmp_path / "split" / "train", 2)
    write_images(tmp_path / "split" / "test", 1)
    write_images(tmp_path / "split" / "test", 1, prefix="phone", suffix=".jfif")
    write_images(tmp_path / "split" / "extra", 1, suffix=".webp")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="keras_avae.datasets"):
        assert len(datasets.read_image_folder(tmp_path / "split", "test", "grey")[0]) == 1
    assert "skipped 2 image file(s)" in caplog.text
    assert "extra/img_000.webp, test/phone_000.jfif" in caplog.text


def test_reading_holds_one_copy_of_the_images(tmp_path):
    # Before: the decoded images were listed, then stacked: two copies of a
    # large folder in memory at once.
    import tracemalloc

    write_images(tmp_path / "train", 250, size=(32, 32), rgb=True)
    write_images(tmp_path / "test", 1, size=(32, 32), rgb=True)
    tracemalloc.start()
    try:
        images, _ = datasets.read_image_folder(tmp_path, "train", "rgb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert images.shape == (250, 32, 32, 3)
    assert peak < 1.5 * images.nbytes, f"peak {peak} bytes for {images.nbytes} bytes of images"


def test_every_refused_file_is_named_in_one_error(tmp_path):
    # Before: reading stopped at the first bad file, so a folder with several
    # took one rerun per file to find them all.
    write_images(tmp_path / "train", 4)
    write_images(tmp_path / "test", 1)
    write_images(tmp_path / "train", 1, size=(30, 28), prefix="wide")
    (tmp_path / "train" / "zero.png").write_bytes(b"")
    with pytest.raises(ValueError, match=r"wide_000\.png: the image is 30x28 pixels") as error:  # the first, in full
        datasets.read_image_folder(tmp_path, "train", "grey")
    others = tmp_path / "train" / "zero.png"
    assert str(error.value).endswith(f"In all, 2 of the 6 images are refused: this one and {others}.")
    # Many: the first five others by name.
    for i in range(7):
        (tmp_path / "train" / f"zz_{i}.png").write_bytes(b"")
    many = r"In all, 9 of the 13 images are refused: this one and .*zz_3\.png and 3 more\.$"
    with pytest.raises(ValueError, match=many):
        datasets.read_image_folder(tmp_path, "train", "grey")
    # One bad file: its own error, unchanged.
    for bad in [tmp_path / "train" / "zero.png", *(tmp_path / "train").glob("zz_*")]:
        bad.unlink()
    with pytest.raises(ValueError, match=r"30x28 pixels.*or resize the files\.$"):
        datasets.read_image_folder(tmp_path, "train", "grey")


def test_file_names_that_are_not_utf8_are_read(tmp_path):
    # Before: the hash split encoded names as UTF-8 and raised UnicodeEncodeError.
    write_images(tmp_path, 20)
    (tmp_path / "img_000.png").rename(tmp_path / os.fsdecode(b"caf\xe9.png"))
    images = np.concatenate([datasets.read_image_folder(tmp_path, split, "grey")[0] for split in ("train", "test")])
    assert ids(images) == list(range(20))


def test_wrong_size_raises_unless_resized(tmp_path):
    write_images(tmp_path / "train", 2, size=(56, 56))
    write_images(tmp_path / "test", 1, size=(30, 28))
    with pytest.raises(ValueError, match=r"img_000\.png: the image is 30x28 pixels.*28x28.*resize=True.*resize_images=True.*--resize-images"):
        datasets.read_image_folder(tmp_path, "test", "grey")
    images, _ = datasets.read_image_folder(tmp_path, "test", "grey", resize=True)
    assert images.shape == (1, 28, 28, 1) and images.min() >= 0 and images.max() <= 1
    # Halving by area averaging: 2x2 blocks of one value give that value back.
    block = np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)
    PIL.Image.fromarray(np.kron(block, np.ones((2, 2), np.uint8))).save(tmp_path / "train" / "img_000.png")
    images, _ = datasets.read_image_folder(tmp_path, "train", "grey", resize=True)
    assert images.shape == (2, 28, 28, 1)
    np.testing.assert_allclose(images[0, ..., 0], block / 255, atol=1e-6)
    rgb = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    PIL.Image.fromarray(np.repeat(np.repeat(rgb, 2, 0), 2, 1)).save(tmp_path / "train" / "img_000.png")
    with pytest.raises(ValueError, match=r"img_000\.png: the image is 64x64 pixels.*32x32"):
        datasets.read_image_folder(tmp_path, "train", "rgb")
    images, _ = datasets.read_image_folder(tmp_path, "train", "rgb", resize=True)
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    np.testing.assert_array_equal(images[0], rgb)


def test_unreadable_files_and_bad_arguments(tmp_path):
    write_images(tmp_path / "train", 2)
    write_images(tmp_path / "test", 1)
    (tmp_path / "train" / "broken.png").write_bytes(b"not a png at all")
    with pytest.raises(ValueError, match=r"broken\.png: not a readable PNG/JPEG image"):
        datasets.read_image_folder(tmp_path, "train", "grey")
    good = (tmp_path / "test" / "img_000.png").read_bytes()
    (tmp_path / "train" / "broken.png").write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match=r"broken\.png: not a readable"):
        datasets.read_image_folder(tmp_path, "train", "grey")
    with pytest.raises(ValueError, match=r"`kind` must be one of \('grey', 'rgb'\). Received: kind='bw'"):
        datasets.read_image_folder(tmp_path, "test", "bw")
    with pytest.raises(ValueError, match=r"split="):
        datasets.read_image_folder(tmp_path, "valid", "grey")
    with pytest.raises(ValueError, match=r"resize='yes'"):
        datasets.read_image_folder(tmp_path, "test", "grey", resize="yes")
    with pytest.raises(FileNotFoundError, match=r"not a directory. Received: path='.*nowhere'"):
        datasets.read_image_folder(tmp_path / "nowhere", "test", "grey")


def test_empty_splits_raise(tmp_path):
    write_images(tmp_path / "one", 1)
    outcomes = []
    for split in ("train", "test"):
        try:
            outcomes.append(len(datasets.read_image_folder(tmp_path / "one", split, "grey")[0]))
        except ValueError as e:
            assert "none of its 1 image files falls in the" in str(e) and "train/ and test/" in str(e)
            outcomes.append(None)
    assert sorted(outcomes, key=str) == [1, None]
    write_images(tmp_path / "layout" / "train", 2)
    with pytest.raises(ValueError, match=r"has a train/ folder but no test/ folder"):
        datasets.read_image_folder(tmp_path / "layout", "train", "grey")
    (tmp_path / "layout" / "test").mkdir()
    with pytest.raises(ValueError, match=r"test: no image files \(\.png, \.jpg, \.jpeg\) for the test split"):
        datasets.read_image_folder(tmp_path / "layout", "test", "grey")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no image files"):
        datasets.read_image_folder(tmp_path / "empty", "test", "grey")


# ---------------------------------------------------------------------------
# Discovery and pipelines
# ---------------------------------------------------------------------------


def test_locate_prefers_original_files_then_the_named_subfolder(tmp_path, caplog):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\.gz.*image files \(\.png, \.jpg, \.jpeg"):
        datasets.locate("mnist", tmp_path / "empty")
    write_images(tmp_path / "own" / "train", 2)
    write_images(tmp_path / "own" / "test", 1)
    assert datasets.locate("mnist", tmp_path / "own") == (datasets.read_image_folder, tmp_path / "own")
    with caplog.at_level(logging.INFO, logger="keras_avae.datasets"):
        images, _ = datasets.load("omniglot", tmp_path / "own", "test")
    assert images.dtype == np.float32 and images.shape == (1, 28, 28, 1)
    assert "image folder" in caplog.text and str(tmp_path / "own") in caplog.text
    # The original files win over images in the same folder.
    make_mnist_dir(tmp_path / "own", n_train=3, n_test=2)
    assert datasets.locate("mnist", tmp_path / "own")[0] is datasets.read_mnist
    # A folder holding mnist/ and cifar10/ image folders serves both.
    write_images(tmp_path / "both" / "mnist", 30)
    write_images(tmp_path / "both" / "cifar10", 30, size=(32, 32), rgb=True)
    assert datasets.locate("mnist", tmp_path / "both")[1] == tmp_path / "both" / "mnist"
    assert datasets.locate("cifar10", tmp_path / "both")[1] == tmp_path / "both" / "cifar10"
    assert datasets.load("cifar10", tmp_path / "both", "train")[0].shape[1:] == (32, 32, 3)


def test_make_dataset_binarises_grey_images_and_scales_rgb(tmp_path):
    grey = write_images(tmp_path / "grey" / "train", 16)
    write_images(tmp_path / "grey" / "test", 4)
    train = batches(datasets.make_dataset("mnist", "train", tmp_path / "grey", batch_size=4, seed=0))
    assert [b.shape for b in train] == [(4, 32, 32, 1)] * 4
    assert set(np.unique(np.concatenate(train)).tolist()) == {0.0, 1.0}
    levels = batches(datasets.make_dataset("mnist", "train", tmp_path / "grey", 4, shuffle=False, binarize=None))
    expected = np.stack([grey[name] for name in sorted(grey)]).astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(np.concatenate(levels)[:, 2:30, 2:30, 0], expected)

    rgb = write_images(tmp_path / "rgb" / "train", 4, size=(32, 32), rgb=True)
    write_images(tmp_path / "rgb" / "test", 4, size=(32, 32), rgb=True, seed=9)
    (x,) = batches(datasets.make_dataset("cifar10", "train", tmp_path / "rgb", 4, shuffle=False))
    k = np.stack([rgb[name] for name in sorted(rgb)]).astype(np.float32)
    np.testing.assert_array_equal(x, k / np.float32(127.5) - np.float32(1))
    assert x.min() >= -1 and x.max() <= 1

    write_images(tmp_path / "big" / "train", 4, size=(64, 64), rgb=True)
    write_images(tmp_path / "big" / "test", 1, size=(64, 64), rgb=True)
    with pytest.raises(ValueError, match=r"64x64 pixels.*resize"):
        datasets.make_dataset("cifar10", "test", tmp_path / "big")
    (x,) = batches(datasets.make_dataset("cifar10", "test", tmp_path / "big", 4, resize_images=True))
    assert x.shape == (1, 32, 32, 3)
    with pytest.raises(ValueError, match=r"Received: resize_images=1"):
        datasets.make_dataset("cifar10", "test", tmp_path / "big", resize_images=1)


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


# The folder is read with NumPy and Pillow; the training and scoring it
# feeds are tested on each backend in test_cli and test_evaluation.
run_on_tensorflow = backend_independent("image folders are read with NumPy and Pillow")


@pytest.mark.slow
@run_on_tensorflow
def test_train_and_evaluate_on_an_image_folder(tmp_path, capsys):
    data = tmp_path / "digits"
    written = write_images(data, 60)
    write_images(data, 4, size=(56, 56), prefix="large")
    out = tmp_path / "run"
    train = ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--epochs", "1"]
    train += ["--steps-per-epoch", "2", "--batch-size", "4", "--verbose", "0"]
    train += sets(TINY_SETS + ["warmup_epochs=1", "kl_warmup_epochs=1"])
    # The 56x56 images: refused, in one line naming one, until --resize-images.
    status, _, err = run_main(train, capsys)
    assert status == 2
    assert_one_line_error(err, "ValueError", "large_", "56x56", "28x28", "--resize-images")
    status, _, err = run_main(train + ["--resize-images"], capsys)
    assert status == 0, err
    run = json.loads((out / "run.json").read_text())
    assert run["data"]["source"] == "image_folder" and run["data"]["resize_images"] is True

    evaluate = ["evaluate", "mnist-baseline-small", "--weights", str(out / "model.weights.h5")]
    evaluate += ["--data-dir", str(data), "--num-samples", "2", "--batch-size", "2", "--resize-images"]
    status, printed, err = run_main(evaluate + sets(TINY_SETS), capsys)
    assert status == 0, err
    result = json.loads(printed)
    test_images = len(datasets.read_image_folder(data, "test", "grey", resize=True)[0])
    assert 0 < result["num_examples"] == test_images < len(written) + 4
    assert math.isfinite(result["nll_nats"]) and result["nll_nats"] > 0

    # run.json records the training images: a resume on changed files is
    # refused, naming the entry; on the files it trained on, it goes on.
    more = [arg if arg != "1" else "2" for arg in train] + ["--resize-images"]
    write_images(data, 60, seed=1)
    status, _, err = run_main(more, capsys)
    assert status == 2
    assert_one_line_error(err, "data.train_images_sha256", "not the images the run trained on")
    write_images(data, 60)
    status, _, err = run_main(more, capsys)
    assert status == 0, err
    assert json.loads((out / "run.json").read_text())["epochs"] == 2


@pytest.mark.slow
@run_on_tensorflow
def test_train_decodes_each_image_once_also_when_resumed(tmp_path, capsys, monkeypatch):
    # Before: a run decoded every file twice (the images counted and hashed,
    # then the dataset), a resumed run three times (the stream's start and
    # the batch it resumes at).
    from keras_avae.datasets import image_folder

    data = tmp_path / "digits"
    write_images(data, 20)
    decoded = []
    read_image = image_folder._read_image

    def counting_read_image(file, *args, **kwargs):
        decoded.append(file)
        return read_image(file, *args, **kwargs)

    monkeypatch.setattr(image_folder, "_read_image", counting_read_image)
    train_files = len(datasets.read_image_folder(data, "train", "grey")[0])
    out = tmp_path / "run"
    train = ["train", "mnist-baseline-small", "--data-dir", str(data), "--output", str(out), "--epochs", "1"]
    train += ["--steps-per-epoch", "2", "--batch-size", "4", "--verbose", "0"]
    train += sets(TINY_SETS + ["warmup_epochs=1", "kl_warmup_epochs=1"])
    for epochs in ("1", "2"):  # a new run, then a resumed one
        decoded.clear()
        status, _, err = run_main([arg if arg != "1" else epochs for arg in train], capsys)
        assert status == 0, err
        assert len(decoded) == len(set(decoded)) == train_files, f"{len(decoded)} decodes of {train_files} files"
    assert json.loads((out / "run.json").read_text())["epochs"] == 2
