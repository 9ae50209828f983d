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
# training step frees its activations; the child prints the minor page
# faults of ten steps after a first one.
_FAULTS_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    from keras_avae import host_memory

    applied = host_memory.keep_freed_host_memory()

    def step():
        blocks = [torch.ones(1 << 20) for _ in range(16)]
        del blocks

    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
    """
)


def _faults_per_step(keep):
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=ROOT)
    env[host_memory.OPT_OUT_VARIABLE] = "1" if keep else "0"
    proc = subprocess.run(
        [sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied, faults = proc.stdout.split()[-2:]
    return applied == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
@pytest.mark.skipif(BACKEND != "torch", reason="the setting is for eager PyTorch; its suite runs the check once")
def test_freed_blocks_are_reused_without_page_faults():
    applied, kept = _faults_per_step(keep=True)
    opted_out, default = _faults_per_step(keep=False)
    assert applied and not opted_out
    # glibc as it starts hands the freed tensors back to the system and
    # faults them in again (about 3,300 faults a step here); with the
    # thresholds raised they stay in the heap.
    assert default > 1000, default
    assert kept < 0.5 * default, (kept, default)


def test_opt_out_variable_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv(host_memory.OPT_OUT_VARIABLE, "0")
    host_memory.keep_freed_host_memory.cache_clear()
    try:
        assert host_memory.keep_freed_host_memory() is False
    finally:
        host_memory.keep_freed_host_memory.cache_clear()


def test_compile_keeps_freed_memory_on_pytorch_without_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_host_memory", lambda: calls.append(True))
    model = HierarchicalVAE(**TINY)
    model.compile(optimizer=keras.optimizers.Adamax(1e-3))
    on_cpu_torch = BACKEND == "torch" and not _torch_cuda()
    assert calls == ([True] if on_cpu_torch else [])


def _torch_cuda():
    import torch

    return torch.cuda.is_available()
