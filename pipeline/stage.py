"""Stages and the graph: one unit of work on one lane, with its dependencies, cost inputs, the
memory it takes and frees, and the payload key (phase, step, layer, head group, tokens) that the
executor resolves to tensors. Both backends consume the same Graph."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .model import ModelSpec
from .plan import Plan
from .workload import Workload


class Lane(str, enum.Enum):
    """Resources that work in parallel; a lane runs its stages in issue order."""

    GPU = "gpu"
    H2D = "h2d"
    D2H = "d2h"
    DISK = "disk"
    CPU = "cpu"


class Kind(str, enum.Enum):
    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    DISK_READ = "disk_read"
    DISK_WRITE = "disk_write"
    COMPRESS = "compress"
    DECOMPRESS = "decompress"
    GPU_COMPRESS = "gpu_compress"       # a GPU codec of the h2d link (before the d2h store)
    GPU_DECOMPRESS = "gpu_decompress"   # ... and after each h2d fetch


LANE_OF_KIND = {Kind.COMPUTE: Lane.GPU, Kind.H2D: Lane.H2D, Kind.D2H: Lane.D2H,
                Kind.DISK_READ: Lane.DISK, Kind.DISK_WRITE: Lane.DISK,
                Kind.COMPRESS: Lane.CPU, Kind.DECOMPRESS: Lane.CPU,
                Kind.GPU_COMPRESS: Lane.GPU, Kind.GPU_DECOMPRESS: Lane.GPU}
CODEC_KINDS = (Kind.COMPRESS, Kind.DECOMPRESS, Kind.GPU_COMPRESS, Kind.GPU_DECOMPRESS)


class Pool(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Stage:
    """One unit of work. `tokens` is the token range the stage concerns: the query chunk for
    compute, the prefix being fetched for an h2d/disk read, the new tokens for a store.
    `heads` are the KV heads (of `layer`) the stage moves or attends with; `slot` is the transfer
    buffer it fills or reads. Cost inputs: `flops`, `mem_bytes` (device memory traffic),
    `bytes` (raw bytes moved over the lane, before any codec), `ops` (kernel launches or copy calls)."""

    id: int
    kind: Kind
    tag: str
    phase: Phase
    step: int
    layer: int | None
    group: int | None
    tokens: tuple[int, int]
    deps: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()
    slot: int | None = None
    flops: float = 0.0
    mem_bytes: float = 0.0
    bytes: int = 0
    ops: int = 1
    takes: tuple[tuple[Pool, int], ...] = ()
    frees: tuple[tuple[Pool, int], ...] = ()
    codec: str = "none"   # a disk read/write moves `bytes` through this codec; (de)compress runs it
    small_ops: int = 0         # compute: small kernels besides GEMMs and fused attention (layer_ops.py) ...
    small_bytes: float = 0.0   # ... and the bytes they read + write
    kv_bytes: float = 0.0      # attention: the K/V bytes its fused kernel reads (part of mem_bytes)
    pieces: int = 0            # LOSSY sparse `score`: pieces of PIPE_UNITS units a replayed step selects
    gather: bool = False       # LOSSY sparse h2d: the selected rows gathered from the host homes (not bulk copies)
                               # one after another, its gathers following (pipeline/cost.unit_pipelined)

    @property
    def lane(self) -> Lane:
        return LANE_OF_KIND[self.kind]

    @property
    def name(self) -> str:
        parts = [self.phase.value, str(self.step)]
        if self.layer is not None:
            parts.append(f"L{self.layer}")
        parts.append(self.tag)
        if self.group is not None:
            parts.append(f"g{self.group}")
        return ".".join(parts)


@dataclass(frozen=True)
class Alloc:
    """A buffer held for the whole run: `category` is weights, kv, buffers or activations."""

    pool: Pool
    category: str
    bytes: int


@dataclass
class Graph:
    """Stages in issue order (ids are indices) plus the buffers allocated before the first token."""

    model: ModelSpec
    workload: Workload
    plan: Plan
    stages: list[Stage] = field(default_factory=list)
    static: list[Alloc] = field(default_factory=list)

    def lane_order(self) -> dict[Lane, list[Stage]]:
        lanes: dict[Lane, list[Stage]] = {lane: [] for lane in Lane}
        for s in self.stages:
            lanes[s.lane].append(s)
        return lanes

    def static_bytes(self, pool: Pool, category: str | None = None) -> int:
        return sum(a.bytes for a in self.static if a.pool is pool and category in (None, a.category))

    def transfer_bytes(self) -> int:
        """Bytes crossing the PCIe link or the disk (all non-compute stages)."""
        return sum(s.bytes for s in self.stages if s.kind is not Kind.COMPUTE)
