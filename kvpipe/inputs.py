"""What a user types, checked and turned into values before any work starts: budgets, the plan
knobs (or a plan file) resolved into one `Plan`, and output paths for traces and plots. Every
problem is a ValueError naming the flag, so the CLI prints one line and exits 2."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import ALL_ON_GPU, Method, Plan, replays_decode
from kvpipe.pipeline.units import fmt_bytes, parse_bytes, parse_tokens
from kvpipe.pipeline.workload import Workload

Knob = str | int | None        # None or "auto": the rule decides
PlanArg = str | os.PathLike | dict | Plan | None
RESIDENT_NAMES = ("auto", "all", "none", "max")
REPLAY_FLAGS = ("auto", "on", "off")   # --replay of plan and run (run's API also takes "issue", a test mode)
JSON_OUTPUTS = {"trace": "Chrome trace-event JSON", "out": "the plan `kvpipe run --plan` reads"}   # flag -> format


def budget(value: str | int | None, default: int, field: str) -> int:
    """A memory budget in bytes (`24GB`, `24GiB`, 24e9); `default` when None. Must be > 0."""
    if value is None:
        return default
    n = parse_bytes(value, field)
    if n <= 0:
        raise ValueError(f"{field}: must be a positive size, got {value!r}")
    return n


def check_weights(model: ModelSpec, budgets: dict[str, int]) -> None:
    if model.weight_bytes > budgets["gpu"]:
        raise ValueError(f"gpu-mem: {fmt_bytes(budgets['gpu'])} cannot hold the weights of {model.name} "
                         f"({fmt_bytes(model.weight_bytes)})")


def method_of(value: str | Method | None, default: Method = Method.HEADWISE) -> Method:
    if value is None:
        return default
    try:
        return Method(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise ValueError(f"method: unknown {value!r} (known: {', '.join(m.value for m in Method)})") from None


def _is_auto(knob: Knob) -> bool:
    return knob is None or (isinstance(knob, str) and knob.strip().lower() == "auto")


def _positive(value: Knob, field: str, parse=int) -> int:
    try:
        n = parse(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"{field}: expected a positive integer or auto, got {value!r}") from None
    if type(n) is not int or n <= 0:
        raise ValueError(f"{field}: must be a positive integer or auto, got {value!r}")
    return n


def read_plan(plan: PlanArg, model: ModelSpec | None = None) -> Plan:
    """A Plan object, a dict as printed under 'plan' by --json, or the path of such a file (refused
    when made for another model than `model` or in another schema)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_json(plan, model)
    try:
        with open(plan) as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"plan: cannot read {str(plan)!r} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"plan: {str(plan)!r} is not valid JSON ({getattr(e, 'msg', e)})") from None
    return Plan.from_json(obj, model)


