"""The small kernels of a piece of model code, counted for real: a TorchDispatchMode sees every
aten op the code runs and sorts it into GEMMs, fused attention, kernel-free ops (views,
allocations) and the rest, the small kernels (norms, RoPE, activations, residual adds, copies,
casts, concatenations, the LSE merge). For each small kernel it records the bytes it reads and
writes (each tensor's distinct elements: a broadcast operand counts once). The inventory is the
same code on CPU and GPU (dispatch happens before the device's kernel is chosen), so counting on
CPU gives the GPU's kernel count and traffic. `pipeline/layer_ops.py` is the closed form the
simulator uses; tests/test_layer_ops.py holds it against this count on real HF modules, and
`kvpipe calibrate` replays the counted ops to time them (executor/calibrate/gpu.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GEMMS = ("mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot")
# Ops that allocate or reshape without launching a kernel (beyond the schema's view ops).
NO_KERNEL = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
             "lift_fresh", "detach", "alias", "set_", "resize_", "_local_scalar_dense", "sym_size",
             "sym_stride", "sym_numel", "is_same_size", "_has_compatible_shallow_copy_type")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements `t` addresses (a stride-0 dim, a broadcast, counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def kind(func) -> str:
    """'gemm', 'attention', 'none' (no kernel) or 'small' for an aten OpOverload."""
    name = func.overloadpacket.__name__.lstrip("_") if hasattr(func, "overloadpacket") else str(func)
    full = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if name in GEMMS:
        return "gemm"
    if "attention" in full:
        return "attention"
    if getattr(func, "is_view", False) or full in NO_KERNEL or name in NO_KERNEL:
        return "none"
    return "small"


@dataclass
class Inventory:
    """Small kernels seen: (op name, bytes read, bytes written) each; counts of the other kinds."""

    small: list[tuple[str, int, int]] = field(default_factory=list)
    gemms: int = 0
    attention: int = 0
    ops: list = field(default_factory=list)   # (func, args, kwargs) of each small kernel, if kept

    @property
    def kernels(self) -> int:
        return len(self.small)

    @property
    def bytes(self) -> int:
        return sum(r + w for _, r, w in self.small)


class Recorder(TorchDispatchMode):
    """Records every aten op run inside it into `self.inv`; `keep`: also keep each small
    kernel's call (function and arguments) so that it can be run again (calibration)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.inv, self.keep = Inventory(), keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        k = kind(func)
        if k == "gemm":
            self.inv.gemms += 1
        elif k == "attention":
            self.inv.attention += 1
        elif k == "small":
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            mutated = [a for i, a in enumerate(func._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
            if mutated and not outs:
                outs = [args[i] for i, a in enumerate(func._schema.arguments[:len(args)]) if a in mutated]
            read = sum(tensor_bytes(t) for t in ins if not any(t is o for o in outs) or func._schema.is_mutable)
            if func.overloadpacket.__name__ in ("copy_", "index_copy_", "fill_", "zero_"):
                read -= sum(tensor_bytes(t) for t in ins if any(t is o for o in outs))   # a pure write target
            written = sum(tensor_bytes(t) for t in outs)
            if func.overloadpacket.__name__ == "embedding":   # a gather reads its rows, not the table
                read = written + tensor_bytes(args[1])
            self.inv.small.append((func.overloadpacket.__name__, read, written))
            if self.keep:
                self.inv.ops.append((func, args, kwargs))
        return out


def record(fn, keep: bool = False) -> Inventory:
    """Run `fn()` under a Recorder; its Inventory."""
    with torch.no_grad(), Recorder(keep) as rec:
        fn()
    return rec.inv
