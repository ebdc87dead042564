"""A plan: how the KV cache is split by head between GPU, pinned host RAM and disk, how each
phase streams it (head-group size, chunk, buffer depth, codec per link), and whether decode steps
are replayed as CUDA graphs."""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from .codecs import LINKS, REGISTRY
from .lossy import LossySpec
from .model import ModelSpec
from .replay import Replay, blocker
from .workload import Workload

PLAN_SCHEMA = 3   # version of Plan.to_json's layout; 1 had no `schema` and no `model` field, 2 no `replay`
READ_SCHEMAS = (2, PLAN_SCHEMA)   # layouts Plan.from_json reads (a schema 2 file's replay is AUTO)
CODECS = tuple(REGISTRY)  # lossless codecs first; lossy ones are added as explicit opt-ins


class Method(str, enum.Enum):
    """Schedules kvpipe can build; the first three are the baselines a user would pick instead."""

    STANDARD = "standard"    # everything on the GPU, prompt in one pass
    CHUNKED = "chunked"      # everything on the GPU, prompt in chunks
    LAYERWISE = "layerwise"  # whole layers offloaded, streamed with depth 2
    HEADWISE = "headwise"    # KV split by head; head groups streamed (kvpipe)


@dataclass(frozen=True)
class PhasePlan:
    """How one phase streams: `group` KV heads per group, `chunk` tokens per step, `depth`
    transfer slots (2 = ping-pong), and the codec used on each link."""

    group: int
    chunk: int
    depth: int = 2
    codecs: tuple[tuple[str, str], ...] = (("h2d", "none"), ("d2h", "none"), ("disk", "none"))

    def __post_init__(self) -> None:
        for f in ("group", "chunk", "depth"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f}: must be a positive integer, got {v!r}")
        for link, codec in self.codecs:
            if link not in LINKS:
                raise ValueError(f"codec link: unknown {link!r} (known: {', '.join(LINKS)})")
            if codec not in CODECS:
                raise ValueError(f"codec: unknown {codec!r} on {link} (known: {', '.join(CODECS)})")
            if link not in REGISTRY[codec].links:
                raise ValueError(f"codec: {codec} cannot serve the {link} link")

    def codec(self, link: str) -> str:
        return dict(self.codecs).get(link, "none")


