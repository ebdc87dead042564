"""The planner's search space: the dimensions a user may pin (`Pins`) and the values each takes
(`Space`), and one search's placement of a candidate under the GPU, host and disk budgets, its
replay choice and its closed-form estimate (`_Search`); what no plan of the space fits says which
budget to raise (`_smallest_budget`), and the largest context some plan fits (`max_context`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvpipe.pipeline.fusion import decode_fused
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import breakdown, gpu_budget_for, over_limits
from kvpipe.pipeline.windows import least_true, most_true, rings, windowed_offloaded
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, decode_replayed
from kvpipe.pipeline.replay import Replay, blocker
from kvpipe.pipeline.rules import GPU_FILL_FRACTION, HOST_KV_FRACTION, first_true, gpu_fill
from kvpipe.pipeline.units import fmt_bytes
from kvpipe.pipeline.workload import Workload

from .estimate import Estimate, decode_estimate, decode_host_seconds, layer_classes, phase_layout, prefill_estimate

CHUNKS = (1024, 2048, 4096, 8192, 16384, 32768)   # prefill chunk candidates (tokens)
DEPTHS = (2, 3, 4)                                # transfer slots
EVERY_RESIDENT_UNITS = 64                         # models with at most this many units try every resident count
SOURCE = "planner"


@dataclass(frozen=True)
class Pins:
    """Dimensions the user fixed; None leaves one to the search. `resident` counts units;
    `replay` ON: decode replayed (plans that cannot replay are left out), OFF: eager, AUTO: searched."""

    group: int | None = None
    chunk: int | None = None
    resident: int | None = None
    depth: int | None = None
    replay: Replay = Replay.AUTO

    def __post_init__(self) -> None:
        for f in ("group", "chunk", "depth"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{f}: must be a positive integer, got {v!r}")
        if self.resident is not None and (not isinstance(self.resident, int) or self.resident < 0):
            raise ValueError(f"resident: must be >= 0 units, got {self.resident!r}")
        if self.replay not in (Replay.AUTO, Replay.ON, Replay.OFF):
            raise ValueError(f"replay: must be Replay.AUTO, ON or OFF, got {self.replay!r}")


@dataclass(frozen=True)
class Space:
    """The values each dimension may take (before pins)."""

    groups: tuple[int, ...]
    chunks: tuple[int, ...]
    depths: tuple[int, ...] = DEPTHS

    @classmethod
    def of(cls, model: ModelSpec, work: Workload, pins: Pins) -> "Space":
        groups = tuple(g for g in range(1, model.kv_heads + 1) if model.kv_heads % g == 0)
        if pins.group is not None:
            if model.kv_heads % pins.group:
                raise ValueError(f"group: {pins.group} does not divide the {model.kv_heads} KV heads of {model.name}")
            groups = (pins.group,)
        chunks = tuple(c for c in CHUNKS if c < work.context) + (min(work.context, CHUNKS[-1]),)
        if pins.chunk is not None:
            if pins.chunk > work.context:
                raise ValueError(f"chunk: {pins.chunk} is larger than the context {work.context}")
            chunks = (pins.chunk,)
        depths = (pins.depth,) if pins.depth is not None else DEPTHS
        if pins.resident is not None and pins.resident > model.units:
            raise ValueError(f"resident: {pins.resident} exceeds the {model.units} (layer, KV head) units")
        return cls(groups, tuple(sorted(set(chunks))), depths)


def fragmentation_room(model: ModelSpec, work: Workload, plan: Plan) -> int:
    """Room the caching allocator needs beyond the plan's live bytes: three of the largest
    transient blocks (a prefill chunk's MLP intermediate); an assumption from observed
    fragmentation OOMs (docs/PERFORMANCE.md), not a measured law."""
    return 3 * work.batch * min(plan.prefill.chunk, work.context) * model.intermediate * model.dtype_bytes


@dataclass
class _Search:
    """One search's memo tables (placement classes and phase estimates are shared by many plans)."""

    model: ModelSpec
    work: Workload
    hw: HardwareProfile
    budgets: dict[str, int]
    classes: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    replay: Replay = Replay.AUTO     # the pin: decode replayed (ON) or eager (OFF); AUTO: both searched
    fuse: str = "auto"               # the fuse setting (pipeline/fusion.py): replayed decode is fused unless off
    pre: dict = field(default_factory=dict)
    dec: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)   # simulate's memo of prefill windows (shared by replay twins)

    def can_replay(self, plan: Plan) -> bool:
        """Whether a CUDA GPU can replay this plan's decode (pipeline/replay.blocker, the executor's rule)."""
        return self.work.decode_tokens > 0 and blocker(self.model, self.work, plan) is None

    def replays(self, plan: Plan) -> bool:
        """How the plan's decode is simulated: its replay choice, else as the rule runs it
        (replayed where it can be; the search gives every plan that can a choice)."""
        return decode_replayed(self.model, self.work, plan)

    def stamped(self, plan: Plan) -> Plan | None:
        """`plan` with the replay choice the first pass searches: ON where decode can replay (OFF
        under a pin off, or where `place` left it OFF), AUTO where it cannot; None (left out) under
        a pin on where it cannot."""
        if not self.can_replay(plan):
            return None if self.replay is Replay.ON else plan
        if plan.replay is Replay.OFF:   # `place` found that only eager decode's exact homes fit the host
            return plan
        return plan.with_(replay=Replay.OFF if self.replay is Replay.OFF else Replay.ON)

    def fuses(self, plan: Plan) -> bool:
        return decode_fused(self.fuse, self.replays(plan), self.model.family)

    unit_bytes = property(lambda self: self.work.batch * self.work.kv_capacity * self.model.kv_unit_bytes_per_token)

    def place(self, plan: Plan, resident: int, pinned: bool = False, chunk_pinned: bool = False) -> Plan | None:
        """`plan` with `resident` units and the fewest disk units the host budget allows, or None
        when it does not fit. Every plan's GPU peak must leave the allocator its allowance
        (memory.pool_limits). Resident units the search chose must also leave it its slack
        (rules.gpu_fill: GPU_FILL_FRACTION of the budget); a count the user pinned needs only the
        allowance. A chunk the search chose must leave, within that slack, room for its blocks
        (fragmentation)."""
        U, unit = self.model.units, self.unit_bytes
        host_cap = self.budgets["host"] * HOST_KV_FRACTION
        off = U - resident
        disk = 0
        if rings(self.model, self.work, plan):   # units of unequal sizes: the fewest by bisection
            fits = lambda d: (breakdown(self.model, self.work, plan.with_(resident=resident, disk=d)).host  # noqa: E731
                              <= host_cap)
            most = windowed_offloaded(self.model, resident) if plan.disk_windows_first else off
            disk = 0 if fits(0) else least_true(most, fits)
        elif off * unit > host_cap:
            ring = breakdown(self.model, self.work, plan.with_(resident=resident, disk=1)).host_buffers
            disk = min(off, math.ceil((off * unit + ring - host_cap) / unit))
        placed = plan.with_(resident=resident, disk=disk)
        mem = breakdown(self.model, self.work, placed)
        fill = gpu_fill(self.budgets["gpu"])
        host_fits = lambda mem: mem.host <= host_cap and not over_limits(mem, self.budgets)
        if not host_fits(mem) and mem.host_slack and placed.replay is Replay.AUTO and self.replay is Replay.AUTO:
            # Replayed, torch pins the homes in power-of-two blocks (memory.host_slack) that the
            # budget cannot hold: decode can still run eagerly, its homes registered exactly.
            placed = placed.with_(replay=Replay.OFF)
            mem = breakdown(self.model, self.work, placed)
        if not host_fits(mem):
            return None
        if resident and not pinned and mem.gpu > fill:
            return None
        if not chunk_pinned and mem.gpu + self.fragmentation(plan) > fill:
            return None   # a chunk the search chose must leave the allocator room for its blocks
        return placed

    def placements(self, plan: Plan, resident: int, pinned: bool, chunk_pinned: bool) -> list[Plan]:
        """`place`'s plan, and where it has disk units and window layers keep rings, the plan
        placed with window units to disk first (plan.placement: fewer bytes a step where host RAM
        is short by less than they hold); the simulator ranks them."""
        first = self.place(plan, resident, pinned, chunk_pinned)
        if first is None or not first.disk or not rings(self.model, self.work, plan):
            return [first] if first is not None else []
        other = self.place(plan.with_(disk_windows_first=True), resident, pinned, chunk_pinned)
        return [first] + ([other] if other is not None else [])

    def fragmentation(self, plan: Plan) -> int:
        return fragmentation_room(self.model, self.work, plan)

    def max_resident(self, plan: Plan) -> int:
        """The most resident units `gpu_fill` of the GPU budget holds beside the chunk's blocks (0 if none)."""
        cap, U = gpu_fill(self.budgets["gpu"]) - self.fragmentation(plan), self.model.units
        if breakdown(self.model, self.work, plan.with_(resident=U, disk=0)).gpu <= cap:
            return U
        base = breakdown(self.model, self.work, plan.with_(resident=0, disk=0)).gpu
        guess = max(0, min(U - 1, int((cap - base) // self.unit_bytes)))   # exact for equal units
        fits = lambda r: breakdown(self.model, self.work, plan.with_(resident=r, disk=0)).gpu <= cap  # noqa: E731
        return most_true(U, fits, guess) if rings(self.model, self.work, plan) else guess   # unequal units

    def candidates(self, space: Space, pins: Pins, depths) -> list[Plan]:
        m, L = self.model, self.model.layers
        out: dict[tuple, Plan] = {}
        for gp in space.groups:
            for gd in space.groups:
                for chunk in space.chunks:
                    for depth in depths:
                        base = Plan(Method.HEADWISE, PhasePlan(gp, chunk, depth), PhasePlan(gd, 1, depth),
                                    0, 0, SOURCE)
                        if pins.resident is not None:
                            rs = {pins.resident}
                        else:
                            top = self.max_resident(base)
                            rs = {top, 0} | {top // (L * g) * L * g for g in (gp, gd)}
                            if m.units <= EVERY_RESIDENT_UNITS:
                                rs = set(range(top + 1))
                        for r in rs:
                            for plan in self.placements(base, r, pins.resident is not None, pins.chunk is not None):
                                if plan.resident == m.units:   # nothing streams: depth is moot
                                    plan = plan.with_(prefill=PhasePlan(gp, chunk, 2), decode=PhasePlan(gd, 1, 2))
                                plan = self.stamped(plan)
                                if plan is not None:
                                    out.setdefault(_key(plan), plan)
        return list(out.values())

    def layout(self, rd: tuple[int, int], group: int) -> tuple:
        key = rd + (group,)
        if key not in self.layouts:
            if rd not in self.classes:
                self.classes[rd] = layer_classes(self.model, *rd)
            self.layouts[key] = phase_layout(self.model, self.classes[rd], group)
        return self.layouts[key]

    def estimate(self, plan: Plan) -> Estimate:
        rd = (plan.resident, plan.disk, plan.disk_windows_first)
        pk = (plan.prefill.group, plan.prefill.chunk) + rd
        if pk not in self.pre:
            self.pre[pk] = prefill_estimate(self.model, self.work, self.hw, self.layout(rd, pk[0]), *pk[:2])
        replayed = self.replays(plan)
        dk = (plan.decode.group,) + rd + (replayed, self.fuses(plan))
        if dk not in self.dec:
            self.dec[dk] = decode_estimate(self.model, self.work, self.hw, self.layout(rd, dk[0]), dk[0],
                                           replayed, self.fuses(plan))
        (pb, plast, pe), (db, dlong, dstep) = self.pre[pk], self.dec[dk]
        host = 0.0
        if not replayed and plan.replay is Replay.OFF:   # the eager pass: the host issues every stage
            hk = (plan.decode.group,) + rd
            if hk not in self.host:
                self.host[hk] = decode_host_seconds(self.model, self.work, self.hw, self.layout(rd, hk[0]), hk[0])
            host = self.host[hk]
            dstep = None if dstep is None else max(dstep, host)
        total = pe + (dstep or 0.0) * self.work.decode_tokens
        depth = max(plan.prefill.depth, plan.decode.depth)
        return Estimate(pb, db, plast, dlong, self.work.decode_tokens, depth, pe, dstep, total, host)


def sim_cost(model: ModelSpec, work: Workload, plan: Plan, full: bool = False) -> int:
    """About how many stages simulating `plan` runs (the shortcuts' windows, not the whole run)."""
    from .simulate import DECODE_WINDOW, PREFILL_MIN_CHUNKS, PREFILL_WINDOW
    chunks = -(-work.context // plan.prefill.chunk)
    pre = chunks if full or chunks < PREFILL_MIN_CHUNKS else min(chunks, 3 * PREFILL_WINDOW + 1)
    dec = work.decode_tokens if full else min(work.decode_tokens, 2 * DECODE_WINDOW)
    per = lambda g: model.layers * (3 + 3 * model.kv_heads // g)
    return pre * per(plan.prefill.group) + dec * per(plan.decode.group)


def _key(plan: Plan) -> tuple:
    return (plan.prefill, plan.decode, plan.resident, plan.disk, plan.replay, plan.disk_windows_first)


def _smallest_budget(s: _Search, space: Space, pins: Pins) -> str:
    """Which budget to raise, and to what, for the leanest plan of the space to fit."""
    m, work, unit = s.model, s.work, s.unit_bytes
    lean = Plan(Method.HEADWISE, PhasePlan(space.groups[0], space.chunks[0], min(space.depths)),
                PhasePlan(space.groups[0], 1, min(space.depths)), 0, 0, SOURCE)
    r = pins.resident if pins.resident is not None else s.max_resident(lean)
    gpu = breakdown(m, work, lean.with_(resident=r, disk=m.units - r)).gpu
    # The budget `place` asks of the GPU: the allocator's allowance beside the peak (pool_limits);
    # a chunk the search chose also leaves the allocator its slack (gpu_fill) and room for the
    # chunk's blocks.
    room = gpu + s.fragmentation(lean)
    need = gpu_budget_for(gpu) if pins.chunk is not None else max(gpu_budget_for(room), room / GPU_FILL_FRACTION)
    if need > s.budgets["gpu"]:
        return (f"gpu-mem: no plan fits: gpu needs {fmt_bytes(gpu)} (with the allocator's room "
                f"{fmt_bytes(need)}), {fmt_bytes(s.budgets['gpu'])} available "
                f"(smallest that fits: --gpu-mem {_size_flag(need)})")
    off = (m.units - r) * unit
    if pins.replay is Replay.ON:   # replayed decode cannot read disk units: host RAM must hold the offloaded KV,
        pinned = breakdown(m, work, lean.with_(resident=r, disk=0, replay=Replay.ON)).host   # as torch pins it
        return (f"host-mem: no plan fits with --replay on: {fmt_bytes(off)} of KV must leave the GPU into host RAM "
                f"(decode replay cannot run disk units; torch pins it as {fmt_bytes(pinned)}), host "
                f"{fmt_bytes(s.budgets['host'])} available (smallest that fits: --host-mem "
                f"{_size_flag(pinned / HOST_KV_FRACTION)}, or --replay off or auto)")
    ring = breakdown(m, work, lean.with_(resident=r, disk=1)).host_buffers
    disk_need = max(1, math.ceil((off + ring - s.budgets["host"] * HOST_KV_FRACTION) / unit)) * unit
    return (f"host-mem: no plan fits: {fmt_bytes(off)} of KV must leave the GPU, host "
            f"{fmt_bytes(s.budgets['host'])} and disk {fmt_bytes(s.budgets['disk'])} available (smallest that "
            f"fits: --host-mem {_size_flag(off / HOST_KV_FRACTION)}, or --disk-mem {_size_flag(disk_need)} "
            f"with this host budget)")


def _size_flag(n: float) -> str:
    """A budget flag value at least `n` bytes, one decimal in GiB or MiB."""
    unit, scale = ("GiB", 2**30) if n >= 2**30 else ("MiB", 2**20)
    return f"{math.ceil(n / scale * 10) / 10}{unit}"


def max_context(model: ModelSpec, decode_tokens: int, batch: int, budgets: dict[str, int],
                pins: Pins = Pins(), limit: int = 2**30) -> int:
    """Largest prompt some plan of the space fits under the budgets (0 if none). The leanest plan
    (smallest group, chunk and depth) with as many resident units as the GPU holds decides it:
    fewer resident units need more host and disk, more do not fit the GPU."""
    def ok(ctx: int) -> bool:
        work = Workload(ctx, decode_tokens, batch)
        s = _Search(model, work, None, budgets, replay=pins.replay)   # memory only: no hardware needed
        try:
            space = Space.of(model, work, replace(pins, chunk=min(pins.chunk, ctx)) if pins.chunk else pins)
        except ValueError:
            return False
        for chunk in space.chunks[:1]:
            lean = Plan(Method.HEADWISE, PhasePlan(space.groups[0], chunk, min(space.depths)),
                        PhasePlan(space.groups[0], 1, min(space.depths)), 0, 0, SOURCE)
            r = pins.resident if pins.resident is not None else s.max_resident(lean)
            if s.place(lean, r, pins.resident is not None, pins.chunk is not None) is not None:
                return True
        return False
    return first_true(1, limit + 1, lambda ctx: not ok(ctx)) - 1
