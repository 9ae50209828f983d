"""Your own images: a folder of PNG/JPEG files read as a data set's split.

`read_image_folder` returns `(images, labels)` in the format of the reader
it stands in for, so `make_dataset` binarises, pads and scales them exactly
as it does MNIST, OMNIGLOT or CIFAR-10:

- `kind="grey"` (the MNIST and OMNIGLOT entries, Bernoulli pixels):
  float32 `(N, 28, 28, 1)`, grey levels `brightness / 255` in [0, 1];
- `kind="rgb"` (the CIFAR-10 entries, logistic-mixture pixels): uint8
  `(N, 32, 32, 3)`, RGB 0-255.

Layouts: `path/train/` and `path/test/` (each flat or holding class
subfolders), or a flat folder, or a folder of class subfolders; the last two
are split by file (about 10% of the files go to `"test"`, chosen by a hash of
their path, so the split is stable when files are added). Files are the
`.png`, `.jpg` and `.jpeg` ones (any case), searched recursively; names
starting with `.` (hidden files and folders) are skipped, and so are images
of other formats (`.webp`, `.bmp`, `.tif`, ...), with a logged warning.
A subfolder that cannot be listed is an error, not a folder left out.
"""

import hashlib
import logging
import os
import pathlib

import numpy as np
import PIL.Image
import PIL.ImageOps

from keras_avae.datasets.common import _check_split

_SUFFIXES = (".png", ".jpg", ".jpeg")
# Images of other formats, which are not read: a warning names them. So are
# JPEG and PNG files under the other names they go by (Windows saves JPEGs
# as `.jfif`), which would otherwise be left out without a word.
_OTHER_SUFFIXES = (
    ".bmp", ".gif", ".webp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jp2", ".jxl", ".pgm", ".ppm", ".pbm",
    ".jfif", ".jpe", ".jif", ".apng",
)
# What Pillow calls the formats read (MPO: a camera's JPEG with extra frames).
_FORMATS = ("PNG", "JPEG", "MPO")
# kind -> (width, height, channels) of the reader it stands in for.
_KINDS = {"grey": (28, 28, 1), "rgb": (32, 32, 3)}
# The share of the files the hash split sends to "test".
_TEST_FRACTION = 0.1
# Folder names (lower case) read as a split: anything else is a class.
_SPLIT_NAMES = {"train": "train", "training": "train", "test": "test", "testing": "test"}
# Modes Pillow gives 16-bit grey images (`convert` would clip them to 255).
_SIXTEEN_BIT = ("I", "I;16", "I;16B", "I;16L", "I;16N")

logger = logging.getLogger("keras_avae.datasets")


def _walk_image_files(folder, suffixes=_SUFFIXES):
    """Yields the relative POSIX paths of the files under `folder` named `*suffixes`, hidden names skipped.

    Symlinked folders are followed (class folders are often links); a link
    to a folder the walk is already inside (a cycle) is not. A folder that
    cannot be listed is an error: `os.walk` alone would leave its images out
    without a word. A `folder` that does not exist holds no files.
    """
    if not os.path.isdir(folder):
        return

    def refuse(error):
        raise OSError(
            f"{error.filename}: this folder cannot be listed ({error.strerror or error}), so its images would be "
            f"left out. Make it readable, or move it out of {folder}. Received: path={str(folder)!r}"
        ) from error

    # Each folder's real path and those of the folders above it in the walk.
    chains = {str(folder): {os.path.realpath(folder)}}
    for directory, subfolders, files in os.walk(folder, onerror=refuse, followlinks=True):
        chain = chains.pop(directory)
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        for d in list(subfolders):
            real = os.path.realpath(os.path.join(directory, d))
            if real in chain:
                subfolders.remove(d)
            else:
                chains[os.path.join(directory, d)] = chain | {real}
        rel = pathlib.PurePosixPath(pathlib.Path(directory).relative_to(folder).as_posix())
        yield from (rel / f for f in files if not f.startswith(".") and f.lower().endswith(suffixes))


def _image_files(folder):
    """The image files under `folder` (relative paths), sorted."""
    return sorted(_walk_image_files(folder), key=lambda p: p.parts)


def _has_images(folder):
    """Whether `folder` holds an image file, directly or in a subfolder (stops at the first)."""
    return next(_walk_image_files(folder), None) is not None


def _in_test_split(relative_path):
    """The hash split: SHA-1 of the path relative to the folder, in the first 10% of the range."""
    # `os.fsencode`: the name's bytes, also for names that are not UTF-8.
    digest = hashlib.sha1(os.fsencode(str(relative_path))).digest()
    return int.from_bytes(digest[:4], "big") < _TEST_FRACTION * 2**32


