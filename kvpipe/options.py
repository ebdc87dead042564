"""What `kvpipe plan` and `kvpipe run` are asked, one type for the CLI and the API: one field per
flag (`--decode-tokens` is `decode_tokens`), values as a user writes them (sizes `24GB`, token
counts `128K`, knobs `auto`), checked when built (ValueError naming the flag, before any work).
`request(model)` parses them into the decision layer's `sim.decide.Request`."""
from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import dataclass, fields

from kvpipe.pipeline.codecs import parse_codec
from kvpipe.pipeline.fusion import fuse_mode
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import ALL_ON_GPU, Method
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.units import parse_bytes
from kvpipe.pipeline.workload import Workload

from .inputs import (Knob, PlanArg, codec_args, is_auto, kv_dir_problem, method_of, output_path, positive, read_plan,
                     tokens, units)

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_HW = "rtx4090"           # plan's profile; run picks this machine's GPU, else this
DEFAULT_PLAN_CONTEXT = "1M"
DEFAULT_RUN_CONTEXT = "32K"      # run without a prompt file; with one, the prompt's length
DEFAULT_DECODE_TOKENS = 32       # the same for plan and run
Path_ = str | os.PathLike | None


def _classes(hint) -> tuple[type, ...]:
    """The runtime classes a type hint admits (`int | None` -> (int, NoneType); `list[str]` -> list)."""
    if hint is None or hint is type(None):
        return (type(None),)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(c for h in typing.get_args(hint) for c in _classes(h))
    return (typing.get_origin(hint) or hint,)


def _type_names(classes: tuple[type, ...]) -> str:
    names = {type(None): "None", os.PathLike: "a path"}
    return " or ".join(dict.fromkeys(names.get(c, c.__name__) for c in classes))


