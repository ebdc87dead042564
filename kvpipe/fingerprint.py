"""The model fingerprint a KV directory's manifest holds (executor/kv/saved.py): a saved KV loads
only into the model that made it. sha256 of the config's shape fields and of every weight's bits,
hashed where the weights live (a GPU's weights stay there)."""
from __future__ import annotations

import hashlib
import json

DEVICE_HASHES = ("lines", "sums")   # weights hashes computed where the weights are (fingerprint)
LINE_BLOCK = 1 << 23   # elements a `lines` reduction widens to int64 at once (64 MiB): a whole embedding
                      # at 128K vocab would ask 3.9 GiB on a GPU already at its cap


def fingerprint(hf_model, method: str | None = None) -> dict:
    """sha256 of the model's config (without the fields that name no shape or weight) and of every
    weight's bits, hashed where the weights live: `crc32c` of each tensor's bytes (on the CPU) or
    `lines`, weighted sums of its rows' and columns' bits computed on the device (a GPU's weights
    stay there); `sums`, the earlier device hash, still checks directories saved with it."""
    import torch
    cfg = {k: v for k, v in hf_model.config.to_dict().items()
           if k not in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures")}
    params = sorted(hf_model.state_dict().items())
    method = method or ("crc32c" if params[0][1].device.type == "cpu" else "lines")
    with torch.inference_mode():
        # every tensor's sums stay on the device until one read at the end (a sync per tensor cost
        # more than the sums)
        buf = _wide_buffer(params, method)   # one int64 block for every tensor: no allocation per block
        digests = [_tensor_hash(t, method, buf) for _, t in params]
        if method in DEVICE_HASHES:
            flat = torch.stack(digests).tolist() if digests else []
            digests = [f"{a}:{b}" for a, b in flat]
    h = hashlib.sha256()
    for (name, t), d in zip(params, digests):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{d};".encode())
    return {"config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
            "weights_sha256": h.hexdigest(), "weights_hash": method}


def _wide_buffer(params, method: str):
    """The integer block `lines` widens each tensor's rows into (on the weights' device), or None:
    int32 where every sum of a block stays exact in it (bits of 2 bytes or less), else int64."""
    import torch
    if method != "lines" or not params:
        return None
    wide = max((_block_type(t.element_size(), _cols(t)) for _, t in params), key=lambda d: d.itemsize)
    return torch.empty(min(LINE_BLOCK, max(t.numel() for _, t in params)), dtype=wide,
                       device=params[0][1].device)


def _cols(t) -> int:
    """The row length `lines` lays `t`'s bits out in: its last dim (a 1-D tensor is one row)."""
    return t.shape[-1] if t.dim() > 1 else t.numel()


def _block_type(element_size: int, cols: int):
    """int32 where a block's row and column sums stay exact in it (bits of 2 bytes or less, rows
    and row blocks shorter than 2**16: |sum| < 2**16 * 2**15), else int64."""
    import torch
    return torch.int32 if element_size <= 2 and cols < (1 << 16) else torch.int64


def _tensor_hash(t, method: str, buf=None):
    """crc32c of the tensor's bytes (a str), or two weighted sums of its bits (int64 [2] on its
    device); `buf`: the integer block `lines` widens into (made here when None)."""
    import torch
    if method not in ("crc32c", *DEVICE_HASHES):
        raise ValueError(f"unknown weights hash {method!r}")
    flat = t.detach().reshape(-1).view(torch.uint8) if method == "crc32c" else \
        t.detach().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    if method == "crc32c":
        import crc32c
        return str(crc32c.crc32c(flat.cpu().contiguous().numpy()))
    if method == "lines":
        return _line_sums(flat, _cols(t), buf)
    coef = torch.arange(min(flat.numel(), 1 << 22), device=flat.device, dtype=torch.int64) * 2 + 1
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for i in range(0, flat.numel(), coef.numel()):
        part = flat[i:i + coef.numel()].to(torch.int64)
        sums[0] += (part * coef[:part.numel()]).sum()
        sums[1] += part.sum()
    return sums


def _line_sums(flat, cols: int, buf=None):
    """sum((2r + 1) * row_sum[r]) and sum((2c + 1) * col_sum[c]) of the bits laid out [rows, cols]
    (int64, wrapping), a block of rows at a time widened into `buf` (int32 or int64, reused: a
    reduction to a wider type would widen a copy of what it reads, and allocating one per block
    under a capped allocator cost more than the sums). Any two unequal elements swapped change a
    row or a column."""
    import torch
    m, wide = flat.view(-1, cols), _block_type(flat.element_size(), cols)
    if buf is None or buf.device != m.device or buf.numel() < cols or buf.dtype.itemsize < wide.itemsize:
        buf = torch.empty(min(max(LINE_BLOCK, cols), m.numel()), dtype=wide, device=m.device)
    step = min(buf.numel() // cols, (1 << 16) - 1) if buf.dtype == torch.int32 else buf.numel() // cols
    rows, cols_ = [], torch.zeros(cols, dtype=torch.int64, device=m.device)
    for r in range(0, m.shape[0], step):
        part = m[r:r + step]
        wide = buf[:part.numel()].view(part.shape)
        wide.copy_(part)
        rows.append(wide.sum(1, dtype=buf.dtype))   # in the block's own type: no widened copy
        cols_ += wide.sum(0, dtype=buf.dtype)
    rows = torch.cat(rows).to(torch.int64)
    return torch.stack([(rows * _odd(rows)).sum(), (cols_ * _odd(cols_)).sum()])


def _odd(v):
    """1, 3, 5, ... as long as `v`, on its device (int64)."""
    import torch
    return torch.arange(v.numel(), device=v.device, dtype=torch.int64) * 2 + 1