def _split_folders(root):
    """The subfolders of `root` that name a split, any case: `{"train": [...], "test": [...]}`."""
    found = {"train": [], "test": []}
    for entry in sorted(root.iterdir()):
        name = entry.name.lower()
        if entry.is_dir() and not entry.name.startswith(".") and name in _SPLIT_NAMES:
            found[_SPLIT_NAMES[name]].append(entry.name)
    return found


def _check_no_duplicates(folder, files):
    """Raises if two of `files` are one file on disk (reached through a link): it would be read twice."""
    seen = {}
    for f in sorted(files, key=lambda p: p.parts):
        real = os.path.realpath(folder / f)
        if real in seen:
            raise ValueError(
                f"{folder}: {seen[real]} and {f} are the same file (through a symbolic link), so it would be "
                f"read twice, possibly into both splits. Remove one of the links."
            )
        seen[real] = f


def _split_files(root, split):
    """`(folder, files, classes)`: the split's folder, its image files relative to it, the class names."""
    found = _split_folders(root)
    if found["train"] or found["test"]:
        if found != {"train": ["train"], "test": ["test"]}:
            names = found["train"] + found["test"]
            if names in (["train"], ["test"]):
                problem = f"has a {names[0]}/ folder but no {'test' if names == ['train'] else 'train'}/ folder"
            else:
                problem = f"has the split folders {', '.join(n + '/' for n in names)}"
            raise ValueError(
                f"{root} {problem}. Use both train/ and test/ (these names, lower case), or neither (a flat "
                f"folder or class subfolders, split by file hash). Received: path={str(root)!r}"
            )
        _check_nothing_beside_splits(root)
        files = _image_files(root / split)
        if not files:
            raise ValueError(f"{root / split}: no image files ({', '.join(_SUFFIXES)}) for the {split} split.")
        other = "test" if split == "train" else "train"
        others = _image_files(root / other)
        _check_no_duplicates(root, [split / f for f in files] + [other / f for f in others])
        return root / split, files, sorted({_class_of(f) for f in files + others})
    every = _image_files(root)
    _check_no_duplicates(root, every)
    if not every:
        raise ValueError(f"{root}: no image files ({', '.join(_SUFFIXES)}). Received: path={str(root)!r}")
    files = [f for f in every if _in_test_split(f) == (split == "test")]
    if not files:
        raise ValueError(
            f"{root}: none of its {len(every)} image files falls in the {split} split (about "
            f"{_TEST_FRACTION:.0%} go to test, by a hash of the file path). Add images, or put them in "
            f"train/ and test/ subfolders. Received: path={str(root)!r}, split={split!r}"
        )
    return root, files, sorted({_class_of(f) for f in every})


