"""The buyer's table: several hardware profiles and host-RAM budgets in one `kvpipe plan` call,
side by side per (card, budget): the longest exact context that fits GPU + host + disk, which
budget binds it, and TTFT and decode per token at fixed contexts (exact, and within `--max-error`
when given); optionally a plot of decode time against context per card."""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

from kvpipe.pipeline.model import load_model
from kvpipe.pipeline.units import fmt_bytes, fmt_tokens, parse_tokens
from kvpipe.pipeline.workload import Workload

from .options import PlanOptions

CONTEXTS = (128 * 1024, 1024 * 1024)     # the table's TTFT / decode columns
PLOT_CONTEXTS = (8 * 1024, 32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024)
POOLS = ("gpu", "host", "disk")


def split_list(value: str | None, flag: str) -> list[str | None]:
    """`a,b,c` -> ['a', 'b', 'c']; None -> [None] (the profile's default); an empty item is refused."""
    if value is None:
        return [None]
    items = [v.strip() for v in value.split(",")]
    if any(not v for v in items):
        raise ValueError(f"{flag}: empty item in {value!r} (give names separated by commas, e.g. a,b)")
    return items


def context_given(args) -> bool:
    """`--context` other than plan's default (1M) was given."""
    from .options import DEFAULT_PLAN_CONTEXT
    return args.context is not None and parse_tokens(args.context) != parse_tokens(DEFAULT_PLAN_CONTEXT)


def wants_table(args) -> bool:
    """A plan call asks for the buyer's table when --hw or --host-mem lists more than one value."""
    return any("," in (getattr(args, f) or "") for f in ("hw", "host_mem"))


@dataclass(frozen=True)
class Point:
    """One prediction at one context: seconds, or None where the context does not fit."""

    context: int
    ttft_s: float | None
    decode_s_per_token: float | None
    plan: str | None = None


@dataclass(frozen=True)
class Row:
    """One (card, host budget): budgets in bytes, the longest exact context that fits, the pools
    that bind it (raising any of them alone lets a longer context fit), and the points."""

    hw: str
    budgets: dict
    max_context: int
    binds: tuple[str, ...]
    exact: tuple[Point, ...]
    lossy: tuple[Point, ...] | None = None


def binding_pools(largest_of, budgets: dict[str, int], base: int) -> tuple[str, ...]:
    """The pools whose budget, doubled alone, lets a longer context than `base` fit."""
    return tuple(p for p in POOLS if largest_of({**budgets, p: 2 * budgets[p]}) > base)


def _point(d, spec, work, profile, budgets, req, memo) -> Point:
    pred = d.decide(spec, work, profile, budgets, req, memo=memo).predicted
    if not pred.fits:
        return Point(work.context, None, None)
    t = pred.report.timing
    return Point(work.context, t.ttft_s, t.decode_s_per_token, pred.plan.describe())


