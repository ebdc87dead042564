"""CUDA-graph semantics on CPU, for tests of code that captures a step: `TapeGraphs.capture(fn)`
records every aten op `fn` issues (a TorchDispatchMode) with the very tensors it read and wrote;
`replay()` re-issues those ops on those tensors, writing each freshly made result into the tensor
the capture made, and runs no Python of `fn`. So, as with a graph: host values read at capture are
baked in, Python state set at capture is not set again, and the outputs are the capture's tensors.
A host sync inside the step (`.item()`, `bool(t)`) raises, as it would under capture."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_SYNCS = {"_local_scalar_dense", "item", "is_nonzero"}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNCS:
            raise RuntimeError(f"graph tape: {func} is a host sync inside a captured step")
        out = func(*args, **kwargs)
        if name not in _UNINITIALISED:
            self.ops.append((func, args, kwargs, out))
        return out


class TapeGraph:
    """The ops of one captured call, re-issued by `replay()`."""

    def __init__(self, ops: list) -> None:
        self.ops = ops

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for o, f in zip(tree_leaves(out), tree_leaves(fresh)):
                # in place and views share the captured tensor's storage; a new result is copied in
                if torch.is_tensor(o) and o.untyped_storage().data_ptr() != f.untyped_storage().data_ptr():
                    o.copy_(f)

    def reset(self) -> None:
        self.ops = []


class TapeGraphs:
    """A stand-in for `executor.hf.static.CudaGraphs`: `capture(fn)` -> (graph, fn's outputs).
    fn runs once before it is recorded (the warm-up a CUDA capture has); recording runs it again
    (a CUDA capture only records; the step's writes are idempotent for the same inputs)."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn):
        fn()
        rec = _Recorder()
        with rec:
            out = fn()
        self.captures += 1
        return TapeGraph(rec.ops), out