def check_types(opts) -> None:
    """Each field holds a value of its annotated type (ints where an int is due, never a bool;
    an int where a float is due), else a ValueError naming the field as the API spells it."""
    hints = typing.get_type_hints(type(opts))
    for f in fields(opts):
        value, ok = getattr(opts, f.name), _classes(hints[f.name])
        if isinstance(value, bool):
            good = bool in ok
        else:
            good = isinstance(value, ok) or (float in ok and isinstance(value, int))
        if good and isinstance(value, (list, tuple)) and str in ok:   # --codec given as a list
            good = all(isinstance(v, str) for v in value)
        if not good:
            raise ValueError(f"{f.name}: expected {_type_names(ok)}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Options:
    """The flags `plan` and `run` share: model, hardware, workload, budgets, plan knobs, outputs."""

    model: str | os.PathLike = DEFAULT_MODEL
    hw: str | os.PathLike | None = DEFAULT_HW
    context: str | int | None = DEFAULT_PLAN_CONTEXT
    decode_tokens: int = DEFAULT_DECODE_TOKENS
    batch: int = 1
    gpu_mem: str | int | None = None      # budgets; None: the profile's (plan) or this machine's (run)
    host_mem: str | int | None = None
    disk_mem: str | int | None = None
    method: str | Method | None = None    # None: headwise, or the plan file's
    group: Knob = None                    # None or "auto": the planner or the rule decides
    chunk: Knob = None
    resident: Knob = None
    plan: PlanArg = None                  # a plan file, dict or Plan: replaces the search
    disk: Knob = None                     # offloaded units on disk; auto: what host RAM cannot hold
    kv_dir: Path_ = None                  # the disk tier's folder; its free space is the disk budget
    codec: str | list[str] | tuple[str, ...] = ()   # LINK=NAME, NAME auto: the simulator decides
    objective: str = "total"
    quantile: str = "p90"                 # the run the objective is ranked on: p50 (median) or p90 (a slow one)
    lossy: str | None = None              # LOSSY opt-in: int8 / int4
    sparse: float | None = None           # LOSSY opt-in: a fraction of the offloaded tokens per decode step
    max_error: float | None = None        # LOSSY only within this error budget
    fuse: str | None = None               # auto|on|off; None: KVPIPE_FUSE, else auto
    replay: str | Replay = "auto"         # auto|on|off
    trace: Path_ = None
    plot: Path_ = None

    def __post_init__(self) -> None:
        check_types(self)                    # a wrong type is a ValueError naming it, not a crash later
        for name in ("model", "hw"):         # a pathlib.Path works where the text of a path does
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        self.output_paths()                  # before any work, so a bad path costs nothing
        if self.max_error is not None:
            from kvpipe.sim.lossy_choice import check_budget
            check_budget(self.max_error)
            if self.lossy is not None or self.sparse is not None:
                raise ValueError("max-error: the planner picks within the budget; give --max-error or "
                                 "--lossy/--sparse, not both")
        fuse_mode(self.fuse)
        if Replay.parse(self.replay) is Replay.ON and self.lossy is not None and self.sparse is None:
            raise ValueError("replay: decode replay cannot run quantised KV without --sparse (it runs eagerly); "
                             "use --replay off or auto")
        if self.lossy is not None or self.sparse is not None:
            LossySpec(self.lossy, sparse=self.sparse)
        for field in ("gpu_mem", "host_mem", "disk_mem"):
            self._size(field)
        if self.context is not None:
            Workload.parse(self.context, self.decode_tokens, self.batch)
        self._knobs()
        if self.kv_dir is not None and not os.path.isdir(str(self.kv_dir)):
            raise ValueError(f"kv-dir: {kv_dir_problem(self.kv_dir)}")
        from kvpipe.sim.planner import OBJECTIVES
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        from kvpipe.pipeline.hardware import QUANTILES
        if self.quantile not in QUANTILES:
            raise ValueError(f"quantile: {self.quantile!r} is not one of {', '.join(QUANTILES)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace | dict) -> "Options":
        """The options of the parsed command line (flags that are not fields are left out)."""
        given = vars(args) if isinstance(args, argparse.Namespace) else args
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})

    def output_paths(self) -> dict:
        """flag -> checked path (or None): a file in a folder that exists, of the right format."""
        return {f: output_path(getattr(self, f), f) for f in ("trace", "plot", "out") if hasattr(self, f)}

    def _size(self, field: str) -> int | None:
        value = getattr(self, field)
        if value is None:
            return None
        name = field.replace("_", "-")
        n = parse_bytes(value, name)
        if n <= 0:
            raise ValueError(f"{name}: must be a positive size, got {value!r}")
        return n

    def budgets(self, gpu: int, host: int, disk: int) -> dict[str, int]:
        """Bytes per pool: the user's budget where given, else the default passed in."""
        pick = lambda field, default: self._size(field) or default   # noqa: E731
        return {"gpu": pick("gpu_mem", gpu), "host": pick("host_mem", host), "disk": pick("disk_mem", disk)}

    def _knobs(self) -> dict:
        """The plan knobs parsed, model-free (resident and disk may still say all/max)."""
        if self.method is not None:
            method_of(self.method)
        if self.plan is not None:
            knobs = [f"--{n}" for n in ("group", "chunk", "resident") if not is_auto(getattr(self, n))]
            if knobs:
                raise ValueError(f"plan: a plan file fixes group, chunk and resident; drop {', '.join(knobs)} "
                                 "or edit the file")
        disk = None
        if not is_auto(self.disk):
            disk = units(self.disk, "disk")
            if disk == "max":
                raise ValueError(f"disk: expected a count of units, none or auto, got {self.disk!r}")
        return {"group": None if is_auto(self.group) else positive(self.group, "group"),
                "chunk": tokens(self.chunk, "chunk"), "resident": units(self.resident), "disk": disk,
                "codecs": tuple(parse_codec(c) for c in codec_args(self.codec))}

    def request(self, model: ModelSpec, *, full: bool = False):
        """The decision layer's request for `model`: the plan file read (refused when it disagrees
        with --method or offloads under an all-GPU method), `all` resident or disk units counted."""
        from kvpipe.sim.decide import Request
        k = self._knobs()
        method = None if self.method is None else method_of(self.method)
        given = None if self.plan is None else read_plan(self.plan, model)
        if given is not None and method is not None and method is not given.method:
            raise ValueError(f"method: {method.value} disagrees with the plan file's {given.method.value}; "
                             "drop --method or edit the file")
        if given is not None and given.method in ALL_ON_GPU and given.resident != model.units:
            raise ValueError(f"resident: method {given.method.value} keeps all {model.units} units on the GPU, "
                             f"got {given.resident} in the plan file (use layerwise or headwise to offload)")
        resident = model.units if k["resident"] == "all" else k["resident"]
        if given is None and resident is not None and (method or Method.HEADWISE) in ALL_ON_GPU \
                and resident not in (model.units, "max"):
            raise ValueError(f"resident: method {method.value} keeps every unit on the GPU; --resident "
                             f"{self.resident} needs --method layerwise or headwise")
        disk = model.units if k["disk"] == "all" else k["disk"]
        return Request(method, k["group"], k["chunk"], resident, given, disk, k["codecs"], self.objective, full,
                       self.lossy, self.sparse, self.max_error, fuse_mode(self.fuse), Replay.parse(self.replay),
                       self.quantile)


@dataclass(frozen=True)
class PlanOptions(Options):
    """`kvpipe plan`: the shared flags and what only a prediction does."""

    compare: bool = False        # every method side by side
    full_sim: bool = False       # simulate every prefill chunk and decode step
    out: Path_ = None            # write the chosen plan for `run --plan`
    max_context: bool = False    # the largest context that fits, with its plan


@dataclass(frozen=True)
class RunOptions(Options):
    """`kvpipe run`: the shared flags (no default profile or context: this GPU's, the prompt's)
    and what only an execution does."""

    hw: str | os.PathLike | None = None   # None: the bundled profile of this GPU, else rtx4090
    context: str | int | None = None  # None: the prompt file's length, else 32K
    random_weights: bool = False      # the model's shapes with random weights
    device: str | None = None         # cpu, cuda or cuda:N; None: cuda when available
    dtype: str | None = None          # bf16 / fp16 / fp32; None: the model's
    seed: int = 0                     # of the random prompt and weights
    prompt_file: Path_ = None         # token ids or text (with the model's tokenizer)
    progress: bool = True
    warmup: bool = True               # one untimed prefill chunk and decode step first (CUDA)

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = kv_dir_problem(self.kv_dir) if self.kv_dir is not None else None
        if problem:   # a run writes there: found before the model loads, not by the disk tier
            raise ValueError(f"kv-dir: {problem}")
