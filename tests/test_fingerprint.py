"""The model fingerprint a saved KV directory's manifest holds (kvpipe/fingerprint.py):
recomputed here independently (numpy over the weights' bits), so a change of its math, which would
refuse every directory saved before as another model's, fails."""
import hashlib

import numpy as np
import torch

from kvpipe.fingerprint import fingerprint
from kvpipe.executor.layers.loader import random_model
from conftest import TINY_LLAMA


def reference_sums(t: torch.Tensor) -> str:
    """sum((2i + 1) * bits[i]) with i restarting every 2**22 elements, and sum(bits), as int64."""
    bits = t.detach().reshape(-1).view(torch.int16).numpy().astype(np.int64)
    i = np.arange(bits.size, dtype=np.int64) % (1 << 22)
    return f"{int(((2 * i + 1) * bits).sum())}:{int(bits.sum())}"


def test_sums_fingerprint_is_the_documented_function_of_the_bits():
    """Fault caught: the device hash computing other sums (a coefficient, the chunking, the per-tensor
    order or the text hashed changed), or the sums of one tensor attributed to another."""
    m = random_model(TINY_LLAMA, dtype=torch.bfloat16)
    h = hashlib.sha256()
    for name, t in sorted(m.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{reference_sums(t)};".encode())
    assert fingerprint(m, "sums")["weights_sha256"] == h.hexdigest()


def reference_lines(t: torch.Tensor) -> str:
    """The bits laid out [rows, last dim]: sum((2r + 1) * row_sum[r]) and sum((2c + 1) * col_sum[c]),
    as int64 (Python ints, wrapped to 64 bits)."""
    bits = t.detach().view(torch.int16).numpy().astype(object)
    m = bits.reshape(-1, t.shape[-1] if t.dim() > 1 else bits.size)
    rows = [int(x) for x in m.sum(axis=1)]
    cols = [int(x) for x in m.sum(axis=0)]
    wrap = lambda x: (x + (1 << 63)) % (1 << 64) - (1 << 63)   # noqa: E731
    return f"{wrap(sum((2 * r + 1) * v for r, v in enumerate(rows)))}:{wrap(sum((2 * c + 1) * v for c, v in enumerate(cols)))}"


def test_lines_fingerprint_is_the_documented_function_of_the_bits():
    """Fault caught: the default device hash computing other sums (rows and columns swapped, a
    coefficient, the layout of a 1-D tensor, the per-tensor order or the text hashed changed)."""
    m = random_model(TINY_LLAMA, dtype=torch.bfloat16)
    h = hashlib.sha256()
    for name, t in sorted(m.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{reference_lines(t)};".encode())
    assert fingerprint(m, "lines")["weights_sha256"] == h.hexdigest()


def test_lines_fingerprint_sees_two_weights_swapped():
    """Fault caught: a device hash blind to a reordering inside one tensor (plain sums of the bits,
    or row sums only: two weights of one row swapped)."""
    m = random_model(TINY_LLAMA, dtype=torch.bfloat16)
    before = fingerprint(m, "lines")["weights_sha256"]
    w = m.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        a, b = w[3, 5].clone(), w[3, 9].clone()
        assert a != b
        w[3, 5], w[3, 9] = b, a
    assert fingerprint(m, "lines")["weights_sha256"] != before


def test_lines_fingerprint_widens_a_block_at_a_time(monkeypatch):
    """Fault caught: the row/column sums widening a whole tensor to int64 at once (an embedding at
    128K vocab asked 3.9 GiB and ran a 24 GB GPU out of memory behind a 128K prefill), a block of
    2-byte bits widened to int64 where int32 holds its sums exactly (twice the bytes; a sum without
    its dtype widens a copy), or the row blocks summed wrongly (the last block dropped, a column sum
    overwritten instead of added)."""
    from torch.profiler import ProfilerActivity, profile

    import kvpipe.fingerprint as conv
    monkeypatch.setattr(conv, "LINE_BLOCK", 1 << 14)
    t = torch.randn(1000, 300).to(torch.bfloat16)   # 1000 rows: the last of 18-row blocks is partial
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        got = conv._tensor_hash(t, "lines")
    biggest = max(e.cpu_memory_usage for e in p.events())
    assert biggest <= (1 << 14) * 4, f"an allocation of {biggest} bytes: more than the block in int32"
    a, b = got.tolist()
    assert f"{a}:{b}" == reference_lines(t)
