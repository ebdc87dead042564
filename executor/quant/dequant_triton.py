"""LOSSY (`--lossy int8|int4`): the dequantise of executor/quant/blocks.py's block records as one
hand-written Triton kernel, the CUDA path of the sparse window's decode (QuantHomes.decode_selected)
and of a replayed step's (decode_static). It writes the same bits as the eager
`BlockCodec.decode`: code * scale + zero in float32 (one fma; the product is exact, quant/blocks.py's
module docstring), rounded once to the model dtype.

Why not the compiled `records_decode` for the window: inductor's kernel for it runs several times
longer than its HBM traffic (the records read, the [group, 2, D] rows written) needs.

  decode_records  grid (block, head row, sequence): one program per record. It reads the
                  record's fields as contiguous tiles (K and V codes as [D, G/PER] and
                  [G, D/PER] bytes, the float16 scales and zeros as vectors), unpacks the
                  nibbles in registers and writes the block's G slot rows: K as one [G, D]
                  store (the channel-major codes transposed on chip), V as another, each a run
                  of D contiguous elements per token. `count` (optional, on the device): the
                  programs of blocks at or past it return at once (a replayed graph's kept
                  blocks; the grid stays sized for the window).

A program is 4 warps with no register spills (int4, group 32, D 128, bf16): per thread one
16-byte load of each code field, one 2-byte load of each metadata field, 8 16-byte stores, and
the K transpose and the V reshape through shared memory.

The kernel (executor/quant/dequant_kernels.py) is imported on first use, so CPU CI needs no
Triton; on CPU tensors it runs only in Triton's interpreter (TRITON_INTERPRET=1 set before Triton
is imported: the CPU tests run it in a subprocess). `unavailable` says why this path cannot run;
QuantHomes then keeps the compiled call."""
from __future__ import annotations

import importlib.util

import torch

from kvpipe.executor.layers import kernel_env

WARPS = 4           # per program: a record's 2 x G x D outputs (8192 at G 32, D 128), 64 per thread
MAX_GRID_YZ = 65535  # CUDA's limit on the grid's 2nd and 3rd dimensions (head rows, sequences)


def unavailable(codec, device: torch.device) -> str | None:
    """Why the Triton dequantise cannot run for `codec` (a blocks.BlockCodec) on `device`, or None."""
    device = torch.device(device)
    if device.type != "cuda" and not kernel_env.interpreted():
        return "the Triton dequantise runs on CUDA only (or in Triton's interpreter, TRITON_INTERPRET=1)"
    if codec.meta != torch.float16:
        return "float32 metadata (fp32 model): code * scale + zero is not exact in float32"
    if codec.D & (codec.D - 1) or codec.D < 16:
        return f"head_dim {codec.D} is not a power of two >= 16 (a Triton tile's width)"
    if codec.group & (codec.group - 1) or codec.group < 2:
        return f"group {codec.group} is not a power of two >= 2 (a Triton tile's width)"
    if codec.bits not in (4, 8):
        return f"bits {codec.bits} not in (4, 8)"
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "no working Triton on this GPU"
    elif importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def decode_window(codec, qslot: torch.Tensor, slot: torch.Tensor, j0: int, j1: int,
                  count: torch.Tensor | None = None) -> None:
    """`blocks.slot_decode(codec, qslot, slot, j0, j1)` by the kernel: EVERY record of rows
    [j0, j1) of the byte slot qslot [B, heads, nb * record] decoded into slot tokens
    [0, nb * group) of rows [j0, j1) of the exact slot [B, heads, S_cap, 2, D] (views: any strides,
    but a record's bytes contiguous). `count`: an int64 tensor of one element on the slot's device
    (a slice of a step's row will do), the leading blocks to decode; the rest are left as they
    were. Never waits on the device (it runs inside captured CUDA graphs)."""
    B, heads, nbytes = qslot.shape
    J, nb = j1 - j0, nbytes // codec.record
    if qslot.dtype != torch.uint8 or nbytes % codec.record or qslot.stride(-1) != 1:
        raise ValueError(f"qslot: want uint8 [B, heads, blocks * {codec.record}] with contiguous records, "
                         f"got {qslot.dtype} {tuple(qslot.shape)} strides {qslot.stride()}")
    if (slot.dtype != codec.dtype or slot.dim() != 5 or tuple(slot.shape[:2]) != (B, heads)
            or tuple(slot.shape[3:]) != (2, codec.D) or slot.shape[2] < nb * codec.group):
        raise ValueError(f"slot: want {codec.dtype} [{B}, {heads}, >= {nb * codec.group}, 2, {codec.D}], "
                         f"got {slot.dtype} {tuple(slot.shape)}")
    if not 0 <= j0 <= j1 <= heads:
        raise ValueError(f"rows: [{j0}, {j1}) is not within the slot's {heads}")
    if count is not None and (count.dtype != torch.int64 or count.numel() != 1 or count.device != slot.device):
        raise ValueError(f"count: want one int64 element on {slot.device}, got {count.dtype} "
                         f"{tuple(count.shape)} on {count.device}")
    if qslot.device != slot.device:
        raise ValueError(f"qslot on {qslot.device}, slot on {slot.device}")
    if slot.device.type != "cuda" and not kernel_env.interpreted():
        raise ValueError("decode_window: CPU tensors run only in Triton's interpreter "
                         "(TRITON_INTERPRET=1 before importing triton)")
    if J > MAX_GRID_YZ or B > MAX_GRID_YZ:
        raise ValueError(f"decode_window: {B} sequences x {J} rows exceed the grid's {MAX_GRID_YZ}")
    if nb == 0 or J == 0 or B == 0:
        return
    from kvpipe.executor.quant.dequant_kernels import decode_records
    q, o = qslot[:, j0:j1], slot[:, j0:j1]            # [B, J, nb * record], [B, J, S_cap, 2, D]
    decode_records[(nb, J, B)](q, o, q if count is None else count, q.stride(0), q.stride(1), *o.stride(),
                               D=codec.D, G=codec.group, GV=codec.gv, BITS=codec.bits, REC=codec.record,
                               HAS_COUNT=count is not None, INT_ROUND=slot.device.type != "cuda",
                               num_warps=WARPS)


def compiled_variants() -> int:
    """Variants of the kernel Triton has compiled so far in this process, on every device (0
    before its first call, where Triton is missing, or where this Triton keeps its JIT cache
    elsewhere): a change across a call means the call compiled one (QuantHomes.paths)."""
    import sys
    mod = sys.modules.get(f"{__package__}.dequant_kernels")
    caches = getattr(getattr(mod, "decode_records", None), "device_caches", None)
    try:
        return sum(len(c[0]) for c in caches.values()) if caches is not None else 0
    except (TypeError, IndexError, AttributeError):
        return 0
