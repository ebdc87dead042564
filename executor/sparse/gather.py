"""LOSSY (`--sparse F`): the gather of a decode step's selected rows of the offloaded units from
their pinned host homes into a transfer slot: tokens [2, D] into the exact slot, or (with
quantisation) whole blocks' records into the byte slot. The mode is chosen once, at open, by a
probe, and reported (`SparseHomes.paths`):
  uva     (CUDA) the layer's pinned host home is wrapped as a CUDA tensor over the same address
          (__cuda_array_interface__; UVA: registered pinned memory is addressable from the GPU), and
          `index_select` on the h2d lane's stream reads the selected rows over PCIe straight into
          the slot. No host sync: selection and gather stay on the GPU, so the h2d lane only waits
          on the score's CUDA event. Cost: one gather kernel per (sequence, head), reading N rows
          as zero-copy PCIe reads, and SM time beside the compute stream.
  staged  (CUDA, where the probe fails) the indices are copied to the host (a sync of the h2d
          lane's thread on the score, once per (layer, group)), the rows gathered on the CPU into a
          pinned staging slot, and sent in one H2D copy per (layer, group): PCIe at full rate but
          the host-side sync and CPU gather remain on the critical path.
  cpu     (CPU runs: CI) index_select from the host home into the slot."""
from __future__ import annotations

import torch


class _Interface:
    """__cuda_array_interface__ (v3) of a host buffer's bytes, for torch.as_tensor on the GPU."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host        # kept alive by the CUDA tensor that wraps it
        self.__cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1", "version": 3,
                                         "data": (host.data_ptr(), False), "strides": None}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over the same bytes as the pinned contiguous host tensor `host` (same shape
    and dtype), or None where the GPU cannot address it (then the gather is staged). Probed once:
    a gather through the view must return the bytes a plain copy returns."""
    try:
        flat = torch.as_tensor(_Interface(host.reshape(-1).view(torch.uint8)), device=device)
        n = min(flat.numel(), 4096)
        got = flat.index_select(0, torch.arange(n, device=device)).cpu()
        if not torch.equal(got, host.reshape(-1).view(torch.uint8)[:n]):
            return None
        return flat.view(host.dtype).view(host.shape)
    except (RuntimeError, TypeError, ValueError):
        return None


class RowGather:
    """The gather of one store's (`store`) selected rows: `homes[layer]` the host home's rows
    [B, n_host, rows, ...] (None: no host units), `dests[slot]` the slot's rows [B, G, rows, ...],
    `row_bytes` the bytes of one row, `n_max` the most rows one step selects (the staged mode's
    staging slots)."""

    def __init__(self, store, homes: list, dests: list, row_bytes: int, n_max: int) -> None:
        lo = store.layout
        self.homes, self.dests, self.row_bytes, self.batch = homes, dests, row_bytes, lo.batch
        self.resident = lo.resident
        self.mode = "cpu"
        self.views: list[torch.Tensor | None] = [None] * lo.layers
        self.stage: list[torch.Tensor] = []
        if store.cuda:
            self.views = [device_view(h, store.device) if h is not None else None for h in homes]
            self.mode = "uva" if all(v is not None for v, h in zip(self.views, homes) if h is not None) else "staged"
            if self.mode == "staged":
                self.stage = [store.arena.empty((lo.batch, lo.slot_heads, n_max, *dests[0].shape[3:]), dests[0].dtype)
                              for _ in range(lo.slots)]

    def gather(self, layer: int, heads: tuple[int, ...], base: int, slot: int, idx: torch.Tensor,
               ready: list[torch.cuda.Event] | None = None) -> int:
        """The selected rows idx [B, n_off, N] of offloaded `heads` from their host home into the
        transfer slot, head h at row h - base, rows 0..N-1: tokens [2, D] into the exact slot, or
        (quantised) blocks' records into the byte slot. `ready` (uva, per offloaded unit): each
        head's gather first waits for its unit's event (`select_static`'s). Returns bytes moved."""
        n, N = self.resident[layer], idx.shape[-1]
        dst = self.dests[slot]                                 # [B, G, S_cap, 2, D] or [B, G, blocks, record]
        if self.mode == "staged":
            cpu = idx.cpu()                                                      # syncs on the score
            stage = self.stage[slot]
            for b in range(self.batch):
                for h in heads:
                    torch.index_select(self.homes[layer][b, h - n], 0, cpu[b, h - n], out=stage[b, h - base, :N])
            j0, j1 = heads[0] - base, heads[-1] - base + 1
            dst[:, j0:j1, :N].copy_(stage[:, j0:j1, :N], non_blocking=True)
        else:
            src = self.views[layer] if self.mode == "uva" else self.homes[layer]   # [B, n_host, rows, ...]
            for b in range(self.batch):
                for h in heads:
                    if ready is not None:
                        torch.cuda.current_stream(idx.device).wait_event(ready[h - n])
                    torch.index_select(src[b, h - n], 0, idx[b, h - n], out=dst[b, h - base, :N])
        return self.batch * len(heads) * N * self.row_bytes
