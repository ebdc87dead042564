"""`kvpipe plan` through a subprocess, as a user runs it: tables, JSON, traces and bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvpipe.pipeline.plan import PLAN_SCHEMA

GiB = 2**30


def kvpipe(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpipe", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def plan_json(*args: str) -> dict:
    r = kvpipe("plan", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_default_plan_prints_table():
    r = kvpipe("plan")
    assert r.returncode == 0, r.stderr
    for needle in ("llama-3-8b on rtx4090", "1M prompt tokens", "planner", "runner-up 1", "why", "prefill", "time to first token",
                   "decode per token", "total", "peak gpu", "peak host", "peak disk", "weights",
                   "critical lane"):
        assert needle in r.stdout, needle


def test_compare_llama3_8b_rtx4090_1m():
    out = plan_json("--model", "llama-3-8b", "--hw", "rtx4090", "--context", "1M", "--compare")
    methods = out["methods"]
    assert set(methods) == {"standard", "chunked", "layerwise", "headwise"}
    assert not methods["standard"]["fits"] and not methods["chunked"]["fits"]
    assert methods["headwise"]["fits"]
    # The planner fills the GPU with resident heads beyond HeadInfer's 16.7 GB (its rule: none).
    gpu = methods["headwise"]["predicted"]["peak_bytes"]["gpu"]
    assert 16.7 * GiB < gpu <= out["budgets_bytes"]["gpu"], gpu / GiB
    # HeadInfer's own setting, pinned: it reports 16.7 GB (weights ~15.1, KV on GPU ~1, activations ~0.6).
    pinned = plan_json("--context", "1M", "--group", "1", "--chunk", "4K", "--resident", "none", "--decode-tokens", "2")
    assert abs(pinned["predicted"]["peak_bytes"]["gpu"] / GiB - 16.7) <= 0.1 * 16.7
    assert methods["standard"]["predicted"]["peak_bytes"]["gpu"] > 140e9
    for m in methods.values():
        assert m["max_context"] >= 0
    assert methods["headwise"]["max_context"] >= 2**20 > methods["chunked"]["max_context"]
    assert out["fits"] == methods["headwise"]["fits"]


def test_json_schema_is_stable():
    out = plan_json("--context", "32K", "--decode-tokens", "4")
    for key in ("model", "hardware", "workload", "plan", "fits", "predicted"):
        assert key in out
    pred = out["predicted"]
    for key in ("prefill_s", "ttft_s", "decode_s_per_token", "total_s", "peak_bytes",
                "gpu_breakdown_bytes", "critical_lane"):
        assert key in pred
    assert set(pred["peak_bytes"]) == {"gpu", "host", "disk"}
    assert set(pred["gpu_breakdown_bytes"]) == {"weights", "kv", "buffers", "activations"}
    assert sum(pred["gpu_breakdown_bytes"].values()) == pred["peak_bytes"]["gpu"]
    assert out["workload"] == {"context": 32768, "decode_tokens": 4, "batch": 1}


def test_knobs_override_the_rule():
    out = plan_json("--context", "64K", "--group", "2", "--chunk", "8K", "--resident", "64", "--decode-tokens", "2")
    plan = out["plan"]
    assert plan["prefill"]["group"] == 2 and plan["prefill"]["chunk"] == 8192 and plan["resident"] == 64
    assert plan["decode"]["group"] == 2
    none = plan_json("--context", "64K", "--resident", "none", "--decode-tokens", "2")["plan"]
    assert none["resident"] == 0


def test_plan_that_does_not_fit_says_which_pool():
    # Fault caught (issue 7): "fits: NO" exited 0, so scripts could not tell; it exits 3 now.
    r = kvpipe("plan", "--method", "standard", "--context", "1M", "--decode-tokens", "2")
    assert r.returncode == 3, r.stderr
    assert "fits: NO" in r.stdout and "gpu needs" in r.stdout and "available" in r.stdout


def test_trace_has_one_track_per_lane(tmp_path):
    path = tmp_path / "t.json"
    r = kvpipe("plan", "--context", "16K", "--decode-tokens", "2", "--resident", "none", "--trace", str(path))
    assert r.returncode == 0, r.stderr
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"gpu", "h2d", "d2h", "disk", "cpu"} <= names
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert {e["args"]["kind"] for e in spans} >= {"compute", "h2d", "d2h"}


BAD_TOML = """name = "x"
description = "x"
[gpu]
mem_bytes = 1
"""


@pytest.mark.parametrize("args, field", [
    (["--model", "llama-9"], "llama-9"),
    (["--hw", "rtx9090"], "rtx4090"),          # the message lists the known names
    (["--context", "0"], "context"),
    (["--context", "-5"], "context"),
    (["--context", "lots"], "context"),
    (["--group", "3"], "group"),
    (["--context", "4K", "--chunk", "8K"], "chunk"),
    (["--resident", "many"], "resident"),   # (weights over --gpu-mem: exit 3, test_cli_errors.py)
    (["--model", "/nonexistent/config.json"], "config.json"),
])
def test_bad_input_is_one_line_exit_2(args, field):
    r = kvpipe("plan", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert field in lines[0]


@pytest.mark.parametrize("body, field", [
    (BAD_TOML, "hbm_peak_bytes_per_s"),
    (None, "h2d_bytes_per_s"),
])
def test_bad_hardware_toml(tmp_path, body, field):
    from pathlib import Path
    import kvpipe.hw_profiles as hw_profiles
    path = tmp_path / "gpu.toml"
    if body is None:   # a real profile with one number made non-numeric
        text = (Path(hw_profiles.__file__).parent / "rtx4090.toml").read_text()
        body = "\n".join(ln.replace(ln.split("=")[1].split("#")[0], ' "fast" ')
                         if ln.startswith("h2d_bytes_per_s") else ln for ln in text.splitlines())
    path.write_text(body)
    r = kvpipe("plan", "--hw", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr


def test_planner_modules_never_import_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from kvpipe.cli import main\n"
            "assert main(['plan', '--context', '8K', '--decode-tokens', '2', '--json']) == 0\n"
            "import kvpipe.sim.simulate, kvpipe.pipeline.builder, kvpipe.hw_profiles\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- issue 7: defects a new user found (in-process: kvpipe.cli.main with capsys) -------------
def cli(capsys, *argv: str) -> tuple[int, str, str]:
    from kvpipe.cli import main
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_exit_2(rc: int, err: str, needle: str) -> None:
    assert rc == 2, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


GOOD_PLAN = {"schema": PLAN_SCHEMA, "method": "headwise", "prefill": {"group": 1, "chunk": 4096}, "decode": {"group": 1, "chunk": 1},
             "resident": 0}


@pytest.mark.parametrize("body, needle", [
    ([GOOD_PLAN], "plan: expected a JSON object, got array"),
    ("headwise", "plan: expected a JSON object, got string"),
    (dict(GOOD_PLAN, resident="3"), "plan.resident: expected an integer"),
    (dict(GOOD_PLAN, resident=True), "plan.resident: expected an integer"),
    (dict(GOOD_PLAN, prefill={"group": "1", "chunk": 4096}), "plan.prefill.group"),
    (dict(GOOD_PLAN, prefill={"group": 1, "chunk": 40.5}), "plan.prefill.chunk"),
    (dict(GOOD_PLAN, decode=[1, 1]), "plan.decode: expected a JSON object"),
    (dict(GOOD_PLAN, method=3), "plan.method"),
    (dict(GOOD_PLAN, method="fastest"), "plan.method: unknown 'fastest'"),
    (dict(GOOD_PLAN, prefill={"group": 1, "chunk": 64, "codecs": {"pcie": "none"}}), "plan.prefill.codecs"),
])
def test_bad_plan_file_is_one_line_exit_2(capsys, tmp_path, body, needle):
    # Fault caught (issue 7): a --plan file holding a list, a string or wrong value types gave a
    # traceback (AttributeError/TypeError) or was coerced ("3" -> 3) instead of being refused.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(body))
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--decode-tokens", "1", "--plan", str(path))
    assert_one_line_exit_2(rc, err, needle)


@pytest.mark.parametrize("body", [[{"model_type": "llama"}], "llama", 7])
def test_model_config_that_is_not_an_object_is_one_line_exit_2(capsys, tmp_path, body):
    # Fault caught (issue 7): --model config.json holding a list or a string gave a traceback.
    path = tmp_path / "config.json"
    path.write_text(json.dumps(body))
    rc, _, err = cli(capsys, "plan", "--model", str(path), "--context", "8K")
    assert_one_line_exit_2(rc, err, "expected an object")


def test_model_config_with_a_string_count_is_one_line_exit_2(capsys, tmp_path):
    # Fault caught: "hidden_size": "4096" reached integer division and raised TypeError.
    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": "64", "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, _, err = cli(capsys, "plan", "--model", str(path), "--context", "8K")
    assert_one_line_exit_2(rc, err, "hidden_size")


def test_plot_without_matplotlib_names_the_extra(capsys, tmp_path, monkeypatch):
    # Fault caught (issue 7): `plan --plot` without matplotlib ended in a ModuleNotFoundError
    # traceback (after the simulation). sys.modules entries set to None make the import fail
    # as on a machine without the package.
    for name in ("matplotlib", "matplotlib.backend_bases", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--plot", str(tmp_path / "t.png"))
    assert_one_line_exit_2(rc, err, "kvpipe[plot]")
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("flag, name, needle", [
    ("--trace", "{dir}", "is a directory"),
    ("--trace", "{dir}/trace", ".json extension"),
    ("--trace", "{dir}/missing/t.json", "does not exist"),
    ("--plot", "{dir}", "is a directory"),
    ("--plot", "{dir}/timeline", "image extension"),
    ("--plot", "{dir}/timeline.xyz", "image extension"),
    ("--out", "{dir}", "is a directory"),
    ("--out", "{dir}/plan.txt", ".json extension"),
    ("--out", "{dir}/missing/plan.json", "does not exist"),
])
def test_output_paths_are_checked_before_the_work(capsys, tmp_path, flag, name, needle):
    # Fault caught (issue 7): a directory or a bare name as --trace/--plot failed only after the
    # whole run (IsADirectoryError), or matplotlib silently wrote `timeline.png` instead of the
    # path given; --out's errors named the trace flag and its format. The GPU budget here is also
    # too small: the path is reported first, which shows it is checked before anything else.
    path = name.replace("{dir}", str(tmp_path))
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--gpu-mem", "1GB", flag, path)
    assert_one_line_exit_2(rc, err, flag.lstrip("-") + ":")
    assert needle in err and "gpu-mem" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (a folder no file can be created in)")
def test_an_out_file_that_cannot_be_created_is_one_line_naming_out(capsys):
    # Fault caught: `plan --out` into a folder that refuses new files printed Python's
    # "[Errno 2] No such file or directory: ..." without the flag (and --out's path errors said
    # "trace:", the flag whose check it borrowed). /proc refuses files even to root.
    rc, _, err = cli(capsys, "plan", "--context", "4K", "--decode-tokens", "1", "--out", "/proc/kvpipe-plan.json")
    assert_one_line_exit_2(rc, err, "out: cannot write '/proc/kvpipe-plan.json'")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_out_folder_without_write_permission_is_refused_before_the_work(capsys, tmp_path):
    # Fault caught: a --out folder the user may not write to, found only after the search.
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--gpu-mem", "1GB", "--out", str(folder / "plan.json"))
    assert_one_line_exit_2(rc, err, "out: cannot write")
    assert "gpu-mem" not in err


def test_trace_and_plot_are_written_where_asked(capsys, tmp_path):
    # Fault caught: the file written is not the path reported (e.g. an added extension).
    pytest.importorskip("matplotlib")
    rc, _, err = cli(capsys, "plan", "--context", "4K", "--decode-tokens", "1", "--resident", "none",
                     "--trace", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.svg"))
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.svg"]
    assert f"trace: {tmp_path / 't.json'}" in err and f"plot: {tmp_path / 't.svg'}" in err


@pytest.mark.parametrize("args, needle", [
    (["--host-mem", "0"], "host-mem: must be a positive size"),
    (["--disk-mem=-1GB"], "disk-mem: must be a positive size"),
    (["--gpu-mem=-24GB"], "gpu-mem: must be a positive size"),
])
def test_budgets_must_be_positive(capsys, args, needle):
    # Fault caught (issue 7): a negative GPU budget got "cannot hold the weights" instead of
    # naming the sign; zero or negative host/disk budgets must be refused too.
    rc, _, err = cli(capsys, "plan", "--context", "8K", *args)
    assert_one_line_exit_2(rc, err, needle)


def test_negative_value_without_equals_says_how_to_write_it(capsys):
    # Fault caught: `--disk-mem -1GB` (argparse takes -1GB for a flag) said only "expected one
    # argument"; the line now says how to pass such a value, which then gets the budget check.
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--disk-mem", "-1GB")
    assert_one_line_exit_2(rc, err, "--disk-mem: expected one argument")
    assert "--flag=VALUE" in err


def test_preset_and_hardware_names_ignore_case(capsys):
    # Fault caught (issue 7): `--model Llama-3-8B` or `--hw H200` were "unknown".
    rc, upper, err = cli(capsys, "plan", "--model", "Llama-3-8B", "--hw", "H200", "--context", "8K",
                         "--decode-tokens", "1", "--method", "HEADWISE", "--json")
    assert rc == 0, err
    rc, lower, err = cli(capsys, "plan", "--model", "llama-3-8b", "--hw", "h200", "--context", "8K",
                         "--decode-tokens", "1", "--json")
    assert rc == 0 and json.loads(upper) == json.loads(lower)


@pytest.mark.parametrize("knob", [["--group", "2"], ["--chunk", "1K"], ["--resident", "all"]])
def test_plan_file_with_knobs_is_refused(capsys, tmp_path, knob):
    # Fault caught (issue 7): --plan silently ignored --group/--chunk/--resident given with it.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(GOOD_PLAN))
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--plan", str(path), *knob)
    assert_one_line_exit_2(rc, err, f"drop {knob[0]}")


def test_plan_file_with_a_different_method_is_refused(capsys, tmp_path):
    # Fault caught: `--method layerwise --plan headwise.json` ran the file's method silently.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(GOOD_PLAN))
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--plan", str(path), "--method", "layerwise")
    assert_one_line_exit_2(rc, err, "method: layerwise disagrees")


@pytest.mark.parametrize("method", ["standard", "chunked"])
def test_resident_count_with_an_all_on_gpu_method_is_refused(capsys, method):
    # Fault caught (issue 7): `--method standard --resident 3` ran a "standard" plan with 3
    # units resident, a schedule that method does not have.
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--method", method, "--resident", "3")
    assert_one_line_exit_2(rc, err, f"resident: method {method} keeps every unit on the GPU")


def test_plan_file_with_standard_method_and_partial_residency_is_refused(capsys, tmp_path):
    # Fault caught: the same mix through a plan file.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(dict(GOOD_PLAN, method="standard", resident=3)))
    rc, _, err = cli(capsys, "plan", "--context", "8K", "--plan", str(path))
    assert_one_line_exit_2(rc, err, "resident: method standard keeps all 256 units")


def test_version_and_bare_command(capsys):
    # Fault caught (issue 7): no --version, and bare `kvpipe` printed only an error line.
    import kvpipe
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"kvpipe {kvpipe.__version__}"
    rc, out, err = cli(capsys)
    assert rc == 0 and "usage: kvpipe" in out and "plan" in out and "run" in out, err


@pytest.mark.parametrize("command", ["plan", "run"])
def test_help_shows_defaults_batch_and_units(capsys, command):
    # Fault caught (issue 7): --help showed no defaults, --batch had no help text, and units
    # (binary K/M, GB = 1e9, GiB = 2^30) and exit codes were documented nowhere.
    rc, out, _ = cli(capsys, command, "--help")
    text = " ".join(out.split())
    assert rc == 0
    assert "(default: llama-3-8b)" in text and "(default: 32)" in text and "(default: auto)" in text
    batch = text[text.index("--batch BATCH"):text.index("--gpu-mem GPU_MEM ")]
    assert "sequences" in batch and "(default: 1)" in batch
    for needle in ("128K = 131072", "24GB = 24e9", "24GiB = 24 * 2^30", "3 valid input but nothing fits"):
        assert needle in text, needle



@pytest.mark.parametrize("command", ["plan", "run", "generate", "chat", "serve"])
def test_help_shows_no_empty_or_doubled_default(capsys, command):
    # Fault caught: `(default: [])` after the repeatable --stop and --codec, and --quantile's
    # "(default)" said twice.
    rc, out, _ = cli(capsys, command, "--help")
    text = " ".join(out.split())
    assert rc == 0 and "(default: [])" not in text and "(default: ())" not in text
    q = text[text.index("--quantile {p50,p90} the run"):]
    assert q[:q.index("--fuse")].count("default") == 1

def test_decode_tokens_default_is_the_same_for_plan_and_run():
    # Fault caught (issue 7): plan defaulted to 32 decode steps and run to 16.
    from kvpipe.cli import build_parser
    subs = build_parser()._subparsers._group_actions[0].choices
    defaults = {c: subs[c].parse_args([]).decode_tokens for c in ("plan", "run")}
    assert defaults["plan"] == defaults["run"], defaults


@pytest.mark.parametrize("seconds, text", [
    (0.0123, "12.3 ms"), (4.5, "4.50 s"), (59.99, "59.99 s"), (137.2, "2 min 17 s"),
    (3599.4, "59 min 59 s"), (7384, "2 h 03 min"), (200_000, "55 h 33 min"), (None, "-"),
])
def test_long_times_print_as_hours_minutes_seconds(seconds, text):
    # Fault caught (issue 7): 2 hours printed as "7,384 s".
    from kvpipe.pipeline.units import fmt_seconds
    assert fmt_seconds(seconds) == text


def test_long_prediction_prints_minutes(capsys):
    # Fault caught: the report table not using the h/min/s form for a long run. Llama-3-70B's
    # 32K prefill on an RTX 4060's compute takes minutes.
    rc, out, err = cli(capsys, "plan", "--model", "llama-3-70b", "--hw", "rtx4060", "--context", "32K",
                       "--decode-tokens", "1", "--gpu-mem", "200GB", "--host-mem", "1TB")
    total = next(ln for ln in out.splitlines() if ln.strip().startswith("total"))
    assert " min " in total or " h " in total, total


def test_context_past_max_position_embeddings_warns_once(capsys, tmp_path):
    # Fault caught (issue 7): a context beyond the model's max_position_embeddings ran silently.
    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = cli(capsys, "plan", "--model", str(path), "--context", "8K", "--decode-tokens", "2", "--json")
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvpipe: warning: context:") and "4096" in lines[0], err
    assert json.loads(out)["warnings"] == [lines[0].removeprefix("kvpipe: warning: ")]
    rc, out, err = cli(capsys, "plan", "--model", str(path), "--context", "4000", "--decode-tokens", "2")
    assert rc == 0 and err == ""


def test_docs_and_profiles_point_inside_the_repository():
    # Fault caught (issue 7): profile comments named an absolute path to notes on one machine and
    # the README pointed at ../shared/DESIGN.md, outside the repository; the docs they name now
    # live in docs/ and must exist.
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "hw_profiles").glob("*.toml")) + [root / "README.md"]
    for f in files:
        text = f.read_text()
        assert not re.search(r"/work/|\.\./shared|/home/|/root/", text), f.name
        for ref in re.findall(r"docs/[A-Za-z_]+\.md", text):
            assert (root / ref).is_file(), (f.name, ref)
    assert (root / "docs" / "DESIGN.md").is_file()


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """Fault caught: `kvpipe plan --json | head` printing 'kvpipe: error: [Errno 32] Broken pipe'
    (or a traceback from the exit-time flush) when the reader closes the pipe early."""
    import os
    r, w = os.pipe()
    os.close(r)                                  # the reader is gone before the first byte
    proc = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--model", "llama-3-8b", "--context", "128K",
                           "--json"], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert proc.stderr == "" and proc.returncode == 141


def test_a_gpu_budget_above_the_card_warns_once(capsys):
    """Fault caught: --gpu-mem 100GB on an RTX 4090 (24 GB) planned silently as if the card had it
    ("the whole KV cache fits on the GPU", warnings empty)."""
    rc, out, err = cli(capsys, "plan", "--hw", "rtx4090", "--gpu-mem", "100GB", "--context", "32K",
                       "--decode-tokens", "2", "--json")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 0 and lines == ["kvpipe: warning: gpu-mem: 93.1 GiB is more than the 24.0 GiB of GPU memory "
                                 "rtx4090 has; the plan counts on memory the card does not have"], err
    assert json.loads(out)["warnings"] == [lines[0].removeprefix("kvpipe: warning: ")]
    rc, out, err = cli(capsys, "plan", "--hw", "rtx4090", "--gpu-mem", "20GB", "--host-mem", "1TB",
                       "--context", "32K", "--decode-tokens", "2")
    assert rc == 0 and err == ""


def test_compare_says_where_a_rule_beats_the_planners_plan(capsys):
    """Fault caught: `plan --compare` showing standard faster than the chosen headwise plan (both
    fitting: Llama-3-8B at 128K on an H100, 11.70 s against 11.97 s) with no word on why headwise
    was chosen or how to run the faster one."""
    rc, out, _ = cli(capsys, "plan", "--hw", "h100-sxm", "--context", "128K", "--compare")
    said = [ln.strip() for ln in out.splitlines() if "faster in total here" in ln]
    assert rc == 0 and len(said) == 1, out[-800:]
    assert said[0].startswith("standard fits and is ") and said[0].endswith(
        "--method standard runs it (the planner searches headwise plans)"), said
    rc, out, _ = cli(capsys, "plan", "--hw", "rtx4090", "--context", "1M", "--compare")
    assert rc == 0 and "faster in total here" not in out   # nothing else fits at 1M on a 4090
