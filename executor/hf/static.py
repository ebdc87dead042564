"""The static-shape decode step of a `HeadwiseCache`: one token through HF's own model forward with
every input the step reads in fixed device buffers (token id, position, keys attended), its new
K/V written at the device-held position (as HF's StaticCache indexes its writes) and attention
over the whole capacity with the length read on the device (`attend_decode`, the kernel graph
replay captures in executor/replay/). Nothing in the step depends on a host integer, so on CUDA
it is captured once as a CUDA graph and replayed for every decode token; issued without a graph
(`graph=False`) the same step is the reference the replay equals bit for bit, and on CPU it runs
with a length-masked attention of the same meaning."""
from __future__ import annotations

import inspect

import torch

from kvpipe.executor.hf.attention import PendingKV
from kvpipe.executor.layers.attention import attend_decode


def attend_masked(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend_decode`'s meaning without FA2 (CPU, other dtypes): q [1, Hq, 1, D], kv [1, H, S, 2, D],
    keys [0, lens) attended -> [1, 1, Hq, D]. Unwritten rows are zeroed first (they may hold NaN)."""
    H, S = kv.shape[1], kv.shape[2]
    valid = (torch.arange(S, device=kv.device) < lens.to(kv.device))        # [S]
    k = torch.where(valid[:, None], kv[0, :, :, 0], 0).repeat_interleave(q.shape[1] // H, dim=0)
    v = torch.where(valid[:, None], kv[0, :, :, 1], 0).repeat_interleave(q.shape[1] // H, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(q[0], k, v, attn_mask=valid[None, None], scale=scale)
    return out.view(1, q.shape[1], 1, -1).transpose(1, 2)


class StaticStep:
    """The decode step's device buffers over an opened HeadStream whose units are all resident, and
    the step itself: `run(model, cache)` once eagerly, or captured (`capture`) and `replay()`ed."""

    def __init__(self, stream, graph: bool) -> None:
        store, lo = stream.store, stream.layout
        assert all(n == lo.kv_heads for n in lo.resident) and lo.batch == 1, (lo.resident, lo.batch)
        dev = store.device
        self.store, self.graph_wanted = store, graph
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.lens = torch.ones(1, dtype=torch.int32, device=dev)
        self.cu_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        self.cu_k = torch.tensor([0, lo.capacity], dtype=torch.int32, device=dev)
        self.fa2 = store.cuda and store.dtype in (torch.bfloat16, torch.float16)
        self.logits: torch.Tensor | None = None   # [1, 1, V]: the step's output (static under a graph)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replays = 0

    # ---- called by the cache's layers inside the model forward ------------------------
    def write(self, layer: int, kv: torch.Tensor) -> PendingKV:
        """kv [1, H, 1, 2, D]: the token's K/V, written home at the device-held position."""
        self.store.gpu[layer].index_copy_(2, self.pos, kv)
        return PendingKV(self, layer, kv)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float, valid=None) -> torch.Tensor:
        assert valid is None, "the static step runs un-padded batches only"
        home = self.store.gpu[layer]
        if self.fa2:
            return attend_decode(q.contiguous(), home, self.lens, self.cu_q, self.cu_k, scale)
        return attend_masked(q, home, self.lens, scale)

    # ---- the step --------------------------------------------------------------------
    def set_inputs(self, token: torch.Tensor, position: torch.Tensor) -> None:
        """Token [1] or [1, 1] long and position [1] long (device tensors): copies, no host sync."""
        self.ids.copy_(token.view(1, 1))
        self.pos.copy_(position.view(1))
        self.lens.copy_(position.view(1) + 1)

    def _forward(self, model, cache, argument: str) -> torch.Tensor:
        extra = {argument: cache}
        if "cache_position" in inspect.signature(type(model).forward).parameters:   # older transformers
            extra["cache_position"] = self.pos
        out = model(input_ids=self.ids, position_ids=self.pos.view(1, 1), use_cache=True, logits_to_keep=1,
                    return_dict=True, **extra)
        return out.logits

    def run(self, model, cache, argument: str) -> torch.Tensor:
        """The step for the inputs set: by graph replay once captured, else issued -> logits [1, 1, V]."""
        if self.graph is not None and self.graph_wanted:
            self.graph.replay()
            self.replays += 1
            return self.logits
        if not (self.graph_wanted and self.store.cuda):
            return self._forward(model, cache, argument)
        return self._capture(model, cache, argument)

    def _capture(self, model, cache, argument: str) -> torch.Tensor:
        """Warm up on a side stream (the step's real first issue: its writes are the replay's own),
        then capture the same step; the first replay computes the step again, to the same bits."""
        main = torch.cuda.current_stream(self.store.device)
        side = torch.cuda.Stream(self.store.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._forward(model, cache, argument)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward(model, cache, argument)
        self.graph = graph
        return self.run(model, cache, argument)

    def close(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize(self.store.device)
            self.graph.reset()
            self.graph = None
