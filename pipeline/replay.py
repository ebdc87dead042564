"""Graph replay of decode steps, one setting and one rule for every layer. `Replay` is how decode
steps are issued: the `--replay` flag, a plan's choice, what the executor is told and what it ran.
`blocker` says why no CUDA graph can hold a decode; the planner predicts with it and the executor
runs by it, so a decode predicted replayed is a decode the executor replays."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import ModelSpec
    from .plan import Plan
    from .workload import Workload

FLAGS = ("auto", "on", "off")        # what a user writes (--replay, replay= of kvpipe.plan / kvpipe.run)
REPLAY_DTYPES = ("bf16", "fp16")     # FA2 varlen, the decode kernel a graph captures
MAX_HEAD_DIM = 256


class Replay(enum.Enum):
    """How decode steps are issued. A plan holds AUTO, ON or OFF (JSON: null, true, false);
    ISSUE is the executor's reference mode, never a plan's."""

    AUTO = "auto"    # not fixed: replayed where `blocker` finds nothing, else eager
    ON = "on"        # replayed as CUDA graphs; refused where `blocker` finds a reason
    OFF = "off"      # issued stage by stage (eager)
    ISSUE = "issue"  # the replayed step code issued without a graph: what a replay must equal bit for bit

    def __bool__(self) -> bool:   # a member has no truth value: compare it (`is Replay.ON`)
        raise TypeError(f"{self!r} has no truth value; compare it with Replay.ON / OFF / AUTO")

    @classmethod
    def parse(cls, value: "Replay | str | None", allowed: tuple[str, ...] = FLAGS) -> "Replay":
        """A member from itself or its name (any case; None: AUTO); ValueError naming `replay`."""
        if isinstance(value, cls):
            name = value.value
        else:
            name = "auto" if value is None else str(value).strip().lower()
        if name not in allowed:
            raise ValueError(f"replay: expected one of {', '.join(allowed)}, got {value!r}")
        return cls(name)

    @property
    def issued(self) -> str:
        """The run report's word for how decode steps ran: graph, issue or eager."""
        if self is Replay.AUTO:
            raise ValueError("replay: auto is a setting, not how a run issued its decode steps")
        return {Replay.ON: "graph", Replay.ISSUE: "issue", Replay.OFF: "eager"}[self]

    def to_json(self) -> bool | None:
        """A plan's choice as its JSON: true, false or null (AUTO)."""
        return {Replay.AUTO: None, Replay.ON: True, Replay.OFF: False}[self]

    @classmethod
    def from_json(cls, value: object) -> "Replay":
        if value is not None and type(value) is not bool:
            names = {int: "integer", float: "number", str: "string", list: "array", dict: "object"}
            raise ValueError(f"plan.replay: expected true, false or null, got "
                             f"{names.get(type(value), type(value).__name__)} {value!r}"[:200])
        return {None: cls.AUTO, True: cls.ON, False: cls.OFF}[value]


def shape_blocker(dtype: str, batch: int, head_dim: int, device: str = "cuda") -> str | None:
    """Why decode steps of a model of `dtype` ("bf16" ...) and `head_dim` at `batch` cannot be
    replayed on a `device` ("cuda" or "cpu"), or None when they can."""
    if device != "cuda":
        return "needs a CUDA device"
    if dtype not in REPLAY_DTYPES:
        return f"needs bf16 or fp16 (FA2 varlen), got {dtype}"
    if batch != 1:
        return f"needs batch 1, got {batch}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"needs a head dim that is a multiple of 8 and <= {MAX_HEAD_DIM}, got {head_dim}"
    return None


def blocker(model: "ModelSpec", work: "Workload", plan: "Plan | None" = None, device: str = "cuda",
            dtype: str | None = None) -> str | None:
    """Why decode steps of `work` under `plan` cannot be replayed on `device`, or None: the plan's
    own reasons (`Plan.replay_blocker`: disk units, quantised KV alone, an h2d codec; sparse decode
    beside window layers), then the device and the model's shape (`dtype`: the weights' where
    they differ from the spec's)."""
    if plan is not None and plan.replay_blocker:
        return plan.replay_blocker
    if plan is not None and plan.lossy is not None and windowed(model, work.kv_capacity):
        return "decode replay cannot run sparse decode with sliding-window layers"
    why = model.eager_reason(work.kv_capacity) or shape_blocker(dtype or model.dtype, work.batch, model.head_dim, device)
    return None if why is None else f"decode replay {why}"


def windowed(model: "ModelSpec", capacity: int) -> tuple[int, ...]:
    """The layers whose window is shorter than `capacity`: a replayed step gathers their window."""
    return tuple(i for i, w in enumerate(model.windows) if 0 < w < capacity)


def resolve(setting: Replay, why: str | None, decode_steps: int) -> Replay:
    """What runs under `setting` where `blocker` said `why` (None: a graph can hold the decode):
    ON and ISSUE as asked (ValueError naming replay where `why`), OFF, or under AUTO ON where
    nothing blocks, else OFF. Without decode steps nothing is replayed (OFF)."""
    if not decode_steps:
        return Replay.OFF
    if setting in (Replay.ON, Replay.ISSUE):
        if why:
            raise ValueError(f"replay: {why}; use --replay off")
        return setting
    return Replay.ON if setting is Replay.AUTO and why is None else Replay.OFF
