"""The model fingerprint a saved KV directory's manifest holds (kvpipe/conversation.fingerprint):
recomputed here independently (numpy over the weights' bits), so a change of its math, which would
refuse every directory saved before as another model's, fails."""
import hashlib

import numpy as np
import torch

from kvpipe.conversation import fingerprint
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
