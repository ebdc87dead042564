"""benchmarks/issue8_report.py (`regimes --report`), benchmarks/profile_audit.py and the `--hw` of
`regimes --repredict`, on CPU. Faults caught: an older measurement of a row chosen over a newer
one; a fuse_check row at `--fuse off`, or a 128K plan with no unit resident, taken as an issue-8
row; a row saved before fused decode existed (no `fused` key) predicted fused, or not flagged; a
flag on a row measured after its change; summaries that take signed errors or mix decode and
prefill; `--hw` ignored by the re-prediction; a profile field that moves a prediction left out of
the audit, or one that moves none put in; a source not marked measured passed as measured; the
committed results missing an issue-8 row."""
import datetime
import json
import sys
from pathlib import Path

import pytest

from benchmarks import issue8_report as rep
from benchmarks import regimes
from benchmarks.profile_audit import fields, used_fields

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
S4 = json.loads((RESULTS / "h200-2026-11-30-regimes-rows-s4.json").read_text())
UNITS = 256


def record(name="8k-default", **changes) -> dict:
    r = json.loads(json.dumps(S4["rows"][name]))
    r.update(changes)
    return r


def save(folder: Path, stem: str, date: str, rows: dict, command="python -m benchmarks.regimes") -> None:
    (folder / f"{stem}-regimes.json").write_text(json.dumps({"command": command, "date": date, "rows": rows}))


def test_the_newest_measurement_of_a_row_is_chosen(tmp_path):
    old = record(measured={"prefill_s": 1.0, "decode_s_per_token": 0.010})
    new = record(measured={"prefill_s": 2.0, "decode_s_per_token": 0.020})
    save(tmp_path, "b", "2026-11-30T01:00:00+00:00", {"8k-default": old})   # file names sort against dates
    save(tmp_path, "a", "2026-11-30T05:00:00+00:00", {"8k-default": new})
    best, older = rep.newest(rep.gather(tmp_path, UNITS))
    assert best[("8k-default", rep.DECODE)].seconds == 0.020
    assert best[("8k-default", rep.PREFILL)].file == "a-regimes.json"
    assert [m.seconds for m in older[("8k-default", rep.DECODE)]] == [0.010]


def test_only_default_fuse_streamed_fuse_check_rows_and_mixed_128k_plans_count():
    fc = "python -m benchmarks.fuse_check --out x.json"
    streamed = {"context": 65536, "kind": "streamed", "fuse": "auto",
                "plan": {"resident": 0, "decode": {"group": 8}}}
    assert rep.issue8_rows(fc, "64k-auto", streamed, UNITS) == [("64k-g8-none", rep.DECODE)]
    assert rep.issue8_rows(fc, "64k-off", dict(streamed, fuse="off"), UNITS) == []
    assert rep.issue8_rows(fc, "8k-auto", dict(streamed, kind="resident", plan={"resident": UNITS}), UNITS) == []
    mixed = {"plan": {"resident": 37}}
    assert ("128k-mixed", rep.DECODE) in rep.issue8_rows("regimes", "128k-default", mixed, UNITS)
    assert rep.issue8_rows("regimes", "128k-default", {"plan": {"resident": 0}}, UNITS) == [("128k-default", rep.PREFILL)]


def test_a_row_saved_before_fusion_existed_is_predicted_unfused_and_flagged():
    unfused = record()
    del unfused["fused"]
    fused = record()
    assert regimes.predict(unfused)["decode_s_per_token"] > regimes.predict(fused)["decode_s_per_token"]
    fuse_change = next(c for c in rep.CHANGES if c.flag == "U")
    at = datetime.datetime(2026, 11, 30, 3, tzinfo=datetime.timezone.utc)
    dates = {c.commit: at for c in rep.CHANGES}
    before, after = at - datetime.timedelta(hours=1), at + datetime.timedelta(hours=1)
    m = lambda r, date, metric=rep.DECODE: rep.Measurement("8k-default", metric, "f", "8k-default", date, r)
    assert "U" in rep.flags(m(unfused, before), dates)
    assert "U" not in rep.flags(m(fused, before), dates)            # it ran fused (opt-in then)
    assert rep.flags(m(unfused, after), dates) == ""                 # no change after it
    assert "U" not in rep.flags(m(unfused, before, rep.PREFILL), dates)   # fusion is a decode matter
    assert fuse_change.commit in rep.commit_dates((fuse_change,))


def test_the_warmup_flag_marks_only_prefills_that_attend_a_prefix():
    at = datetime.datetime(2026, 11, 30, 3, tzinfo=datetime.timezone.utc)
    dates = {c.commit: at for c in rep.CHANGES}
    before = at - datetime.timedelta(hours=1)
    one_chunk = record("8k-default")                      # 8K prompt, 8K chunk: no prefix
    chunked = json.loads(json.dumps(S4["rows"]["128k-g2-none"]))
    m = lambda r, metric: rep.Measurement("x", metric, "f", "x", before, r)
    assert "W" not in rep.flags(m(one_chunk, rep.PREFILL), dates)
    assert "W" in rep.flags(m(chunked, rep.PREFILL), dates)
    assert "W" not in rep.flags(m(chunked, rep.DECODE), dates)


def test_summary_takes_absolute_errors_per_metric():
    line = rep._summary([("a", -0.20), ("b", 0.01), ("c", 0.02)], rep.DECODE)
    assert "median |error| 2.0%" in line and "max 20.0% (a)" in line and "over 15%: a" in line
    assert rep._summary([], rep.PREFILL) == "prefill: no rows"


def test_repredict_uses_the_hw_it_is_given(tmp_path, monkeypatch, capsys):
    res = {k: S4[k] for k in ("command", "date", "rates", "hf")}
    res["rows"] = {"8k-default": S4["rows"]["8k-default"]}
    path = tmp_path / "run.json"
    out = {}
    for hw in ("h200", "h200-testbox"):
        path.write_text(json.dumps(res))
        monkeypatch.setattr(sys, "argv", ["regimes", "--repredict", str(path), "--hw", hw])
        regimes.main()
        saved = json.loads(path.read_text())
        assert saved["predicted_on"] == hw
        out[hw] = saved["rows"]["8k-default"]["predicted"]
        assert out[hw] == regimes.predict(res["rows"]["8k-default"], hw)
    assert out["h200"] != out["h200-testbox"]
    capsys.readouterr()


def test_the_audit_lists_exactly_the_fields_a_prediction_moves_with():
    path = rep.profile_path("h200-testbox")
    used, untold = used_fields(path, lambda hw: [hw.h2d_alpha_s + 1e6 / hw.h2d_bytes_per_s])
    assert [f.key for f in used] == ["link.h2d_alpha_s", "link.h2d_bytes_per_s"]
    assert untold == []


def test_a_source_that_is_not_a_measurement_is_marked():
    fs = {f.key: f for f in fields(rep.profile_path("h200-testbox").read_text())}
    assert fs["gpu.small_kernel_s"].measured
    assert not fs["gpu.hbm_peak_bytes_per_s"].measured        # a datasheet peak
    assert not fs["gpu.launch_queue_ops"].measured           # an assumption


@pytest.mark.parametrize("metric", [rep.DECODE, rep.PREFILL])
def test_the_committed_results_hold_every_issue8_row(metric):
    best, _ = rep.newest(rep.gather(RESULTS, UNITS))
    assert [r for r in rep.ROWS[metric] if (r, metric) not in best] == []
