"""Which fields of a hardware profile a set of predictions depends on, and where each came from:
every scalar field of the TOML is moved in turn (a number halved, zero made one, a flag flipped),
the predictions are made again, and a field whose move changes any of them is listed with its
value and its `# source:` comment. Issue 8 asks that these numbers be measurements (`kvpipe
calibrate`'s micro-benchmarks), not fitted to the rows they predict; a source that does not begin
with "measured" is marked.

  python -m benchmarks.regimes --report --audit     # the issue-8 rows' fields (issue8_report.py)"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

_SECTION = re.compile(r"^\s*\[([^\]]+)\]")
_FIELD = re.compile(r"^(\s*)([A-Za-z0-9_]+)(\s*=\s*)([^#\s]+)(\s*(#.*)?)$")


@dataclass(frozen=True)
class Field:
    key: str               # dotted TOML key, e.g. gpu.small_kernel_s
    line: int              # index in the file's lines
    value: str
    source: str            # the comment after '# source:' (or the whole comment)

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


def fields(text: str) -> list[Field]:
    """Every scalar `key = value  # comment` line of a profile, with its dotted key."""
    section, out = "", []
    for i, line in enumerate(text.splitlines()):
        if (s := _SECTION.match(line)):
            section = s.group(1).strip() + "."
            continue
        f = _FIELD.match(line)
        if not f or f.group(4).startswith('"'):
            continue
        comment = (f.group(6) or "").lstrip("#").strip()
        source = comment.split("source:", 1)[1].strip() if "source:" in comment else comment
        out.append(Field(section + f.group(2), i, f.group(4), source))
    return out


def moves(value: str) -> tuple[str, ...]:
    """Values far enough from the field's that any cost using it changes: a flag flipped, zero
    made one, a number halved, else doubled (where the loader refuses the half, e.g. a peak below
    its effective rate)."""
    if value in ("true", "false"):
        return ("false" if value == "true" else "true",)
    x = float(value)
    if not x:
        return ("1",)
    if re.fullmatch(r"[0-9]+", value):
        return (str(max(1, int(x) // 2)), str(int(x) * 2))
    return (repr(x / 2), repr(x * 2))


def used_fields(profile: Path, predict, rel: float = 1e-9) -> tuple[list[Field], list[Field]]:
    """(fields of the TOML at `profile` whose move changes `predict(hw)` (a list of seconds, `hw`
    a loaded HardwareProfile) by more than `rel`, fields no move of which the loader accepts)."""
    from kvpipe.hw_profiles import ProfileError, load_profile
    text = profile.read_text()
    base = predict(load_profile(str(profile)))
    lines, used, untold = text.splitlines(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / profile.name
        for f in fields(text):
            hw = None
            for value in moves(f.value):
                changed = list(lines)
                changed[f.line] = _FIELD.sub(lambda m: m.group(1) + m.group(2) + m.group(3) + value
                                             + (m.group(5) or ""), lines[f.line])
                path.write_text("\n".join(changed) + "\n")
                try:
                    hw = load_profile(str(path))
                    break
                except ProfileError:
                    continue
            if hw is None:
                untold.append(f)
            elif any(abs(a - b) > rel * max(abs(b), 1e-30) for a, b in zip(predict(hw), base)):
                used.append(f)
    return used, untold


def audit_lines(profile: Path, predict) -> list[str]:
    used, untold = used_fields(profile, predict)
    lines = [f"profile fields these predictions depend on ({profile}; each moved alone): {len(used)}"]
    lines += [f"{'  ' if f.measured else '! '}{f.key} = {f.value}  # {f.source}" for f in used]
    odd = [f.key for f in used if not f.measured]
    lines.append("of these, not marked measured: " + (", ".join(odd) if odd else "none"))
    if untold:
        lines.append("not told (the loader refused every move): " + ", ".join(f.key for f in untold))
    return lines
