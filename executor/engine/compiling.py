"""torch.compile for kvpipe's few small compiled functions (executor/layers/fused.py, executor/quant/store.py),
with inductor compiling in THIS process instead of its worker pool.

Inductor's default (torch 2.11-2.13, with Triton) starts a pool of min(32, CPU count) compile
worker processes at the first compile, each importing torch, wakes it again at every later
compile and quiesces it after 60 s idle. kvpipe compiles a handful of elementwise kernels, so the
pool buys little, and its start-up burst (16 processes importing torch on the H200 test machine's
16 cores) runs while the host issues the next timed stages: the host-bound prefill rows of
benchmarks/sim_check.py measured up to 1.6x slower in the row after a compile than in other
processes (benchmarks/SIMMODEL.md). The workers' resident memory also counts against the host
budget the pinned KV homes need. The cost: the compile itself is serial, once per process (the H200's
first warm-up of a sim_check process 9.6 s, against 5.9 s with the pool). A user who sets
TORCHINDUCTOR_COMPILE_THREADS keeps their setting. The setting is process-wide: other torch.compile
calls in the same process compile in-process too."""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def in_process() -> None:
    """Make inductor compile in the calling process (compile_threads 1), unless the user chose a
    count in THREADS_ENV. Before the first compile: the pool is started at the first one."""
    if os.environ.get(THREADS_ENV):
        return
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = 1


def compile_fn(fn: Callable, **kwargs) -> Callable:
    """torch.compile(fn, **kwargs), compiled in this process (`in_process`)."""
    in_process()
    return torch.compile(fn, **kwargs)
