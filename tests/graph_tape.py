"""CUDA-graph semantics on CPU, for tests of code that captures a step: `TapeGraphs.capture(fn)`
records every aten op `fn` issues (a TorchDispatchMode) with the very tensors it read and wrote;
`replay()` re-issues those ops on those tensors, writing each freshly made result into the tensor
the capture made, and runs no Python of `fn`. So, as with a graph: host values read at capture are
baked in, Python state set at capture is not set again, and the outputs are the capture's tensors.
A host sync inside the step (`.item()`, `bool(t)`) raises, as it would under capture.
`StreamLog`: the streams of the step on CPU (which stream issued each op, events and waits), to
list the accesses a GPU would race."""
from __future__ import annotations

import bisect

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


class StreamLog(TorchDispatchMode):
    """CUDA streams' ordering on CPU, for `StaticStep(lanes=...)` (executor.hf.static.Lanes' methods):
    every aten op is logged with the stream it was issued on (`use(lane)`) and the byte ranges it
    reads and writes; `record(lane)` / `wait(lane, event)` are the events and waits, tracked as
    vector clocks. `hazards()` lists every pair of ops on different streams that touch the same
    bytes (one of them writing) with the later one not ordered after the earlier one: what would
    race on a GPU, where CPU tests run everything in issue order. Lane calls inside a capture raise
    (cross-stream work a graph would capture needs its fork and join there)."""

    def __init__(self) -> None:
        super().__init__()
        self.d2h, self.h2d, self.current = "d2h", "h2d", "main"
        self.clocks: dict[str, dict[str, int]] = {}
        self.ops: list = []   # (stream, tick, clock, reads, writes, name)

    def _clock(self, lane: str) -> dict[str, int]:
        return self.clocks.setdefault(lane, {lane: 0})

    def _no_capture(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        if any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack()):
            raise RuntimeError("stream log: a lane switch, event or wait inside a captured step")

    def main(self) -> str:
        return self.current

    def use(self, lane: str):
        log = self

        class _Use:
            def __enter__(self):
                log._no_capture()
                self.before, log.current = log.current, lane

            def __exit__(self, *exc):
                log.current = self.before

        return _Use()

    def record(self, lane: str) -> dict[str, int]:
        self._no_capture()
        return dict(self._clock(lane))

    def wait(self, lane: str, event: dict[str, int]) -> None:
        self._no_capture()
        c = self._clock(lane)
        for k, v in event.items():
            c[k] = max(c.get(k, 0), v)

    def protect(self, t, lane) -> None:
        pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads, writes = [], []
        named = list(zip(func._schema.arguments, args)) + [
            (a, kwargs[a.name]) for a in func._schema.arguments if a.name in kwargs]
        for schema, value in named:
            written = schema.alias_info is not None and schema.alias_info.is_write
            (writes if written else reads).extend(_span(t) for t in tree_leaves(value) if torch.is_tensor(t))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for schema, value in zip(func._schema.returns, results):   # a view's result writes nothing itself
            if schema.alias_info is None:
                writes.extend(_span(t) for t in tree_leaves(value) if torch.is_tensor(t))
        c = self._clock(self.current)
        c[self.current] += 1
        self.ops.append((self.current, c[self.current], dict(c), [r for r in reads if r],
                         [w for w in writes if w], func.overloadpacket.__name__))
        return out

    def hazards(self) -> list[str]:
        """Unordered conflicting accesses across streams, as 'earlier -> later' lines."""
        side = [i for i, op in enumerate(self.ops) if op[0] != "main"]
        merged: list[list[int]] = []   # the bytes side streams touched, as sorted disjoint ranges
        for s0, s1 in sorted(s for i in side for s in self.ops[i][3] + self.ops[i][4]):
            if merged and s0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], s1)
            else:
                merged.append([s0, s1])
        starts = [m[0] for m in merged]
        touches = lambda a0, a1: (k := bisect.bisect_left(starts, a1) - 1) >= 0 and merged[k][1] > a0  # noqa: E731
        near = [j for j, op in enumerate(self.ops) if op[0] == "main" and any(touches(*a) for a in op[3] + op[4])]
        found = []
        for i in side:
            for j in sorted(set(side + near)):
                a, b = self.ops[min(i, j)], self.ops[max(i, j)]
                if a[0] != b[0] and (_conflict(a, b) or _conflict(b, a)) and b[2].get(a[0], 0) < a[1]:
                    found.append(f"{a[5]} on {a[0]} -> {b[5]} on {b[0]}")
        return sorted(set(found))


def _span(t: torch.Tensor):
    """(first byte, end byte) a tensor view may touch, or None when it touches none."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _conflict(a, b) -> bool:
    """Whether a writes bytes that b reads or writes."""
    return any(w0 < r1 and r0 < w1 for w0, w1 in a[4] for r0, r1 in b[3] + b[4])
