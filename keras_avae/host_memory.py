"""Keep freed host memory for the next training step (glibc's malloc).

Eager PyTorch frees every activation of a training step and allocates it
again in the next. glibc's malloc serves blocks above its mmap threshold
with fresh `mmap` pages and gives the top of its heap back to the system
above its trim threshold, so each step page-faults and the kernel zeroes
the same memory again: about 8,000-8,700 minor faults and 18-19 ms of
system time per `mnist-baseline-small` step at batch 32 on the 2-core
development CPU, 6,500 per `mnist-attentive-small` step. With both
thresholds raised the pages stay in the process (about 1-100 faults a
step; peak resident memory 1,054 -> 1,076 MiB for attentive-small). This
is the in-process form of what PyTorch's CPU tuning guide gets by
preloading jemalloc or tcmalloc.

A keras-avae model applies it when it makes its training function (the
first `fit` or `train_on_batch`) on PyTorch without CUDA. TensorFlow pools
its own buffers (about 170 faults a baseline step). JAX's XLA allocates a
151 MiB temporary buffer per baseline step on its worker threads, which
glibc serves with `mmap` whatever these thresholds say (38,700 faults a
step either way). Only glibc tunables set before the process starts keep
that buffer, all threads in one arena and no `mmap`:
`GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647`
(870 faults, 234 -> 220 ms a step in one measurement).

Set the environment variable `KERAS_AVAE_KEEP_FREED_MEMORY=0` to leave
malloc as it is (the process then returns freed memory to the system as
before).
"""

import ctypes
import functools
import os
import sys

OPT_OUT_VARIABLE = "KERAS_AVAE_KEEP_FREED_MEMORY"
# Parameter numbers of `mallopt` in glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit systems: blocks up to 32 MiB
# come from the heap (one batch-32 activation of the small entries is 2 MiB).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory kept at the top of the heap before it goes back to the system.
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


@functools.cache
def keep_freed_host_memory():
    """Raises glibc malloc's mmap and trim thresholds, once per process.

    Returns:
        `True` when glibc took both settings; `False` where there is no
        glibc (macOS, Windows, musl), where `mallopt` refused them, or when
        `KERAS_AVAE_KEEP_FREED_MEMORY` is `"0"`.

    Example:

    >>> isinstance(keep_freed_host_memory(), bool)
    True
    """
    if os.environ.get(OPT_OUT_VARIABLE, "1").strip() == "0":
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on
    except OSError:
        return False
    # Only glibc has `gnu_get_libc_version`; musl's `mallopt` does nothing.
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    # `mallopt` returns 1 on success and 0 for a value out of its range.
    mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_set = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_set and trim_set