def resolve_plan(model: ModelSpec, work: Workload, budgets: dict[str, int], method: Method | str | None,
                 group: Knob = None, chunk: Knob = None, resident: Knob = None, plan: PlanArg = None) -> Plan:
    """The plan to run: a given plan (file, dict or Plan) as is, or the method's rule plan with
    the user's knobs applied. A plan together with knobs, or a method it disagrees with, is
    refused rather than half-applied."""
    from kvpipe.pipeline.rules import default_plan, max_resident, spill_to_disk
    if plan is not None:
        knobs = [f"--{n}" for n, v in (("group", group), ("chunk", chunk), ("resident", resident)) if not _is_auto(v)]
        if knobs:
            raise ValueError(f"plan: a plan file fixes group, chunk and resident; drop {', '.join(knobs)} "
                             "or edit the file")
        given = read_plan(plan, model)
        if method is not None and method_of(method) is not given.method:
            raise ValueError(f"method: {method_of(method).value} disagrees with the plan file's "
                             f"{given.method.value}; drop --method or edit the file")
        if given.method in ALL_ON_GPU and given.resident != model.units:
            raise ValueError(f"resident: method {given.method.value} keeps all {model.units} units on the GPU, "
                             f"got {given.resident} in the plan file (use layerwise or headwise to offload)")
        return given
    method = method_of(method)
    rule = default_plan(method, model, work, budgets)
    g = None if _is_auto(group) else _positive(group, "group")
    c = None if _is_auto(chunk) else _positive(chunk, "chunk", lambda t: parse_tokens(t, "chunk"))
    r = None if _is_auto(resident) else _resident(resident, model)
    if r is not None and method in ALL_ON_GPU and r not in (model.units, "max"):
        raise ValueError(f"resident: method {method.value} keeps every unit on the GPU; --resident "
                         f"{resident} needs --method layerwise or headwise")
    if g is None and c is None and r is None:
        return rule
    pre, dec = rule.prefill, rule.decode
    if g is not None:
        pre, dec = replace(pre, group=g), replace(dec, group=g)
    if c is not None:
        pre = replace(pre, chunk=c)
    out = rule.with_(prefill=pre, decode=dec, resident=rule.resident if r in (None, "max") else r,
                     source="user knobs over " + rule.source)
    if r == "max" and method not in ALL_ON_GPU:
        out = max_resident(model, work, out, budgets["gpu"])
    return spill_to_disk(model, work, out, budgets["host"]) if out.resident < model.units else out.with_(disk=0)


def planner_pins(model: ModelSpec, group: Knob = None, chunk: Knob = None, resident: Knob = None,
                 replay: bool | None = None):
    """The knobs the user gave as the planner's pins (None: the search decides; `max` is what the
    search does anyway); `replay` as `replay_pin` returns it."""
    from kvpipe.sim.planner import Pins
    g = None if _is_auto(group) else _positive(group, "group")
    c = None if _is_auto(chunk) else _positive(chunk, "chunk", lambda t: parse_tokens(t, "chunk"))
    r = None if _is_auto(resident) else _resident(resident, model)
    return Pins(group=g, chunk=c, resident=None if r == "max" else r, replay=replay)


def replay_pin(value: str | None) -> bool | None:
    """--replay as the replay pin: on True, off False, auto (or None) None: the plan decides."""
    name = "auto" if value is None else str(value).strip().lower()
    if name not in REPLAY_FLAGS:
        raise ValueError(f"replay: expected one of {', '.join(REPLAY_FLAGS)}, got {value!r}")
    return {"auto": None, "on": True, "off": False}[name]


def apply_replay(model: ModelSpec, work: Workload, plan: Plan, pin: bool | None, flag: str = "--replay") -> Plan:
    """The replay pin over a plan the search did not choose (a rule's, a plan file's, or one the
    user's --disk/--codec changed): refused where `plan` says otherwise (its own replay choice)
    or cannot replay (on); off leaves plans that cannot replay at None (they run eagerly). A plan
    (file) whose replay true no GPU could run for this model and workload is refused, naming it."""
    why = plan.replay_blocker or (None if replays_decode(model, work) or not work.decode_tokens else
                                  "decode replay needs bf16/fp16, batch 1 and a head dim that is a multiple of 8 "
                                  f"up to 256 ({model.name}: {model.dtype}, head dim {model.head_dim}; batch {work.batch})")
    if pin is None:
        if plan.replay and why:
            raise ValueError(f"plan.replay: true, but {why}; set it to false or null")
        return plan
    if plan.replay is not None and plan.replay is not pin:
        raise ValueError(f"replay: {flag} {'on' if pin else 'off'} disagrees with the plan's replay "
                         f"{str(plan.replay).lower()}; drop {flag} or edit the plan file")
    if pin and why:
        raise ValueError(f"replay: on, but {why}; use {flag} off or auto")
    return plan.with_(replay=pin if why is None and work.decode_tokens else None)


