"""torch.compile for kvpipe's few small compiled functions (executor/layers/fused.py, executor/quant/blocks.py),
with inductor compiling in THIS process instead of its worker pool.

Inductor's default (with Triton) starts a pool of min(32, CPU count) compile worker processes at
the first compile, each importing torch, wakes it again at every later compile and quiesces it
after 60 s idle. kvpipe compiles a handful of elementwise kernels, so the pool buys little, and
its start-up burst (a process per core importing torch) runs while the host issues the next timed
stages, slowing the host-bound ones after a compile. The workers' resident memory also counts
against the host budget the pinned KV homes need. The cost: the compile itself is serial, once
per process. A user who sets TORCHINDUCTOR_COMPILE_THREADS keeps their setting. The setting is process-wide: other torch.compile
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