def row(opts: PlanOptions, contexts=CONTEXTS, memo=None) -> Row:
    """The table row of one card and budget set (`opts` as for `kvpipe plan`, context unused).
    `memo` (sim/memo.SimMemo): simulations shared with the card's other rows (they do not depend
    on the budgets); None: every search simulates its own."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.sim import decide as d
    spec, profile = load_model(opts.model), load_profile(opts.hw)
    budgets = opts.budgets(profile.gpu_mem_bytes, profile.host_mem_bytes, profile.disk_bytes)
    exact = replace(opts, max_error=None, lossy=None, sparse=None)
    req = exact.request(spec)
    largest_of = lambda b: d.max_context(spec, Workload(1, opts.decode_tokens, opts.batch), b, req)  # noqa: E731
    largest = largest_of(budgets)
    points = tuple(_point(d, spec, Workload(c, opts.decode_tokens, opts.batch), profile, budgets, req, memo)
                   if c <= largest else Point(c, None, None) for c in contexts)
    lossy = None
    if opts.max_error is not None:
        lreq = opts.request(spec)
        lossy = tuple(_point(d, spec, Workload(c, opts.decode_tokens, opts.batch), profile, budgets, lreq, memo)
                      for c in contexts)
    return Row(profile.name, budgets, largest, binding_pools(largest_of, budgets, largest), points, lossy)


def card_rows(jobs: list[PlanOptions], contexts=CONTEXTS, share: bool = True) -> list[Row]:
    """The rows of one card (one per host budget), in order; `share`: their searches share one
    sim/memo.SimMemo, so a plan two budgets both search is simulated once (the same picks)."""
    from kvpipe.sim.memo import SimMemo
    memo = SimMemo() if share else None
    return [row(j, contexts, memo) for j in jobs]


def table(opts: PlanOptions, hws: list[str], host_mems: list[str | None], contexts=CONTEXTS,
          workers: int | None = None, share: bool = True, progress=None) -> list[Row]:
    """One row per (card, host budget), cards outer, in the order given. `workers` processes
    (None: one per core) compute them: `tasks` says which rows share a process.
    `progress(done, total)` is called as rows complete (in order)."""
    cards = [[replace(opts, hw=hw, host_mem=host) for host in host_mems] for hw in hws]
    workers = (os.cpu_count() or 1) if workers is None else workers
    total = sum(map(len, cards))
    if workers <= 1:
        return _collect((card_rows(jobs, contexts, share) for jobs in cards), total, progress)
    jobs = tasks(cards, workers)
    with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
        done = pool.map(card_rows, jobs, [contexts] * len(jobs), [share] * len(jobs))
        return _collect(done, total, progress)


def _collect(done, total: int, progress) -> list[Row]:
    out: list[Row] = []
    for rows in done:
        out += rows
        if progress is not None:
            progress(len(out), total)
    return out


def _progress_line(done: int, total: int) -> None:
    """A row counter on stderr (a terminal only): a table of many rows takes minutes."""
    end = "\n" if done == total else ""
    print(f"\rkvpipe: buyer's table: {done} of {total} rows done", end=end, file=sys.stderr, flush=True)


def tasks(cards: list[list], workers: int) -> list[list]:
    """The processes' work, in row order: the cards that fill whole rounds of `workers` keep their
    rows together (sharing their simulations, `card_rows`); the cards of the last, partial round
    are split into one task per row, so idle workers take rows instead of waiting on one card
    (3 cards on 2 cores: two cards, then the third card's rows side by side)."""
    whole = len(cards) - len(cards) % workers
    return cards[:whole] + [[job] for jobs in cards[whole:] for job in jobs]


def _secs(v: float | None) -> str:
    if v is None:
        return "no fit"
    return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s" if v < 120 else f"{v / 60:.1f} min"


def lines(rows: list[Row], model: str) -> list[str]:
    """The side-by-side text table."""
    ctx = [p.context for p in rows[0].exact]
    head = ["card", "host", "max context", "binds"]
    for c in ctx:
        head += [f"TTFT {fmt_tokens(c)}", f"decode {fmt_tokens(c)}"]
    if rows[0].lossy is not None:
        for c in ctx:
            head += [f"TTFT {fmt_tokens(c)} (max-error)", f"decode {fmt_tokens(c)} (max-error)"]
    body = []
    for r in rows:
        cells = [r.hw, fmt_bytes(r.budgets["host"]), fmt_tokens(r.max_context), "+".join(r.binds) or "none"]
        for p in r.exact + (r.lossy or ()):
            cells += [_secs(p.ttft_s), _secs(p.decode_s_per_token)]
        body.append(cells)
    width = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, width)))  # noqa: E731
    return [f"kvpipe plan: buyer's table for {model} (exact plans; 'binds': budgets that, raised, let a longer "
            "context fit)", fmt(head)] + [fmt(b) for b in body]


def to_json(rows: list[Row], model: str) -> dict:
    return {"model": model, "rows": [asdict(r) for r in rows]}


def plot(rows: list[Row], opts: PlanOptions, path: str) -> None:
    """Decode seconds per token against context, one line per (card, budget) (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: needs matplotlib (pip install kvpipe[plot])") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        known = {p.context for p in r.exact}   # the table's points are reused, only the others simulated
        more = [c for c in PLOT_CONTEXTS if c <= r.max_context and c not in known]
        extra = row(replace(opts, hw=r.hw, host_mem=str(r.budgets["host"]), max_error=None), more).exact if more else ()
        pts = sorted((p for p in r.exact + extra if p.decode_s_per_token), key=lambda p: p.context)
        ax.plot([p.context for p in pts], [p.decode_s_per_token for p in pts], marker="o",
                label=f"{r.hw}, host {fmt_bytes(r.budgets['host'])}")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode s/token",
           title=f"{opts.model}: predicted decode time per token")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cmd_table(args) -> int:
    """`kvpipe plan --hw a,b --host-mem x,y`: the buyer's table (text or --json, and --plot)."""
    from kvpipe.api import load_hw
    hws, hosts = split_list(args.hw, "--hw"), split_list(args.host_mem, "--host-mem")
    for flag in ("compare", "max_context", "out", "trace"):   # the table has no place for them: refused, not dropped
        if getattr(args, flag, None):
            raise ValueError(f"{flag.replace('_', '-')}: not with several --hw or --host-mem values (the buyer's "
                             "table); give one card and one budget")
    for hw in hws:   # a bad name fails in one line before any row is searched
        load_hw(hw)
    given = {**vars(args), "hw": hws[0], "host_mem": hosts[0], "plot": None, "trace": None, "out": None}
    opts = PlanOptions.from_args(given)
    total = len(hws) * len(hosts)
    tty = sys.stderr.isatty()
    if tty and total > 1:
        print(f"kvpipe: buyer's table: {total} rows, each a few seconds of CPU, on up to {os.cpu_count() or 1} "
              "processes", file=sys.stderr)
    contexts = (parse_tokens(args.context),) if context_given(args) else CONTEXTS   # --context: its column alone
    rows = table(opts, hws, hosts, contexts, progress=_progress_line if tty else None)
    if args.json:
        print(json.dumps(to_json(rows, opts.model), indent=2))
    else:
        print("\n".join(lines(rows, opts.model)))
    if args.plot:
        plot(rows, opts, args.plot)
        print(f"plot: {args.plot}")
    return 0
