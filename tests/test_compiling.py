"""kvpipe's compiled functions compile in the calling process (executor/engine/compiling.py): inductor's
worker pool (16 processes importing torch on a 16-core host) must not start under a run."""
import os

import pytest
import torch
import torch._inductor.config as inductor_config

from kvpipe.executor.engine import compiling
from kvpipe.executor.layers import fused
from kvpipe.executor.quant import blocks


def child_pids() -> list[int]:
    """This process's child processes (Linux /proc; [] where it has none to read)."""
    kids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


@pytest.fixture
def pool_default(monkeypatch):
    """inductor's default pool size, as on a 16-core machine, and the memoised compiles cleared."""
    monkeypatch.delenv(compiling.THREADS_ENV, raising=False)
    old = inductor_config.compile_threads   # a ConfigModule: monkeypatch's undo would delete the entry
    inductor_config.compile_threads = 16
    fused.compiled.cache_clear()
    blocks.compiled_records.cache_clear()
    yield
    inductor_config.compile_threads = old
    fused.compiled.cache_clear()
    blocks.compiled_records.cache_clear()


def test_fused_pieces_compile_in_process(pool_default):
    """Catches: fused.compiled calling torch.compile directly (the pool of 16 would start)."""
    fused.compiled("norm", True)
    assert inductor_config.compile_threads == 1


def test_dequantise_compiles_in_process(pool_default):
    """Catches: blocks.compiled_records calling torch.compile directly."""
    blocks.compiled_records()
    assert inductor_config.compile_threads == 1


def test_uncompiled_pieces_leave_inductor_alone(pool_default):
    """Catches: the setting applied where nothing is compiled (`--fuse off` on CPU)."""
    fused.compiled("norm", False)
    assert inductor_config.compile_threads == 16


def test_the_users_thread_count_is_kept(pool_default, monkeypatch):
    """Catches: overriding a TORCHINDUCTOR_COMPILE_THREADS the user set."""
    monkeypatch.setenv(compiling.THREADS_ENV, "4")
    fused.compiled("norm", True)
    assert inductor_config.compile_threads == 16   # inductor read the env at import; we leave it


@pytest.mark.gpu
def test_no_compile_workers_after_a_cuda_compile(pool_default):
    """Catches: a Triton compile on CUDA starting inductor's worker pool (child processes)."""
    before = set(child_pids())
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    fused.compiled("norm", True)(x, w, 1e-5)
    torch.cuda.synchronize()
    assert set(child_pids()) - before == set()
