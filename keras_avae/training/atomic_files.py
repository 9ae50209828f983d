"""Atomic file writes: a temporary file, fsync, then a rename.

Readers (and a run resumed after a kill at any moment) see the old file or
the new one, never half of one.
"""

import glob
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


def _temporary_name(path, pid):
    # Ends with the file's own name: Keras insists on the extension (`.weights.h5`, `.keras`).
    return f".tmp-{pid}-{path.name}"


def _process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def _remove_stale_temporaries(path):
    """Deletes the temporaries of `_atomic_write(path, ...)` whose writer is gone.

    A kill in the middle of a write leaves `.tmp-PID-NAME` beside `path`
    (as large as the file it was to become); the next run over the same
    files removes them. A temporary of a live process is kept.
    """
    path = pathlib.Path(path)
    if not path.parent.is_dir():
        return
    for tmp in path.parent.glob(f".tmp-*-{glob.escape(path.name)}"):
        pid = tmp.name[len(".tmp-") :].split("-", 1)[0]
        if pid.isdigit() and tmp.name == _temporary_name(path, pid) and not _process_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _atomic_write(path, write):
    """Writes `path` by `write(tmp)` then a rename: readers see old or new, never half."""
    path = pathlib.Path(path)
    tmp = path.with_name(_temporary_name(path, os.getpid()))
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

    _atomic_write(path, write)
