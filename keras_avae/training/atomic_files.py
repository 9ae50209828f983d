"""Atomic file writes: a temporary file, fsync, then a rename.

Readers (and a run resumed after a kill at any moment) see the old file or
the new one, never half of one.
"""

import os
import pathlib


def _fsync(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path, write, suffix):
    """Writes `path` by `write(tmp)` then a rename: readers see old or new, never half.

    `suffix` is the extension Keras insists on (the temporary name keeps it).
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name[: -len(suffix)]}{suffix}")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync(path.parent)


def _atomic_write_text(path, text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    _atomic_write(path, write, pathlib.Path(path).suffix)
