"""The shapes of one run's KV buffers (`KVLayout`, read off the plan's graph) and where and how its
disk tier runs (`DiskOptions`)."""
from __future__ import annotations

from dataclasses import dataclass

from kvpipe.pipeline.layer_kinds import first_visible
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.plan import Tier, placement
from kvpipe.pipeline.stage import Graph
from kvpipe.pipeline.windows import disk_rings, rings, scratch_tokens, slot_tokens

from kvpipe.executor.disk.tier import ALIGN


@dataclass(frozen=True)
class KVLayout:
    """Shapes of every KV buffer of one run. `resident[layer]` is the layer's count of GPU heads;
    `capacity` tokens per sequence (S_cap); `slots` x `slot_heads` is the transfer ring;
    `disk[layer]` the layer's count of disk heads (its top heads); `write_tokens` the most
    tokens one step writes (the prefill chunk)."""

    batch: int
    kv_heads: int
    head_dim: int
    capacity: int
    resident: tuple[int, ...]
    slots: int
    slot_heads: int
    disk: tuple[int, ...] = ()
    write_tokens: int = 1
    disk_codec: str = "none"
    quant_bits: int = 0        # LOSSY (--lossy): offloaded units stored quantised (executor/quant/store.py)
    quant_group: int = 0
    quant_vgroup: int = 0      # channels per V group (LossySpec.vgroup; the codec takes its gcd with head_dim)
    h2d_codec: str = "none"    # lossless GPU codec of the h2d link: host units stored compressed (executor/codecs/h2d_store.py)
    sparse: LossySpec | None = None   # LOSSY (--sparse): the selection's GPU state (executor/sparse/homes.py)
    rings: tuple[int, ...] = ()   # per layer, the tokens its GPU/host homes keep as a ring (0: all; pipeline/windows.py)
    windows: tuple[int, ...] = ()   # per layer, its attention window (0: full); () when every layer is full
    slot_tokens: int = 0          # tokens a transfer slot holds (0: capacity)
    scratch_tokens: int = 0       # tokens of the buffer a window's keys are copied into in position order
    disk_rings: tuple[int, ...] = ()   # per layer, the tokens its disk rows keep as a ring (0: all; windows.disk_rings)

    def __post_init__(self) -> None:
        for f in ("batch", "kv_heads", "head_dim", "capacity"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}: must be positive, got {getattr(self, f)!r}")
        if any(not 0 <= n <= self.kv_heads for n in self.resident):
            raise ValueError(f"resident: counts must lie in 0..{self.kv_heads}, got {self.resident}")
        if self.disk and (len(self.disk) != len(self.resident)
                          or any(d < 0 or r + d > self.kv_heads for r, d in zip(self.resident, self.disk))):
            raise ValueError(f"disk: counts must lie in 0..kv_heads - resident per layer, got {self.disk}")

    @classmethod
    def of(cls, graph: Graph) -> "KVLayout":
        m, w, plan = graph.model, graph.workload, graph.plan
        tiers = placement(m, plan)
        count = lambda t, layer: sum(tiers[(layer, h)] is t for h in range(m.kv_heads))
        resident = tuple(count(Tier.GPU, layer) for layer in range(m.layers))
        disk = tuple(count(Tier.DISK, layer) for layer in range(m.layers))
        for layer, (n, d) in enumerate(zip(resident, disk)):   # resident heads first, disk heads last
            assert all(tiers[(layer, h)] is (Tier.GPU if h < n else Tier.DISK if h >= m.kv_heads - d
                                             else Tier.HOST) for h in range(m.kv_heads))
        phases = [plan.prefill] + ([plan.decode] if w.decode_tokens else [])
        offloaded = any(n < m.kv_heads for n in resident)
        codecs = {p.codec("disk") for p in phases}
        if len(codecs) > 1:
            raise ValueError(f"codec: the disk link needs one codec for both phases, got {sorted(codecs)}")
        quant = plan.lossy.bits if plan.lossy is not None and plan.lossy.quant else 0
        if quant and any(disk) and codecs != {"none"}:
            raise ValueError("codec: a disk codec cannot run with lossy KV (its records go to disk as they are)")
        h2d = plan.decode.codec("h2d") if offloaded else "none"   # Plan.check: one for both phases, host units only
        ring = rings(m, w, plan)
        return cls(w.batch, m.kv_heads, m.head_dim, w.kv_capacity, resident,
                   max(p.depth for p in phases) if offloaded else 0, max(p.group for p in phases),
                   disk, min(plan.prefill.chunk, w.context), codecs.pop() if any(disk) else "none",
                   quant, plan.lossy.group if quant else 0, plan.lossy.vgroup if quant else 0, h2d,
                   plan.lossy if plan.lossy is not None and plan.lossy.sparse is not None and offloaded else None,
                   ring, m.windows, slot_tokens(m, w, ring) if ring else 0,
                   scratch_tokens(m, w, plan), disk_rings(plan, ring) if any(disk) else ())

    @property
    def layers(self) -> int:
        return len(self.resident)

    def ring(self, layer: int) -> int:
        """Tokens the layer's GPU/host homes keep as a ring (position p at row p mod R), 0: all."""
        return self.rings[layer] if self.rings else 0

    def held(self, layer: int) -> int:
        """Rows of the layer's GPU and host homes."""
        return self.ring(layer) or self.capacity

    def first_kept(self, layer: int, start: int) -> int:
        """The first token a step at `start` reads of the layer's prefix (its window's first where
        the layer keeps a ring: pipeline/windows.fetch_from)."""
        return first_visible(start, self.windows[layer]) if self.ring(layer) else 0

    def window(self, layer: int) -> int:
        """The layer's window where it is shorter than the capacity (a replayed step gathers it), else 0."""
        w = self.windows[layer] if self.windows else 0
        return w if w < self.capacity else 0

    def disk_ring(self, layer: int) -> int:
        """Tokens the layer's disk rows keep as a ring, 0: every token."""
        return self.disk_rings[layer] if self.disk_rings else 0

    def disk_first(self, layer: int, start: int) -> int:
        """The first token a step at `start` reads of the layer's disk rows (its window's first
        where they keep a ring, else 0)."""
        return first_visible(start, self.windows[layer]) if self.disk_ring(layer) else 0

    def n_disk(self, layer: int) -> int:
        return self.disk[layer] if self.disk else 0

    def first_disk(self, layer: int) -> int:
        """Index of the layer's first disk head (kv_heads when it has none)."""
        return self.kv_heads - self.n_disk(layer)


@dataclass(frozen=True)
class DiskOptions:
    """Where and how the disk tier runs: the directory of its file, the checksummed block size
    and the I/O threads (queue depth)."""

    kv_dir: str | None = None          # None: the system temp dir
    block_bytes: int | None = None     # None: the step's write, as a power of two in [ALIGN, 1 MiB]
    threads: int = 8

    def __post_init__(self) -> None:
        if self.block_bytes is not None and (self.block_bytes <= 0 or self.block_bytes % ALIGN):
            raise ValueError(f"block_bytes: must be a positive multiple of {ALIGN}, got {self.block_bytes}")
        if self.threads <= 0:
            raise ValueError(f"threads: must be positive, got {self.threads}")