def _first_five(paths):
    """`paths` for a message: the first five, then a count of the others."""
    shown = ", ".join(str(p) for p in paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _check_nothing_beside_splits(root):
    """Raises for images beside `train/` and `test/`: neither split would read them."""
    stray = [
        entry.name + ("/" if entry.is_dir() else "")
        for entry in sorted(root.iterdir())
        if not entry.name.startswith(".")
        and entry.name not in ("train", "test")
        and (_has_images(entry) if entry.is_dir() else entry.name.lower().endswith(_SUFFIXES))
    ]
    if stray:
        shown = _first_five(stray)
        raise ValueError(
            f"{root} holds images outside its train/ and test/ folders, which neither split reads: {shown}. "
            f"Move them into train/ or test/, or out of the folder. Received: path={str(root)!r}"
        )


def _class_of(relative_path):
    """The class subfolder (the first folder of the path), `""` for a file directly in the folder."""
    return relative_path.parts[0] if len(relative_path.parts) > 1 else ""


def _check_opaque(image, file, sixteen_bit_rgb=False):
    """Raises for transparent pixels: without its alpha channel the image is only the colours under it.

    Ink drawn in the alpha channel (a common way to save glyphs) over black
    pixels would load as a blank image, so no background is guessed.
    `sixteen_bit_rgb`: the file is a 16-bit RGB PNG (Pillow reads its levels'
    high bytes).
    """
    if not (image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info):
        return
    if image.mode in _SIXTEEN_BIT:
        # A 16-bit grey PNG's transparency is one grey level (its tRNS
        # chunk); `convert("RGBA")` would first clip the levels to 255.
        transparent = np.asarray(image) == image.info["transparency"]
    elif sixteen_bit_rgb and isinstance(image.info.get("transparency"), tuple):
        # A 16-bit RGB PNG's transparent colour is 16-bit, its pixels as read
        # 8-bit: `convert("RGBA")` matches no pixel. Their high bytes are
        # compared (pixels within 1/256 of the colour count too).
        key = np.asarray(image.info["transparency"]) >> 8
        transparent = np.all(np.asarray(image) == key, axis=-1)
    else:
        transparent = np.asarray(image.convert("RGBA").getchannel("A")) < 255
    if transparent.any():
        raise ValueError(
            f"{file}: {np.count_nonzero(transparent)} of its {transparent.size} pixels are transparent, and the "
            f"image's pixels without the alpha channel may not be what it shows. Flatten it onto the "
            f"background you want first, e.g. `PIL.Image.alpha_composite(PIL.Image.new('RGBA', image.size, "
            f"'white'), image.convert('RGBA')).convert('RGB')`."
        )


def _read_image(file, kind, resize):
    """One image as float32 `(28, 28)` in [0, 1] (grey) or uint8 `(32, 32, 3)` (rgb)."""
    width, height, _ = _KINDS[kind]
    try:
        with PIL.Image.open(file) as image:
            found = image.format
            frames = getattr(image, "n_frames", 1)  # Before `exif_transpose`, whose copy has one frame.
            # Before `load`, which clears the tile (its raw mode: the bit depth).
            sixteen_bit_rgb = found == "PNG" and bool(image.tile) and image.tile[0][3] == "RGB;16B"
            image = PIL.ImageOps.exif_transpose(image)  # Camera JPEGs: as they are shown.
            image.load()
    except Exception as e:
        raise ValueError(f"{file}: not a readable PNG/JPEG image ({type(e).__name__}: {e}).") from e
    if found not in _FORMATS:
        # Pillow opens any format whatever the name says; others (float or
        # 32-bit TIFFs) would not convert to grey levels and bytes as below.
        raise ValueError(f"{file}: a {found} file, not a PNG/JPEG image. Convert it to PNG.")
    # An animated PNG would be read as its first frame alone. An MPO's
    # first image is the photo itself (its others: a preview, a second view).
    if frames > 1 and found != "MPO":
        raise ValueError(
            f"{file}: an animated {found} image of {frames} frames, and only its first frame would be read. "
            f"Save the frames you want as still PNG files first (`PIL.ImageSequence.Iterator(image)` "
            f"yields them)."
        )
    _check_opaque(image, file, sixteen_bit_rgb)
    if image.size != (width, height) and not resize:
        raise ValueError(
            f"{file}: the image is {image.size[0]}x{image.size[1]} pixels but the {kind} entries need "
            f"{width}x{height} (width x height). Pass resize=True (`resize_images=True` to `load` and "
            f"`make_dataset`, `--resize-images` on the command line) to resize every image to "
            f"{width}x{height}, or resize the files."
        )
    # Area averaging when shrinking (as OMNIGLOT's 105 -> 28), Lanczos when enlarging.
    shrinking = image.size[0] >= width and image.size[1] >= height
    resample = PIL.Image.Resampling.BOX if shrinking else PIL.Image.Resampling.LANCZOS
    if kind == "grey":
        if image.mode in _SIXTEEN_BIT:
            grey = np.asarray(image, dtype=np.float32) / np.float32(65535)
        else:
            grey = np.asarray(image.convert("L"), dtype=np.float32) / np.float32(255)
        if image.size != (width, height):
            resized = PIL.Image.fromarray(grey).resize((width, height), resample)
            grey = np.clip(np.asarray(resized, dtype=np.float32), 0.0, 1.0)
        return grey
    if image.mode in _SIXTEEN_BIT:
        image = PIL.Image.fromarray(np.round(np.asarray(image, dtype=np.float64) / 257).astype(np.uint8))
    image = image.convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), resample)
    return np.asarray(image, dtype=np.uint8)


def _raise_refused(refused, total):
    """Raises the first refused file's error, naming the others: one run finds every bad file."""
    (_, first), others = refused[0], [f for f, _ in refused[1:]]
    if not others:
        raise first
    shown = _first_five(others)
    count = f"{len(refused)} of the {total} images"
    raise ValueError(f"{first} In all, {count} are refused: this one and {shown}.") from first