@dataclass(frozen=True)
class Plan:
    """Placement is one for the whole workload (K/V stays where it was written); streaming is
    per phase. `resident` (layer, KV head) units stay on the GPU, chosen by `resident_units`;
    of the rest, `disk` units live on disk (see `placement`) and the others in pinned host RAM.
    `replay`: decode steps as CUDA-graph replays (ON) or issued stage by stage (OFF); AUTO leaves
    it to the rule (pipeline/replay.py) where the plan runs. ON needs a plan a graph can hold
    (`replay_blocker`)."""

    method: Method
    prefill: PhasePlan
    decode: PhasePlan
    resident: int
    disk: int = 0
    source: str = "user"   # where the plan came from: a rule, the user, the planner
    lossy: LossySpec | None = None   # opt-in lossy KV (quantised / sparse); None = exact
    replay: Replay = Replay.AUTO     # decode as CUDA-graph replays (ON), eager (OFF), or by the rule (AUTO)
    disk_windows_first: bool = False   # window layers' units go to disk before full layers' (`placement`)

    def __post_init__(self) -> None:
        if not isinstance(self.resident, int) or self.resident < 0:
            raise ValueError(f"resident: must be >= 0 units, got {self.resident!r}")
        if not isinstance(self.disk, int) or self.disk < 0:
            raise ValueError(f"disk: must be >= 0 units, got {self.disk!r}")
        if type(self.disk_windows_first) is not bool:
            raise ValueError(f"disk_windows_first: must be a bool, got {self.disk_windows_first!r}")
        if self.replay not in (Replay.AUTO, Replay.ON, Replay.OFF):
            raise ValueError(f"replay: must be Replay.AUTO, ON or OFF, got {self.replay!r}")
        if self.replay is Replay.ON and self.replay_blocker:
            raise ValueError(f"replay: on, but {self.replay_blocker}; use Replay.OFF or AUTO")

    @property
    def replay_blocker(self) -> str | None:
        """Why no CUDA graph can hold this plan's decode steps (executor/replay/capture.py), or None: disk
        reads, quantised KV without sparse decode and an h2d codec's decode are issued eagerly.
        Sparse decode (LOSSY, the token sketch) replays (executor/replay/sparse_step.py); the executor
        may still find a reason at run time (e.g. a decode group of resident and offloaded heads,
        or steps whose forced tokens fill their budget) and then issues the steps eagerly."""
        if self.disk:
            return f"decode replay cannot run disk units (this plan has {self.disk})"
        if self.lossy is not None and self.lossy.sparse is None:
            return "decode replay cannot run quantised KV without --sparse"
        if self.decode.codec("h2d") != "none":
            return f"decode replay cannot run an h2d codec ({self.decode.codec('h2d')})"
        return None

    def check(self, model: ModelSpec, work: Workload) -> None:
        """Raise ValueError naming the field when the plan does not suit this model/workload."""
        for phase in (self.prefill, self.decode):
            if model.kv_heads % phase.group:
                raise ValueError(f"group: {phase.group} does not divide the {model.kv_heads} KV heads "
                                 f"of {model.name}")
        if self.prefill.chunk > work.context:
            raise ValueError(f"chunk: {self.prefill.chunk} is larger than the context {work.context}")
        if self.resident > model.units:
            raise ValueError(f"resident: {self.resident} exceeds the {model.units} (layer, KV head) units")
        if self.disk > model.units - self.resident:
            raise ValueError(f"disk: {self.disk} exceeds the {model.units - self.resident} offloaded units")
        h2d = {p.codec("h2d") for p in (self.prefill, self.decode)}
        if len(h2d) > 1:
            raise ValueError(f"codec: the h2d link needs one codec for both phases, got {sorted(h2d)}")
        if h2d != {"none"} and self.disk:
            raise ValueError(f"codec: h2d={h2d.pop()} runs on host units only; this plan has {self.disk} disk "
                             "units (use --disk none, or no h2d codec)")
        if h2d != {"none"} and self.lossy is not None:
            raise ValueError(f"codec: h2d={h2d.pop()} is lossless and cannot run with lossy KV (--lossy)")

    def with_(self, **kw) -> "Plan":
        """A copy with `kw` changed. A replay choice of ON that the copy cannot keep (it gained
        disk units, quantised KV without --sparse or an h2d codec) becomes AUTO, as the rule would
        run it; `replay=Replay.ON` given in `kw` is checked, not dropped."""
        if self.replay is Replay.ON and "replay" not in kw:
            out = replace(self, replay=Replay.AUTO, **kw)
            return out if out.replay_blocker else replace(out, replay=Replay.ON)
        return replace(self, **kw)

    def with_lossy(self, lossy: LossySpec | None, pin: Replay = Replay.AUTO) -> "Plan":
        """A copy with `lossy` and its decode replay choice made again, not kept from this plan's
        (an exact decode at the PCIe floor hides the host's issue cost, a sparse one does not): the
        --replay pin `pin` (ON / OFF; AUTO: the rule decides where it runs), AUTO where the copy
        cannot replay (quantised KV alone)."""
        out = replace(self, lossy=lossy, replay=Replay.AUTO)
        return out if out.replay_blocker or pin is Replay.AUTO else replace(out, replay=pin)

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (f"{self.method.value}: prefill group={p.group} chunk={p.chunk} depth={p.depth}; "
                f"decode group={d.group} depth={d.depth}; resident units={self.resident}, "
                f"disk units={self.disk}" + "".join(f"; {link} codec {name}" for link, name in p.codecs
                                                    if name != "none")
                + ("; window units to disk first" if self.disk_windows_first and self.disk else "")
                + {Replay.AUTO: "", Replay.ON: "; decode replayed (CUDA graph)",
                   Replay.OFF: "; decode eager (replay off)"}[self.replay]
                + (f"; LOSSY: {self.lossy.describe()}" if self.lossy else ""))

    def to_json(self, model: ModelSpec | None = None) -> dict:
        """The plan as JSON, with its schema version; with `model`, the model it was made for."""
        phase = lambda p: {"group": p.group, "chunk": p.chunk, "depth": p.depth, "codecs": dict(p.codecs)}
        out: dict = {"schema": PLAN_SCHEMA}
        if model is not None:
            out["model"] = model.name
        out.update({"method": self.method.value, "prefill": phase(self.prefill), "decode": phase(self.decode),
                    "resident": self.resident, "disk": self.disk, "source": self.source})
        if self.lossy is not None:
            out["lossy"] = self.lossy.to_json()
        if self.replay is not Replay.AUTO:
            out["replay"] = self.replay.to_json()
        if self.disk_windows_first:
            out["disk_windows_first"] = True
        return out

    @classmethod
    def from_json(cls, obj: object, model: ModelSpec | None = None) -> "Plan":
        """The plan printed under 'plan' by `--json`. Every field is checked for its JSON type
        (a whole number is an int, never a string or a bool); errors name the field. A plan of
        schema version this kvpipe does not read, or (given `model`) made for another model, is
        refused. `replay` is true, false or null (absent, as in schema 2 files: null); true is
        refused where the plan's decode cannot be replayed (disk units, quantised KV without --sparse, an h2d codec)."""
        if isinstance(obj, dict):
            schema = obj.get("schema", 1)
            if schema not in READ_SCHEMAS:
                raise ValueError(f"plan.schema: {schema!r} is not a plan schema this kvpipe reads "
                                 f"({', '.join(map(str, READ_SCHEMAS))}; make the plan again with `kvpipe plan --out`)")
            if model is not None and "model" in obj and obj["model"] != model.name:
                raise ValueError(f"plan.model: the plan file is for {obj.get('model')!r}, not --model "
                                 f"{model.name!r}")
        def expect(value: object, kind: type, name: str) -> object:
            where = f"plan.{name}" if name else "plan"
            if kind is int and type(value) is not int:
                raise ValueError(f"{where}: expected an integer, got {_json_type(value)} {value!r}"[:200])
            if kind is not int and not isinstance(value, kind):
                raise ValueError(f"{where}: expected a JSON {_JSON_NAMES[kind]}, "
                                 f"got {_json_type(value)} {value!r}"[:200])
            return value

        def field(d: dict, key: str, kind: type, where: str, default: object = _REQUIRED) -> object:
            if key not in d:
                if default is _REQUIRED:
                    raise ValueError(f"plan: field {where + key!r} is missing")
                return default
            return expect(d[key], kind, where + key)

        def phase(name: str) -> PhasePlan:
            p = field(obj, name, dict, "")
            codecs = field(p, "codecs", dict, f"{name}.", {})
            for link, codec in codecs.items():
                if link not in LINKS:
                    raise ValueError(f"plan.{name}.codecs: unknown link {link!r} (known: {', '.join(LINKS)})")
                expect(codec, str, f"{name}.codecs.{link}")
            return PhasePlan(field(p, "group", int, f"{name}."), field(p, "chunk", int, f"{name}."),
                             field(p, "depth", int, f"{name}.", 2),
                             tuple((link, codecs.get(link, "none")) for link in LINKS))  # links in one order

        expect(obj, dict, "")
        method = field(obj, "method", str, "")
        if method not in {m.value for m in Method}:
            raise ValueError(f"plan.method: unknown {method!r} (known: {', '.join(m.value for m in Method)})")
        replay = Replay.from_json(obj.get("replay"))
        plan = cls(Method(method), phase("prefill"), phase("decode"), field(obj, "resident", int, ""),
                   field(obj, "disk", int, "", 0), field(obj, "source", str, "", "plan file"),
                   LossySpec.from_json(field(obj, "lossy", dict, "", None) if obj.get("lossy") is not None else None))
        if replay is Replay.ON and plan.replay_blocker:
            raise ValueError(f"plan.replay: true, but {plan.replay_blocker}; set it to false or null")
        return plan.with_(replay=replay, disk_windows_first=field(obj, "disk_windows_first", bool, "", False))


