"""What a user types, checked and turned into values before any work starts: budgets, the plan
knobs and a plan file, the disk tier's folder, and output paths for traces and plots. Every
problem is a ValueError naming the flag, so the CLI prints one line and exits 2."""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, Plan
from kvpipe.pipeline.units import fmt_bytes, parse_bytes, parse_tokens

Knob = str | int | None        # None or "auto": the rule decides
PlanArg = str | os.PathLike | dict | Plan | None
RESIDENT_NAMES = ("auto", "all", "none", "max")
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
    """NoPlanFits (a ValueError, exit 3) when the GPU budget cannot hold the weights."""
    from kvpipe.pipeline.report import NoPlanFits
    if model.weight_bytes > budgets["gpu"]:
        raise NoPlanFits(f"gpu-mem: {fmt_bytes(budgets['gpu'])} cannot hold the weights of {model.name} "
                         f"({fmt_bytes(model.weight_bytes)})")


def method_of(value: str | Method | None, default: Method = Method.HEADWISE) -> Method:
    if value is None:
        return default
    try:
        return Method(value.lower() if isinstance(value, str) else value)
    except ValueError:
        raise ValueError(f"method: unknown {value!r} (known: {', '.join(m.value for m in Method)})") from None


def is_auto(knob: Knob) -> bool:
    return knob is None or (isinstance(knob, str) and knob.strip().lower() == "auto")


def positive(value: Knob, field: str, parse=int) -> int:
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


def codec_args(codec) -> list:
    """The --codec argument as a list of LINK=NAME strings: one string, a list of them, or none."""
    return [codec] if isinstance(codec, str) else list(codec or ())


def free_disk(kv_dir: str | os.PathLike | None) -> int:
    """Free bytes where the disk tier's file goes (the system temp dir by default)."""
    import shutil
    import tempfile
    d = tempfile.gettempdir() if kv_dir is None else str(kv_dir)
    if not os.path.isdir(d):
        raise ValueError(f"kv-dir: {d!r} is not a directory")
    return shutil.disk_usage(d).free


def kv_dir_problem(kv_dir: str | os.PathLike) -> str | None:
    """Why `kv_dir` cannot hold the disk tier's file (not a directory, or nothing can be created
    there: a read-only mount, mode 555), or None. Tried for real with a file created and removed,
    since permission bits do not tell (root ignores them, a read-only mount ignores them)."""
    import tempfile
    d = Path(kv_dir)
    if not d.is_dir():
        up = next((p for p in d.parents if p.exists()), None)
        if d.exists():
            return f"{str(d)!r} is not a directory"
        if up is not None and not up.is_dir():
            return f"{str(d)!r} is not a directory ({str(up)!r} is a file)"
        return f"{str(d)!r} does not exist"
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvpipe-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot create files in {str(d)!r} ({e.strerror or e})"
    return None


def units(value: Knob, field: str = "resident") -> int | str | None:
    """`all`, `none` (0), `max` or a count of (layer, KV head) units (0 allowed); None for auto."""
    if is_auto(value):
        return None
    if isinstance(value, str):
        name = value.strip().lower()
        if name in RESIDENT_NAMES:
            return 0 if name == "none" else name
        if name.isdigit():
            return int(name)
    if type(value) is int and value >= 0:
        return value
    if field == "disk":
        raise ValueError(f"disk: expected a count of units, none or auto, got {value!r}")
    raise ValueError(f"resident: expected all, none, max, auto or a count of units, got {value!r}")


def tokens(value: Knob, field: str) -> int | None:
    """A positive token count (`8K`, 8192) for a knob, None for auto."""
    return None if is_auto(value) else positive(value, field, lambda t: parse_tokens(t, field))


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
