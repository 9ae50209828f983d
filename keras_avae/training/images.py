"""PNG grids of images: samples, images and reconstructions, one row each."""

import io

import numpy as np
import PIL.Image
from keras import ops

from keras_avae.training.atomic_files import _atomic_write


def encode_png(image):
    """PNG bytes of a uint8 image `(H, W)`, `(H, W, 1)` or `(H, W, 3)` (Pillow).

    8-bit grey for one channel, 8-bit RGB for three.

    Example:

    >>> encode_png(np.zeros((2, 3), "uint8"))[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"`image` must be uint8. Received: image.dtype={image.dtype}")
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] == 3)):
        raise ValueError(f"`image` must be (H, W), (H, W, 1) or (H, W, 3). Received: image.shape={image.shape}")
    buffer = io.BytesIO()
    # A uint8 (H, W) array is mode "L" (8-bit grey), (H, W, 3) mode "RGB".
    PIL.Image.fromarray(np.ascontiguousarray(image)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_grid(rows, padding=1, value_range=(0.0, 1.0)):
    """Tiles rows of images `[(N, H, W, C), ...]` into one uint8 image.

    Values are mapped from `value_range` to 0-255 and clipped.

    Example:

    >>> image_grid([np.zeros((2, 4, 4, 1))], padding=1).shape  # 1 row of 2
    (6, 11, 1)
    """
    rows = [np.asarray(ops.convert_to_numpy(r), dtype="float32") for r in rows]
    low, high = value_range
    columns = max(len(r) for r in rows)
    _, h, w, c = rows[0].shape
    grid = np.full((len(rows) * (h + padding) + padding, columns * (w + padding) + padding, c), 255, "uint8")
    for i, row in enumerate(rows):
        scaled = np.clip((row - low) / (high - low), 0.0, 1.0)
        scaled = np.nan_to_num(scaled, nan=0.0)
        for j, image in enumerate(scaled):
            top, left = padding + i * (h + padding), padding + j * (w + padding)
            grid[top : top + h, left : left + w] = np.round(image * 255.0).astype("uint8")
    return grid


def save_image_grid(path, rows, padding=1, value_range=(0.0, 1.0)):
    """Writes `image_grid(rows)` as a PNG file (atomically).

    Args:
        path: the `.png` file.
        rows: list of image batches `(N, H, W, C)`, C = 1 or 3, one grid row each.
        padding: white pixels between images.
        value_range: `(low, high)` of the pixel values.

    Example:

    >>> save_image_grid("/tmp/grid.png", [np.random.rand(4, 8, 8, 1)])  # doctest: +SKIP
    """
    data = encode_png(image_grid(rows, padding=padding, value_range=value_range))

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    _atomic_write(path, write)
