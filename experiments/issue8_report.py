"""Issue 8 §3 over the rows already measured: each issue-8 row's newest measurement in
benchmarks/results (the regimes and fuse_check runs), predicted by the simulator with one profile
and the row's own plan, decode issue and fusion as its JSON records them; a table of measured,
predicted and error, median / max |error| for decode and prefill apart, and flags on rows measured
before an executor change that can move them (CHANGES). No GPU; no figure is fitted here.

  python -m benchmarks.regimes --report [--hw h200-testbox] [--out FILE.txt] [--audit]

The rows (issue 8, Targets): decode with every head resident at 8K and 32K (default plan),
streamed decode at 32K/64K/128K for groups 1, 2, 4, 8, mixed decode at 128K (the default plan
there keeps some units resident), prefill at 8K, 32K and 128K (default plan). `--audit` also lists
the profile fields these predictions depend on, each with its source comment (profile_audit.py)."""
from __future__ import annotations

import datetime
import json
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DECODE, PREFILL = "decode", "prefill"
KEY = {DECODE: "decode_s_per_token", PREFILL: "prefill_s"}
STREAMED = tuple(f"{c}k-g{g}-none" for c in (32, 64, 128) for g in (1, 2, 4, 8))
ROWS = {DECODE: ("8k-default", "32k-default", *STREAMED, "128k-mixed"),
        PREFILL: ("8k-default", "32k-default", "128k-default")}
SOURCES = ("*regimes*.json", "*fuse_check*.json")


def _ran_unfused(record: dict) -> bool:
    """The JSON says how it ran: no `fused` key = saved before the setting existed."""
    return not record.get("fused")


def _attends_a_prefix(record: dict) -> bool:
    """A prefill whose later chunks attend to a prefix with cuDNN."""
    from kvpipe.pipeline.cost import CUDNN_MIN_ROWS
    chunk = record["plan"]["prefill"]["chunk"]
    return CUDNN_MIN_ROWS <= chunk < record["context"]


def _every(record: dict) -> bool:
    return True


@dataclass(frozen=True)
class Change:
    """An executor change that can move a measured figure: rows measured before `commit` (its
    committer date) carry `flag` on their figures of `metrics` whose record `applies` holds for."""

    flag: str
    commit: str
    metrics: tuple[str, ...]
    applies: Callable[[dict], bool]
    what: str


# benchmarks/README.md's notes on the executor between the rows' sessions (2026-11-30).
CHANGES = (
    Change("U", "5438e89", (DECODE,), _ran_unfused, "unfused: measured before fused decode became the default "
           "(--fuse auto); predicted unfused, as it ran"),
    Change("W", "c18cd45", (PREFILL,), _attends_a_prefix, "measured before the warm-up paid the process's first "
           "cuDNN prefix attention (~0.8 s of host on the H200): a process's first prefilled row with a prefix "
           "could pay it in its timed prefill (regimes runs HF's cuDNN prefill first in the same process)"),
    Change("G", "c4424dd", (DECODE, PREFILL), _every, "measured before warm_up collected garbage before the "
           "timed run (a suspect for a slow first row of a process, not confirmed on the GPU)"),
)
# What the flags leave out, and measurements of the same knobs this report does not read.
NOTES = (
    "changes not flagged: f4b5a03 (each run's lanes free torch's cuBLAS workspaces: 64 MiB a row, memory "
    "not time), d98f2a0 (one fill kernel a run, outside every stage)",
    "not read: lossy_run's `exact` and codec_run's `none` rows (128K, group 8, all streamed, as 128k-g8-none) "
    "record neither decode issue (replay) nor fusion; sim_check's rows pin their prefill chunk, not the "
    "default plan (`python -m benchmarks.sim_check --report` predicts them)",
)


@dataclass(frozen=True)
class Measurement:
    row: str
    metric: str
    file: str
    name: str              # the row's name in its file
    date: datetime.datetime
    record: dict

    @property
    def seconds(self) -> float:
        return measured(self.record)[KEY[self.metric]]


def measured(record: dict) -> dict:
    """The measured figures of a saved row (regimes: under `measured`; fuse_check: top level)."""
    return record.get("measured") or record


def issue8_rows(command: str, name: str, record: dict, units: int) -> list[tuple[str, str]]:
    """(row, metric) pairs of issue 8 that a saved row measures. regimes rows by name, the 128K
    default (or 128k-g8-max) as the mixed decode row when its plan keeps some units resident;
    fuse_check's streamed rows at its default setting (`auto`) as the group-8 streamed rows."""
    plan = record["plan"]
    if "benchmarks.fuse_check" in command:
        if record.get("kind") == "streamed" and record.get("fuse") == "auto" and plan["resident"] == 0:
            return [(f"{record['context'] // 1024}k-g{plan['decode']['group']}-none", DECODE)]
        return []
    out = [(name, m) for m in (DECODE, PREFILL) if name in ROWS[m]]
    if name in ("128k-default", "128k-g8-max") and 0 < plan["resident"] < units:
        out.append(("128k-mixed", DECODE))
    return out


def gather(results: Path, units: int) -> list[Measurement]:
    """Every measured issue-8 figure in the regimes / fuse_check JSON files under `results`."""
    out = []
    for path in sorted({p for pattern in SOURCES for p in results.glob(pattern)}):
        res = json.loads(path.read_text())
        date = datetime.datetime.fromisoformat(res["date"])
        for name, record in res.get("rows", {}).items():
            if "plan" not in record or KEY[DECODE] not in measured(record):
                continue      # failed or never ran
            for row, metric in issue8_rows(res.get("command", ""), name, record, units):
                out.append(Measurement(row, metric, path.name, name, date, record))
    return out


