"""`keep_freed_host_memory` keeps freed blocks in the process, and training on PyTorch uses it."""

import os
import subprocess
import sys
import textwrap

import keras
import pytest

from keras_avae import host_memory
from keras_avae.models.hierarchical_vae import HierarchicalVAE
from tests.models.test_hierarchical_vae import TINY
from tests.test_case import BACKEND

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One "step" allocates sixteen 4 MiB tensors and frees them, as an eager
# training step frees its activations. The child prints whether the setting
# was taken, the free bytes glibc keeps in its heap after the first step
# (`mallinfo2().fordblks`), and the minor page faults per step of the next ten.
_FAULTS_SCRIPT = textwrap.dedent(
    """
    import ctypes, resource
    import torch
    from keras_avae import host_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    applied = host_memory.keep_freed_host_memory()

    def step():
        blocks = [torch.ones(1 << 20) for _ in range(16)]
        del blocks

    step()
    kept_bytes = libc.mallinfo2().fordblks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(applied, kept_bytes, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
    """
)


def _run_steps(keep):
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT)
    env[host_memory.OPT_OUT_VARIABLE] = "1" if keep else "0"
    proc = subprocess.run(
        [sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied, kept_bytes, faults = proc.stdout.split()[-3:]
    return applied == "True", int(kept_bytes), float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
@pytest.mark.skipif(BACKEND != "torch", reason="the setting is for eager PyTorch; its suite runs the check once")
def test_freed_blocks_stay_in_the_heap_and_stop_faulting():
    applied, kept_bytes, kept_faults = _run_steps(keep=True)
    opted_out, _, default_faults = _run_steps(keep=False)
    assert applied and not opted_out
    # The step's 64 MiB stay in the heap for the next step...
    assert kept_bytes >= 64 * 2**20, kept_bytes
    # ...which no longer faults its pages in again. glibc as it starts
    # gives them back to the system: 1,700-3,400 faults a step measured
    # here, against 300-700 with the setting.
    assert default_faults > 1000, default_faults
    assert kept_faults < 0.6 * default_faults, (kept_faults, default_faults)


def test_opt_out_variable_leaves_malloc_alone(monkeypatch):
    opened = []
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *args: opened.append(args))
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "0")
    host_memory.keep_freed_host_memory.cache_clear()
    try:
        assert host_memory.keep_freed_host_memory() is False
    finally:
        host_memory.keep_freed_host_memory.cache_clear()
    assert opened == []  # the C library was not even opened


def test_training_function_keeps_freed_memory_on_pytorch_without_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_host_memory", lambda: calls.append(True))
    model = HierarchicalVAE(**TINY)  # unbuilt: only the function is made
    model.compile(optimizer=keras.optimizers.Adamax(1e-3))
    assert calls == []  # compiling alone changes nothing
    model.make_train_function()
    model.make_train_function()  # made once: no second call
    on_cpu_torch = BACKEND == "torch" and not _torch_cuda()
    assert calls == ([True] if on_cpu_torch else [])


def _torch_cuda():
    import torch

    return torch.cuda.is_available()
