"""Several GPUs of one host: tensor parallel by KV heads (each rank holds kv_heads/tp of every layer,
their query heads, and the projections and MLP sharded to match, with one all-reduce after the
attention output projection and one after the MLP per layer, as Megatron-LM's tensor parallelism
has), optionally pipeline stages by layers. One rank's problem is the `ModelSpec` of its shard,
simulated as one GPU on its own link, whose copy rates are bounded by the host memory bandwidth
the concurrently streaming links share; the collectives on the GPU-to-GPU link are then added."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.report import Report, Timing
from kvpipe.pipeline.workload import Workload


@dataclass(frozen=True)
class Layout:
    """`tp` ranks split the KV heads of every layer; `pp` stages split the layers; tp * pp GPUs."""

    tp: int
    pp: int = 1

    def __post_init__(self) -> None:
        for f in ("tp", "pp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f}: must be a positive integer, got {v!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "tp": self.tp, "pp": self.pp}


def layout_problem(model: ModelSpec, layout: Layout) -> str | None:
    """Why `model` cannot be split as `layout` (one line naming the flag), or None."""
    if model.kv_heads % layout.tp:
        return f"tp: {layout.tp} does not divide the model's {model.kv_heads} KV heads"
    if model.intermediate % layout.tp:
        return f"tp: {layout.tp} does not divide the MLP width {model.intermediate}"
    if layout.pp > model.layers:
        return f"pp: {layout.pp} stages exceed the model's {model.layers} layers"
    return None


def layouts(model: ModelSpec, gpus: int, tp: int | None = None, pp: int | None = None) -> list[Layout]:
    """Every layout of `gpus` GPUs `model` can be split as, within the pins; ValueError names the
    flag where none is left."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus <= 0:
        raise ValueError(f"gpus: must be a positive integer, got {gpus!r}")
    for flag, v in (("tp", tp), ("pp", pp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0 or gpus % v):
            raise ValueError(f"{flag}: {v!r} must be a positive divisor of --gpus {gpus}")
    if tp is not None and pp is not None and tp * pp != gpus:
        raise ValueError(f"tp: {tp} x --pp {pp} is not --gpus {gpus}")
    out, why = [], None
    for t in (d for d in range(1, gpus + 1) if gpus % d == 0):
        lay = Layout(t, gpus // t)
        if (tp is not None and t != tp) or (pp is not None and lay.pp != pp):
            continue
        why = layout_problem(model, lay)
        if why is None:
            out.append(lay)
    if not out:
        raise ValueError(why or f"gpus: no layout of {gpus} GPUs within --tp/--pp")
    return out


def shard(model: ModelSpec, layout: Layout) -> ModelSpec:
    """One rank's model: kv_heads/tp KV heads and their query heads, the MLP width / tp, the
    vocabulary / tp (embedding and head split by rows, as Megatron's vocab-parallel ones), the
    layers of the largest stage. Every stage is charged the embedding and head shard (only the
    first and last hold them): one per-rank problem, conservative by that much memory."""
    assert layout_problem(model, layout) is None
    return replace(model, name=f"{model.name} (rank of tp {layout.tp}, pp {layout.pp})",
                   layers=math.ceil(model.layers / layout.pp), q_heads=model.q_heads // layout.tp,
                   kv_heads=model.kv_heads // layout.tp, intermediate=model.intermediate // layout.tp,
                   vocab=math.ceil(model.vocab / layout.tp))


def rank_budgets(budgets: dict[str, int], layout: Layout) -> dict[str, int]:
    """GPU memory is per GPU; host RAM and disk are the machine's, shared evenly by the ranks
    (each holds 1/tp of the heads of 1/pp of the layers)."""
    return {"gpu": budgets["gpu"], "host": budgets["host"] // layout.gpus, "disk": budgets["disk"] // layout.gpus}


def link_rates(hw: HardwareProfile, layout: Layout) -> tuple[float, float]:
    """(h2d, d2h) bytes/s of one rank's link while the tp ranks of one stage stream at once (a
    stage's ranks work together; at batch 1 the stages take turns): each direction's link rate,
    bounded by the host memory bandwidth / tp (absent: links independent)."""
    host = hw.host_mem_bytes_per_s
    if host is None:
        return hw.h2d_bytes_per_s, hw.d2h_bytes_per_s
    share = host / layout.tp
    return min(hw.h2d_bytes_per_s, share), min(hw.d2h_bytes_per_s, share)


def rank_hardware(hw: HardwareProfile, layout: Layout) -> HardwareProfile:
    """The profile one rank is simulated on: its link's rates under the shared host bandwidth."""
    h2d, d2h = link_rates(hw, layout)
    return replace(hw, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h)


def peer_problem(hw: HardwareProfile, layout: Layout) -> str | None:
    if layout.gpus > 1 and hw.peer_bytes_per_s is None:
        return (f"gpus: hardware {hw.name!r} has no GPU-to-GPU link figures ([multi_gpu] peer_alpha_s, "
                "peer_bytes_per_s in its profile)")
    return None


def allreduce_s(hw: HardwareProfile, model: ModelSpec, tokens: int, tp: int) -> float:
    """One ring all-reduce of `tokens` rows of the hidden state over tp ranks: latency plus
    2(tp-1)/tp of the bytes at the bus bandwidth (nccl-tests' busbw definition); 0 for one rank."""
    if tp == 1:
        return 0.0
    nbytes = tokens * model.hidden * model.dtype_bytes
    return hw.peer_alpha_s + 2 * (tp - 1) / tp * nbytes / hw.peer_bytes_per_s


def send_s(hw: HardwareProfile, model: ModelSpec, tokens: int) -> float:
    """One stage boundary: `tokens` rows of the hidden state sent to the next stage's GPU."""
    return hw.peer_alpha_s + tokens * model.hidden * model.dtype_bytes / hw.peer_bytes_per_s


@dataclass(frozen=True)
class Collectives:
    """Seconds the GPU-to-GPU link adds, added to the rank's time serially (no overlap with its
    compute or copies modelled: an upper bound): all-reduces and stage sends of the prefill
    chunks, of one decode step, of the whole workload."""

    prefill_s: float
    decode_s_per_token: float
    total_s: float
    allreduces_per_token: int   # per decode step, all stages

    def to_json(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s_per_token": self.decode_s_per_token,
                "total_s": self.total_s, "allreduces_per_decode_step": self.allreduces_per_token,
                "note": "added serially to the rank's time (overlap with compute and copies not modelled)"}


def collectives(model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile, layout: Layout) -> Collectives:
    """Two all-reduces per layer per forward (after o_proj, after the MLP) on every prefill chunk
    and decode step, and pp - 1 stage sends of each, for the whole `model` under `layout`."""
    if layout.gpus == 1:
        return Collectives(0.0, 0.0, 0.0, 0)
    per_forward = 2 * model.layers   # all stages together: the stages run one after another

    def forward_s(tokens: int) -> float:
        sends = (layout.pp - 1) * send_s(hw, model, tokens) if layout.pp > 1 else 0.0
        return per_forward * allreduce_s(hw, model, tokens, layout.tp) + sends

    chunk, ctx, b = plan.prefill.chunk, work.context, work.batch
    prefill = sum(forward_s(b * min(chunk, ctx - s)) for s in range(0, ctx, chunk))
    step = forward_s(b)
    ars = per_forward if layout.tp > 1 else 0
    return Collectives(prefill, step, prefill + work.decode_tokens * step, ars)


def combined_report(rank: Report, coll: Collectives, layout: Layout) -> Report:
    """The whole machine's report from one rank's: the pp stages run one after another at batch 1
    (each stage as long as the largest), then the collectives; peaks stay per GPU."""
    t, n = rank.timing, layout.pp
    decode = None if t.decode_s_per_token is None else n * t.decode_s_per_token + coll.decode_s_per_token
    timing = Timing(n * t.prefill_s + coll.prefill_s, n * t.ttft_s + coll.prefill_s, decode,
                    n * t.total_s + coll.total_s)
    note = (f"{layout.gpus} GPUs (tp {layout.tp}, pp {layout.pp}): one rank simulated, its times x{n} stage(s) "
            "plus the GPU-to-GPU collectives; peak bytes per GPU (host and disk: one rank's share)")
    return replace(rank, timing=timing, notes=rank.notes + (note,))