def newest(found: list[Measurement]) -> tuple[dict, dict]:
    """({(row, metric): its newest measurement}, {(row, metric): the older ones, newest first})."""
    by: dict[tuple[str, str], list[Measurement]] = {}
    for m in found:
        by.setdefault((m.row, m.metric), []).append(m)
    ordered = {k: sorted(v, key=lambda m: m.date, reverse=True) for k, v in by.items()}
    return {k: v[0] for k, v in ordered.items()}, {k: v[1:] for k, v in ordered.items() if len(v) > 1}


def commit_dates(changes=CHANGES, repo: Path | None = None) -> dict[str, datetime.datetime]:
    """Committer date of each change's commit (git); a commit git does not know is an error."""
    repo = repo or Path(__file__).resolve().parent.parent
    out = {}
    for c in changes:
        r = subprocess.run(["git", "show", "-s", "--format=%cI", c.commit], cwd=repo, capture_output=True, text=True)
        if r.returncode:
            raise ValueError(f"issue8_report: commit {c.commit} ({c.flag}) not found: {r.stderr.strip()}")
        out[c.commit] = datetime.datetime.fromisoformat(r.stdout.strip())
    return out


def flags(m: Measurement, dates: dict, changes=CHANGES) -> str:
    """The flags of changes made after `m` was measured that apply to its figure."""
    return "".join(c.flag for c in changes
                   if m.date < dates[c.commit] and m.metric in c.metrics and c.applies(m.record))


def predicted(m: Measurement, hw) -> float:
    from benchmarks.regimes import predict
    return predict(m.record, hw)[KEY[m.metric]]


def _summary(errs: list[tuple[str, float]], metric: str) -> str:
    if not errs:
        return f"{metric}: no rows"
    a = [abs(e) for _, e in errs]
    worst = max(errs, key=lambda x: abs(x[1]))
    over = [r for r, e in errs if abs(e) > 0.15]
    return (f"{metric}: {len(errs)} rows, median |error| {statistics.median(a) * 100:.1f}%, max "
            f"{max(a) * 100:.1f}% ({worst[0]}); over 15%: {', '.join(over) or 'none'}")


def _unit(metric: str, s: float) -> str:
    return f"{s * 1e3:9.2f} ms" if metric == DECODE else f"{s:9.3f} s "


def report(results: Path, hw_name: str, command: str, dates: dict | None = None) -> tuple[list[str], dict]:
    """The report's lines (command first) and the chosen measurements {(row, metric): m}."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import load_model
    from benchmarks.regimes import MODEL
    hw = load_profile(hw_name)
    found = gather(results, load_model(MODEL).units)
    best, older = newest(found)
    dates = commit_dates() if dates is None else dates
    lines = [f"# {command}",
             f"# {datetime.date.today().isoformat()}: issue 8 rows, newest measurement of each in {results}/"
             f"({', '.join(SOURCES)}), predicted with profile {hw_name}, each with its own plan, decode "
             f"issue and fusion from its JSON", "",
             f"{'row':15}{'metric':8}{'measured':>13}{'predicted':>13}{'error':>8}  {'flags':6}source (file: row, measured at)"]
    errs: dict[str, list[tuple[str, float]]] = {DECODE: [], PREFILL: []}
    missing = []
    for metric in (DECODE, PREFILL):
        for row in ROWS[metric]:
            m = best.get((row, metric))
            if m is None:
                missing.append(f"{row} {metric}")
                continue
            p = predicted(m, hw)
            e = (p - m.seconds) / m.seconds
            errs[metric].append((row, e))
            lines.append(f"{row:15}{metric:8}{_unit(metric, m.seconds):>13}{_unit(metric, p):>13}{e * 100:+7.1f}%  "
                         f"{flags(m, dates):6}{m.file}: {m.name} ({m.date.strftime('%Y-%m-%dT%H:%M')})")
    lines += ["", _summary(errs[DECODE], DECODE), _summary(errs[PREFILL], PREFILL)]
    if missing:
        lines.append("never measured: " + ", ".join(missing))
    lines += ["", "flags (rows measured before these executor changes, by the commit's date; benchmarks/README.md):"]
    lines += [f"  {c.flag} = {c.what} [{c.commit}, {dates[c.commit].isoformat(timespec='minutes')}]" for c in CHANGES]
    lines += [f"  {n}" for n in NOTES]
    if older:
        lines += ["", "older measurements of the same rows (not in the summary), predicted the same way:"]
        for metric in (DECODE, PREFILL):
            for row in ROWS[metric]:
                for m in older.get((row, metric), []):
                    p = predicted(m, hw)
                    lines.append(f"  {row:15}{metric:8}{_unit(metric, m.seconds):>13}{_unit(metric, p):>13}"
                                 f"{(p - m.seconds) / m.seconds * 100:+7.1f}%  {flags(m, dates):6}{m.file}: {m.name}")
    return lines, best


def profile_path(hw_name: str) -> Path:
    """The TOML a profile name (bundled) or path stands for."""
    import kvpipe.hw_profiles as bundled
    here = Path(bundled.__file__).resolve().parent
    name = hw_name.strip().lower()
    path = here / f"{name}.toml" if name in bundled.known_profiles() else Path(hw_name).resolve()
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def main_report(args, command: str) -> None:
    """`regimes --report`: the table (and with `--audit` the profile's fields) on stdout and in
    `--out` (text, the command line first)."""
    lines, best = report(Path(args.results), args.hw, command)
    if args.audit:
        from experiments.profile_audit import audit_lines
        chosen = list(best.values())
        lines += ["", *audit_lines(profile_path(args.hw), lambda hw: [predicted(m, hw) for m in chosen])]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
