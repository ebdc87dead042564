"""One decode token's attention for a head group as two hand-written Triton kernels (split-KV
flash decoding), the CUDA path of `attention.attend_decode` where it runs: each KV head's keys are
read once for all of its query heads (FA2's varlen call reads them once per query head), and the
combine is one small kernel.

  split_attend  grid (KV head, split): the R query heads of one KV head (padded to a 16-row tile)
                against the keys [split * SPLIT, min((split + 1) * SPLIT, lens)) in tiles of
                BLOCK_N, an online softmax in float32 (scores in log2 units; the probabilities
                enter the P.V product as a sum of two model-dtype terms, so P keeps ~16 bits where
                FA2 rounds it to the model dtype's 8: twice the tensor-core work of a kernel that
                waits on memory); writes the split's
                output, normalised within the split, and its log2-sum-exp2. Splits at or past
                `lens` (read on the device) return at once: the grid is sized by the buffer.
  combine       grid (query head): the splits below lens in split order, weighted by 2^(lse -
                max), rounded once to the model dtype.

Split boundaries sit at fixed key positions (multiples of SPLIT), never at a fraction of the
buffer: a head attended in a transfer slot of one capacity and in its resident home of another
gets the same bits, and so do eager issue and graph replay (one kernel, one order of sums).

The kernels (executor/layers/decode_kernels.py) are imported on first use, so CPU CI needs no
Triton; on CPU tensors they run only in Triton's interpreter (TRITON_INTERPRET=1 before Triton is
imported: the CPU tests run them in a subprocess). A graph capture never compiles: a variant
(device, dtype, head dim, query rows) is compiled by its first call outside a capture (`warm`),
and a capture that meets one not yet compiled is an error. KVPIPE_DECODE=flash keeps FA2."""
from __future__ import annotations

import torch

from kvpipe.executor.layers import kernel_env

SPLIT = 512         # keys per split: 16 splits x 8 KV heads fill an H200's 132 SMs at 8K keys
BLOCK_N = 64        # keys per tile of a split's loop
BLOCK_S = 64        # splits per iteration of the combine's loops
ROWS = 16           # query rows of a tile: tl.dot's smallest M
WARPS = 4           # 8 were slower at every point timed (docs/PERFORMANCE.md)
STAGES = 3          # loads in flight a program: 16 us at 8K keys, 8 KV heads, against 21 us at 2
DTYPES = (torch.bfloat16, torch.float16)
SETTINGS = ("auto", "flash")
_warm: set[tuple] = set()


def setting() -> str:
    """KVPIPE_DECODE, validated (auto when unset): `flash` keeps FA2's varlen call for decode."""
    return kernel_env.setting("KVPIPE_DECODE", SETTINGS)


def unavailable(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why these kernels cannot serve `attend_decode(q, kv, ...)`, or None."""
    Hq, D, G = q.shape[1], q.shape[-1], kv.shape[1]
    if setting() == "flash":
        return "KVPIPE_DECODE=flash"
    if q.device.type != "cuda" and not kernel_env.interpreted():
        return "the Triton decode attention runs on CUDA only (or in Triton's interpreter)"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype}: bf16 and fp16 only"
    if D & (D - 1) or not 16 <= D <= 256:
        return f"head_dim {D} is not a power of two in [16, 256] (a Triton tile's width)"
    if Hq // G > ROWS:
        return f"{Hq // G} query heads per KV head exceed a {ROWS}-row tile"
    if q.device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "no working Triton on this GPU"
    return None


def attend(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention.attend_decode`'s contract (q [1, Hq, 1, D], kv [1, G, S, 2, D], keys [0, lens)
    attended, lens int32 [1] on the device) by the two kernels -> [1, 1, Hq, D] in q's dtype.
    Never waits on the device (it runs inside captured CUDA graphs)."""
    Hq, D = q.shape[1], q.shape[-1]
    G, S = kv.shape[1], kv.shape[2]
    R = Hq // G
    key = _key(q, kv)
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing and key not in _warm:
        raise RuntimeError(f"decode attention {key} not compiled before a graph capture (decode_triton.warm)")
    from kvpipe.executor.layers import decode_kernels as K
    n = -(-S // SPLIT)
    padded = -(-n // 16) * 16    # the partials' strides stay multiples of 16: one compiled variant
    part = torch.empty(G, padded, R, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(G, padded, R, dtype=torch.float32, device=q.device)
    out = q.new_empty(1, 1, Hq, D)
    K.split_attend[(G, n)](q, kv, lens, part, lse, scale * K.LOG2E,
                           q.stride(1), kv.stride(1), kv.stride(2), kv.stride(3),
                           part.stride(0), part.stride(1), lse.stride(0),
                           R=R, RP=ROWS, D=D, SPLIT=SPLIT, BLOCK_N=BLOCK_N,
                           F32=kernel_env.interpreted() and q.dtype == torch.bfloat16, num_warps=WARPS, num_stages=STAGES)
    K.combine[(Hq,)](part, lse, lens, out, part.stride(0), part.stride(1), lse.stride(0), out.stride(2),
                     R=R, D=D, SPLIT=SPLIT, BLOCK_S=BLOCK_S, num_warps=WARPS)
    if not capturing:
        _warm.add(key)
    return out


def _key(q: torch.Tensor, kv: torch.Tensor) -> tuple:
    """What selects a compiled variant: the device, dtype, head dim and query rows per KV head."""
    return q.device.type, q.device.index, q.dtype, q.shape[-1], q.shape[1] // kv.shape[1]


def warm(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> None:
    """Compile the kernels of a model's decode attention outside any graph capture: one call for
    every group size of its KV heads (the query rows per KV head are the model's either way)."""
    q = torch.zeros(1, q_heads, 1, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(1, kv_heads, 16, 2, head_dim, dtype=dtype, device=device)
    if unavailable(q, kv) is None and _key(q, kv) not in _warm:
        attend(q, kv, torch.ones(1, dtype=torch.int32, device=device), head_dim ** -0.5)
