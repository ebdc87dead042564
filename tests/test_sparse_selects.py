"""Sparse decode where it cannot select (pipeline/lossy_select.py): what a step selects by score
against what it takes unscored, counted here by brute force over the executor's own selection
(executor/sparse/sketch.select on real scores); the refusal of a --sparse whose forced tokens fill
its budget (one line, exit 2, naming --sparse and the smallest context that selects); the
effective fraction in `--json` and on the LOSSY line; --max-error never picking such a fraction."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, strategies as st

from kvpipe import api
from kvpipe.cli import main
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.lossy_select import min_selecting_context, selection, selects
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.sim.lossy_choice import choose_lossy, options

PLAN = ["plan", "--context", "1536", "--hw", "h200", "--resident", "none", "--decode-tokens", "4"]


def _brute(spec: LossySpec, prefix: int) -> tuple[int, int]:
    """(forced, eligible) by the definition, token by token: a token is forced when it is a sink
    token, in the recent window, or past the last whole chunk (no sketch); the rest are eligible."""
    sealed = prefix // spec.chunk * spec.chunk
    forced = sum(1 for t in range(prefix) if t < spec.sink or t >= prefix - spec.recent or t >= sealed)
    return forced, prefix - forced


@given(st.integers(1, 6000), st.sampled_from([0.05, 0.1, 0.2, 0.3, 0.5, 0.9]),
       st.sampled_from([(64, 256), (4, 32), (0, 100), (128, 0)]))
def test_forced_and_selected_tokens_add_up_to_the_step(prefix, f, win):
    """Faults caught: the forced count missing the unsealed tail chunk or the sink (the effective
    fraction overstated), selected counted as the whole fetch (forced included), or eligible not
    prefix - forced."""
    spec = LossySpec(sparse=f, sink=win[0], recent=win[1])
    sel = selection(spec, prefix)
    forced, eligible = _brute(spec, prefix)
    assert (sel["forced_tokens"], sel["eligible_tokens"]) == (forced, eligible)
    fetched = min(prefix, max(math.ceil(f * prefix), forced))
    assert sel["selected_tokens"] == fetched - forced
    assert sel["asked_tokens"] == min(prefix, math.ceil(f * prefix))
    assert selects(spec, prefix) == (fetched > forced)


@given(st.integers(100, 20000), st.sampled_from([0.05, 0.1, 0.2, 0.3]), st.booleans())
def test_the_smallest_selecting_context_is_the_smallest(prefix, f, quant):
    """Faults caught: the context named in the refusal one too large or too small (an analytic
    (sink + recent) / F that ignores the ceil, or block rounding with int4)."""
    spec = LossySpec("int4" if quant else None, sparse=f)
    if selects(spec, prefix):
        return
    least = min_selecting_context(spec, prefix)
    assert selects(spec, least) and not any(selects(spec, p) for p in range(prefix, least))


def test_sparse_20pct_at_1536_is_refused_in_one_line_naming_the_flag_and_the_context(capsys):
    """Fault caught: --sparse 0.2 at 1.5K (sink 64 + recent 256 = 320 forced > 308 asked) running
    as a sink + recent window labelled a scored 20%, or refused with the wrong exit code or a
    traceback."""
    rc = main(PLAN + ["--sparse", "0.2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvpipe: error: --sparse: 0.2 selects nothing") and "1601-token context" in err, err
    with pytest.raises(ValueError, match="^sparse: "):
        api.plan(model="llama-3-8b", hw="h200", context=1536, resident="none", decode_tokens=4, sparse=0.2)


def test_json_and_the_lossy_line_carry_the_effective_fraction(capsys):
    """Fault caught: the effective fraction left out of `lossy` in --json or off the LOSSY line, or
    reported as the asked fraction (0.2) instead of what the score selects (90 of 1728 at 2048)."""
    args = PLAN[:2] + ["2048"] + PLAN[3:] + ["--sparse", "0.2"]
    assert main(args + ["--json"]) == 0
    sel = json.loads(capsys.readouterr().out)["lossy"]["selection"]
    assert (sel["forced_tokens"], sel["selected_tokens"], sel["eligible_tokens"]) == (320, 90, 1728)
    assert sel["effective_fraction"] == pytest.approx(90 / 1728) and sel["forced_fraction"] == pytest.approx(320 / 2048)
    assert main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "LOSSY" in ln)
    assert "90 of 1728 eligible tokens selected by score (effective 5.2%), 320 forced (16%)" in line


class _Pred:
    def __init__(self, plan):
        self.plan, self.problems = plan, ()
        t = 0.1 if plan.lossy is not None and plan.lossy.sparse is not None else 1.0   # sparse fastest
        self.report = type("R", (), {"timing": type("T", (), {"total_s": t})()})()


def test_max_error_never_picks_a_sparse_fraction_that_selects_nothing():
    """Fault caught: --max-error picking sparse 20% at 1.5K by its measured error (a scored
    selection's) where the step would select nothing; at 4K the same budget picks it."""
    plan = Plan(Method.HEADWISE, PhasePlan(8, 2048), PhasePlan(8, 1), 0)
    sparse = [o for o in options() if o.sparse is not None]
    for ctx in (1536, 4096):
        _, choice = choose_lossy(plan, 0.999, "total", _Pred, context=ctx)
        rows = {name: verdict for name, _, verdict in choice.rows}
        for o in sparse:
            if selects(o.spec(0.5), ctx):
                assert "selects nothing" not in rows[o.name]
            else:
                assert choice.chosen != o.name
                assert rows[o.name].startswith("selects nothing" if o.measured.worst <= 0.999 else "above the budget")
        assert rows["sparse 20%"].startswith("selects nothing" if ctx == 1536 else "predicted")
        assert choice.chosen is not None and choice.chosen.startswith("sparse")   # sparse is the fastest


def test_sparse_where_every_token_is_forced_is_refused_before_the_model_loads(tmp_path, capsys):
    """Fault caught: a 300-token context (sink 64 + recent 256 cover all of it, nothing eligible)
    counted as selecting, so `generate --sparse 0.5` ran exact attention labelled LOSSY with 0
    tokens selected; it must be one line naming --sparse, exit 2, before any weights load, and
    `plan` must agree."""
    from conftest import TINY_LLAMA
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    ids = " ".join(str(i % 200) for i in range(300))
    rc = main(["generate", "--model", str(cfg), "--random-weights", "--device", "cpu", "--prompt-format", "ids",
               "--prompt", ids, "--max-new-tokens", "2", "--sparse", "0.5", "--resident", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvpipe: error: --sparse: 0.5 selects nothing") and "executing" not in err, err
    assert "are the whole context" in err and "641-token context" in err, err
    assert main(["plan", "--context", "300", "--hw", "h200", "--resident", "none", "--sparse", "0.5"]) == 2
    assert capsys.readouterr().err.startswith("kvpipe: error: --sparse: 0.5 selects nothing")
