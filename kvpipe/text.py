"""The text reports `kvpipe plan` and `kvpipe run` print: workload and plan lines, the predicted
(and measured) table, and the side-by-side table of `--compare`."""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

from kvpipe.pipeline.report import decode_step_stats, fmt_s, format_report
from kvpipe.pipeline.units import fmt_bytes, fmt_tokens

from .results import CPU_NOTE, PlanResult, RunResult


def _print_workload_plan(work, plan) -> None:
    print(f"workload: {fmt_tokens(work.context)} prompt tokens, {work.decode_tokens} decode steps, batch {work.batch}")
    print(f"plan: {plan.describe()}")
    print(f"      from {plan.source}")


def _print_search(search, plan) -> None:
    """Why the planner's choice won, and its two runners-up with their predicted figures. A lossy
    plan is the exact search's choice made lossy afterwards: its "why" is said to be the exact one's."""
    if search is None:
        return
    print(f"      why{' (the exact plan, before the lossy option)' if plan.lossy else ''}: {search.reason}")
    print(f"      searched {search.fitting} fitting plans, simulated {search.simulated}, "
          f"pruned {search.pruned} by lower bound"
          + (f", {search.unexplored} left unsimulated (simulation budget)" if search.unexplored else ""))
    for i, alt in enumerate(search.alternatives, 1):
        t = alt.prediction.report.timing
        print(f"  runner-up {i}: {alt.plan.describe()}")
        print(f"      prefill {fmt_s(t.prefill_s)}, first token {fmt_s(t.ttft_s)}, decode "
              f"{fmt_s(t.decode_s_per_token)}/token, total {fmt_s(t.total_s)}"
              + (f" (a {search.ranked_on} run)" if search.ranked_on != "p50" else ""))


def print_plan(res: PlanResult) -> None:
    hw, p = res.hardware, res.predicted
    lossy = f"LOSSY ({p.plan.lossy.describe(res.workload.context)}) " if p.plan.lossy else ""
    print(f"kvpipe plan: {lossy}{res.model.name} on {hw.name} — {hw.description}")
    if res.max_context is not None:
        print(f"max context: {fmt_tokens(res.max_context)} ({res.max_context} tokens) fits the budgets")
    _print_workload_plan(res.workload, p.plan)
    _print_search(res.search, p.plan)
    if res.lossy_choice:
        print(f"lossy choice: {res.lossy_choice}")
    budget = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in res.budgets.items())
    if p.fits:
        print(f"fits: yes   (budgets: {budget})")
    else:
        print(f"fits: NO — {'; '.join(p.problems)}")
    for line in format_report(p.report, p90=p.p90):
        print(line)
    _print_kinds(res.model, res.workload, p.plan)
    _print_fused(p)
    for note in p.report.notes:
        print(f"  note: {note}")


def _print_kinds(model, work, plan) -> None:
    """The KV per layer kind of a model with sliding-window layers (memory.kv_by_kind)."""
    if not model.windows:
        return
    from kvpipe.pipeline.memory import kv_by_kind
    rows = kv_by_kind(model, work, plan)
    print("  kv per layer kind: " + "; ".join(
        f"{r['kind']} x{r['layers']} {fmt_bytes(r['kv_bytes'])}"
        + (f" (of {fmt_bytes(r['full_bytes'])} at full length)" if r["kv_bytes"] < r["full_bytes"] else "")
        + (f", {fmt_bytes(r['disk_bytes'])} of it on disk" if r["disk_bytes"] else "")
        for r in rows))
    held, full = sum(r["kv_bytes"] for r in rows), sum(r["full_bytes"] for r in rows)
    print(f"    KV held {fmt_bytes(held)}, {held / full:.1%} of full attention's {fmt_bytes(full)}: "
          "window layers keep only what their window still sees")


def _print_fused(p) -> None:
    """Whether decode is predicted fused, and the one-time compile that is not in the total."""
    if p.fused:
        c = "unknown for this profile" if p.compile_s is None else fmt_s(p.compile_s)
        print(f"  decode fused (--fuse): compiled once per process, {c}, not in the total")


def print_compare(res: PlanResult) -> None:
    methods = res.methods or {}
    rows = [("fits", lambda r: "yes" if r.fits else "NO"),
            ("prefill", lambda r: fmt_s(r.report.timing.prefill_s)),
            ("time to first token", lambda r: fmt_s(r.report.timing.ttft_s)),
            ("decode per token", lambda r: fmt_s(r.report.timing.decode_s_per_token)),
            ("total", lambda r: fmt_s(r.report.timing.total_s)),
            ("peak gpu", lambda r: fmt_bytes(r.report.peak_bytes["gpu"])),
            ("peak host", lambda r: fmt_bytes(r.report.peak_bytes["host"])),
            ("peak disk", lambda r: fmt_bytes(r.report.peak_bytes["disk"])),
            ("critical lane", lambda r: r.report.critical_lane),
            ("max context", lambda r: fmt_tokens(r.max_context))]
    print(f"\ncompare at {fmt_tokens(res.workload.context)} (headwise: the planner's plan, the others their "
          f"rule's; max context under the budgets):")
    print(f"  {'':22}" + "".join(f"{n:>14}" for n in methods))
    for label, get in rows:
        print(f"  {label:22}" + "".join(f"{get(r):>14}" for r in methods.values()))
    for n, r in methods.items():
        if not r.fits:
            print(f"  {n} does not fit at {fmt_tokens(res.workload.context)}: {'; '.join(r.problems)}")
    chosen = res.predicted.report.timing.total_s
    for n, r in methods.items():   # a rule's plan the table shows faster: said, with how to run it
        if r.fits and n != res.plan.method.value and r.report.timing.total_s < chosen:
            print(f"  {n} fits and is {1 - r.report.timing.total_s / chosen:.1%} faster in total here: --method {n} "
                  f"runs it (the planner searches {res.plan.method.value} plans)")