def read_image_folder(path, split, kind, resize=False):
    """Reads a split of a folder of your own PNG/JPEG images.

    Layouts:

    - `path/train/` and `path/test/`: the split is its folder (searched
      recursively). Other spellings of the split folders (`Train/`,
      `testing/`, ...) are refused rather than read as classes, and so are
      images beside the two folders (neither split would read them).
    - Otherwise (a flat folder, or a folder of class subfolders), every image
      file is assigned to a split by the SHA-1 hash of its path relative to
      `path`: about 10% go to `"test"`, the rest to `"train"`. The split is
      deterministic and stays the same for every file when files are added
      (renaming or moving a file may move it to the other split).

    Files are `.png`, `.jpg` and `.jpeg` (any case), in sorted path order;
    names starting with `.` are skipped, and a file reached twice (through a
    symbolic link) is refused. Images under other names (`.webp`, `.bmp`,
    a JPEG named `.jfif`, ...) are not read; a logged warning names them.
    JPEG EXIF rotations are applied; an image with transparent pixels is
    refused (flatten it onto a background first), a fully opaque alpha
    channel is dropped; an animated PNG
    (several frames) is refused, while a camera's MPO JPEG is read as its
    first image, the photo itself. Grey levels are the brightness (`convert("L")`,
    16-bit images scaled by 65535): bright = 1, as MNIST's white strokes on
    black, so invert black-on-white scans first (e.g.
    `PIL.ImageOps.invert`). Images must have the target size (28x28 grey,
    32x32 RGB) unless `resize=True`, which resizes them (stretched, not
    cropped: area averaging when shrinking, Lanczos when enlarging).

    Args:
        path: the folder.
        split: `"train"` or `"test"`.
        kind: `"grey"` for the MNIST and OMNIGLOT entries (binarised to
            Bernoulli pixels by `make_dataset`) or `"rgb"` for the CIFAR-10
            entries (scaled to [-1, 1]).
        resize: bool; resize images of another size instead of raising.

    Returns:
        `(images, labels)`: float32 `(N, 28, 28, 1)` grey levels in [0, 1]
        (`kind="grey"`) or uint8 `(N, 32, 32, 3)` RGB 0-255 (`kind="rgb"`),
        and int64 `(N,)` labels: the index of the image's class subfolder
        (its first folder below the split's folder) among the sorted class
        names of both splits, files directly in the folder counting as a
        class named `""` (so without subfolders every label is 0).

    Raises:
        FileNotFoundError: `path` is not a directory.
        ValueError: a file that is not a readable PNG/JPEG image (whatever its
            name), an animated PNG, an image with transparent pixels, an
            image of another size (without `resize`), or a split without
            images; the message names the file or folder (the first bad
            file's reason, and every other bad file by name).

    Example:

    >>> images, labels = read_image_folder("my_digits", "train", "grey")  # doctest: +SKIP
    >>> images.shape, images.dtype                                        # doctest: +SKIP
    ((1800, 28, 28, 1), dtype('float32'))
    """
    _check_split(split)
    if kind not in _KINDS:
        raise ValueError(f"`kind` must be one of {tuple(_KINDS)}. Received: kind={kind!r}")
    if not isinstance(resize, (bool, np.bool_)):
        raise ValueError(f"`resize` must be a bool. Received: resize={resize!r}")
    root = pathlib.Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"`path` is not a directory. Received: path={str(path)!r}")
    folder, files, classes = _split_files(root, split)
    # A folder of PNG and WebP files would otherwise train on the PNGs alone
    # without a word. The whole folder: WebP files beside train/ and test/ too.
    skipped = sorted(_walk_image_files(root, _OTHER_SUFFIXES), key=lambda p: p.parts)
    if skipped:
        shown = _first_five(skipped)
        logger.warning(
            "%s: skipped %d image file(s) of formats other than PNG/JPEG, or named other than %s, which are "
            "not read: %s. Convert them to PNG (rename a .jfif or .jpe JPEG to .jpg) to use them.",
            root, len(skipped), "/".join(_SUFFIXES), shown
        )
    # Filled in place: a list of the images and its `np.stack` held two
    # copies of a large folder at once.
    width, height, channels = _KINDS[kind]
    images = np.empty((len(files), height, width, channels), np.float32 if kind == "grey" else np.uint8)
    refused = []
    for i, f in enumerate(files):
        try:
            images[i] = _read_image(folder / f, kind, resize).reshape(height, width, channels)
        except ValueError as error:
            refused.append((folder / f, error))
    if refused:
        _raise_refused(refused, len(files))
    index = {name: i for i, name in enumerate(classes)}
    labels = np.array([index[_class_of(f)] for f in files], dtype=np.int64)
    return images, labels