_REQUIRED = object()
_JSON_NAMES = {dict: "object", str: "string", int: "integer", list: "array", bool: "boolean"}


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type: 'array' for a list, 'string' for a str, ..."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


ALL_ON_GPU = (Method.STANDARD, Method.CHUNKED)   # methods that never offload a unit


class Tier(str, enum.Enum):
    GPU = "gpu"
    HOST = "host"
    DISK = "disk"


def decode_replayed(model: ModelSpec, work: Workload, plan: Plan, device: str = "cuda") -> bool:
    """Whether `plan`'s decode steps run replayed on `device`: as its replay choice says, else
    (AUTO) where the rule (`replay.blocker`) finds nothing; never without decode tokens. Where
    they do, the executor's KV homes are pinned by torch (executor/kv/store.py), carved out of
    power-of-two blocks (pipeline/memory.py counts them)."""
    if not work.decode_tokens:
        return False
    if plan.replay is not Replay.AUTO:
        return plan.replay is Replay.ON
    return blocker(model, work, plan, device) is None


def placement(model: ModelSpec, plan: Plan) -> dict[tuple[int, int], Tier]:
    """Tier of every (layer, KV head) unit. Resident units are spread evenly over layers, lowest
    head indices first (so whole head groups become resident); `disk` offloaded units live on
    disk, spread over the layers from the highest head index down, full layers' first (or, with
    `disk_windows_first`, window layers'). A window layer's unit is small on disk as on the host
    (a ring): full units free the most host RAM a unit, window units move the fewest bytes a
    step, so where host RAM is short by less than the window units hold, windows first is
    faster; the planner simulates both (sim/space.py)."""
    L, H = model.layers, model.kv_heads
    tiers: dict[tuple[int, int], Tier] = {}
    for layer in range(L):
        n = plan.resident // L + (1 if layer < plan.resident % L else 0)
        for head in range(H):
            tiers[(layer, head)] = Tier.GPU if head < n else Tier.HOST
    # Disk takes the highest offloaded head of every layer first, so each layer streams from
    # both tiers and the disk and h2d lanes overlap instead of taking turns layer by layer.
    later = lambda layer: (bool(model.windows) and model.windows[layer] > 0) != plan.disk_windows_first   # noqa: E731
    offloaded = sorted((u for u in tiers if tiers[u] is Tier.HOST), key=lambda u: (later(u[0]), -u[1], u[0]))
    for u in offloaded[:plan.disk]:
        tiers[u] = Tier.DISK
    return tiers