def codec_args(codec) -> list:
    """The --codec argument as a list of LINK=NAME strings: one string, a list of them, or none."""
    return [codec] if isinstance(codec, str) else list(codec or ())


def apply_tiers(model: ModelSpec, plan: Plan, disk: Knob = None, codec=()) -> tuple[Plan, list[str]]:
    """--disk N (offloaded units on disk; auto: the rule's spill) and --codec LINK=NAME applied to
    `plan`; returns it and the links given as LINK=auto (for the simulator to decide)."""
    from kvpipe.pipeline.codecs import parse_codec
    if not _is_auto(disk):
        n = 0 if str(disk).strip().lower() == "none" else _resident(disk, model)
        if not isinstance(n, int):
            raise ValueError(f"disk: expected a count of units, none or auto, got {disk!r}")
        if n > model.units - plan.resident:
            raise ValueError(f"disk: {n} exceeds the {model.units - plan.resident} offloaded units")
        plan = plan.with_(disk=n)
    pairs = [parse_codec(c) for c in codec_args(codec)]
    fixed = {link: name for link, name in pairs if name != "auto"}
    if fixed:
        pick = lambda p: replace(p, codecs=tuple(sorted({**dict(p.codecs), **fixed}.items())))
        plan = plan.with_(prefill=pick(plan.prefill), decode=pick(plan.decode))
    return plan, [link for link, name in pairs if name == "auto"]


def free_disk(kv_dir: str | os.PathLike | None) -> int:
    """Free bytes where the disk tier's file goes (the system temp dir by default)."""
    import shutil
    import tempfile
    d = tempfile.gettempdir() if kv_dir is None else str(kv_dir)
    if not os.path.isdir(d):
        raise ValueError(f"kv-dir: {d!r} is not a directory")
    return shutil.disk_usage(d).free


def _resident(value: Knob, model: ModelSpec) -> int | str:
    """`all`, `none`, `max` or a count of (layer, KV head) units (0 allowed)."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ("all", "none", "max"):
            return {"all": model.units, "none": 0, "max": "max"}[name]
        if name.isdigit():
            return int(name)
    if type(value) is int and value >= 0:
        return value
    raise ValueError(f"resident: expected all, none, max, auto or a count of units, got {value!r}")


def output_path(path: str | os.PathLike | None, field: str) -> Path | None:
    """Check a --trace or --out (.json) or --plot (an image type matplotlib writes) path before any
    work: not a directory, its folder exists and is writable (as far as permissions say; the write
    itself goes through `write_output`), the extension says the format (matplotlib would silently
    add `.png` to a bare name), and for plots matplotlib is installed."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        example = p / {"trace": "out.json", "out": "plan.json"}.get(field, "out.png")
        raise ValueError(f"{field}: {str(p)!r} is a directory; give a file name, e.g. {str(example)!r}")
    if not p.parent.is_dir():
        raise ValueError(f"{field}: folder {str(p.parent)!r} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{field}: cannot write {str(p)!r} (permission denied)")
    suffix = p.suffix.lower().lstrip(".")
    if field in JSON_OUTPUTS:
        if suffix != "json":
            raise ValueError(f"{field}: {str(p)!r} needs the .json extension ({JSON_OUTPUTS[field]})")
        return p
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(f"{field}: needs matplotlib, which is not installed: pip install 'kvpipe[plot]'") from None
    kinds = FigureCanvasBase.get_supported_filetypes()
    if suffix not in kinds:
        raise ValueError(f"{field}: {str(p)!r} needs an image extension ({', '.join('.' + k for k in sorted(kinds))})")
    return p


def write_output(path: Path, field: str, write) -> None:
    """write(path), a failure to write (a folder that refuses it, a full disk) as a ValueError
    naming the flag, so the CLI prints one line and exits 2."""
    try:
        write(path)
    except OSError as e:
        raise ValueError(f"{field}: cannot write {str(path)!r} ({e.strerror or e})") from None