def _print_cpu_run(res: RunResult) -> None:
    """A CPU run measured, nothing predicted (no profile models a CPU), each tier by its name."""
    m, p, units = res.measured, res.plan, res.model.units
    print(f"      on CPU: {p.resident} of {units} units resident in this process's memory, "
          f"{units - p.resident - p.disk} in the host tier, {p.disk} on disk")
    print(f"  {'':22}{'measured':>14}")
    t = m.timing
    for label, v in (("prefill", t.prefill_s), ("time to first token", t.ttft_s),
                     ("decode per token", t.decode_s_per_token), ("total", t.total_s)):
        print(f"  {label:22}{fmt_s(v):>14}")
    print(f"  {'host tier KV':22}{fmt_bytes(m.peak_bytes['host']):>14}")
    print(f"  {'disk tier KV':22}{fmt_bytes(m.peak_bytes['disk']):>14}")
    print(f"  note: {CPU_NOTE}")


def _lane_here(lane: str, on_gpu: bool) -> str:
    """The compute lane keeps its name `gpu` everywhere; on a CPU run say where it actually ran."""
    return lane if on_gpu or lane != "gpu" else "gpu (the compute lane; it ran on the CPU here)"


def print_run(res: RunResult) -> None:
    lossy = f"LOSSY ({res.plan.lossy.describe(res.workload.context)}) " if res.plan.lossy else ""
    where = f"predicted on profile {res.hardware.name}" if res.modelled else "measured on CPU, nothing predicted"
    print(f"kvpipe run: {lossy}{res.model.name} on {res.device} ({res.weights}); "
          f"attention kernel {res.attention}; {where}")
    _print_workload_plan(res.workload, res.plan)
    if res.modelled:
        _print_search(res.search, res.plan)
    if res.lossy_choice:
        print(f"lossy choice: {res.lossy_choice}")
    if not res.modelled:
        _print_cpu_run(res)
    else:
        for line in format_report(res.predicted.report, res.measured, res.predicted.p90):
            print(line)
        _print_fused(res.predicted)
    d = res.decode_issue or {}
    if d.get("fused"):
        print(f"  measured: decode fused; compile in the timed run {fmt_s(d.get('compile_s') or 0.0)} "
              "(the warm-up compiles first)")
    print(f"  measured critical lane: {_lane_here(res.measured.critical_lane, res.modelled)}; {res.real_trace.note}")
    steps = decode_step_stats(res.real_trace)
    if steps:
        q, h = steps["step_s"], steps["host_issue_s"]
        print(f"  measured decode steps ({steps['steps']}): p50 {fmt_s(q['p50'])}, p90 {fmt_s(q['p90'])}, "
              f"max {fmt_s(q['max'])}; host issue per step p50 {fmt_s(h['p50'])}, p90 {fmt_s(h['p90'])}")
    tokens = res.tokens[0]
    print(f"tokens: {tokens[:16]}{' ...' if len(tokens) > 16 else ''}")
    print(f"output digest: {res.output_digest}")
    if res.plan.lossy:
        e = res.lossy_error
        where = "first decode step" if res.plan.lossy.sparse is not None else "first chunk"
        print(f"LOSSY error measured in this run (first offloaded layer, {where}; not task accuracy): "
              + (", ".join(f"{k} {v:.3g}" for k, v in e.items() if k != "probe_tokens") if e else
                 "none (no decode step scored)" if res.plan.lossy.sparse is not None else
                 "none (no full quantisation block of an offloaded unit in the first prefill chunk)"))
    if res.disk:
        d = res.disk
        print(f"disk: read {fmt_bytes(d['read_bytes'])}, wrote {fmt_bytes(d['write_bytes'])}; crc32c of "
              f"{fmt_bytes(d['checksum_bytes'])} took {fmt_s(d['checksum_s'])} (summed over threads)"
              + "".join(f"; {n}" for n in d["notes"]))


class _Said(logging.Formatter):
    """The `kvpipe` logger's records as the CLI prints them: `kvpipe: ` before what the library
    reports (INFO), `kvpipe: warning: ` before its warnings and errors."""

    def format(self, record: logging.LogRecord) -> str:
        said = super().format(record)   # the message, and its traceback where one was logged
        return ("kvpipe: " if record.levelno < logging.WARNING else "kvpipe: warning: ") + said


@contextmanager
def stderr_log(stream=None):
    """The `kvpipe` logger printed to `stream` (stderr), its progress lines included, while the
    block runs: the CLI's voice. A library call without it says only its warnings."""
    log = logging.getLogger("kvpipe")
    handler, level = logging.StreamHandler(stream or sys.stderr), log.level
    handler.setFormatter(_Said())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
