"""The Python API (`kvpipe.plan`, `kvpipe.run`): its results are what `--json` prints, its
keyword arguments are the CLI's flags, and bad input is a ValueError naming the argument."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvpipe
from kvpipe.cli import build_parser, main



def cli_json(capsys, *argv: str) -> dict:
    rc = main(list(argv) + ["--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_plan_result_is_what_the_cli_prints(capsys):
    # Fault caught: the API and `plan --json` drifting apart (a key added to one, a value
    # computed twice in different ways).
    kw = dict(model="mistral-7b", hw="h200", context="16K", decode_tokens=3, gpu_mem="20GB", group=2)
    res = kvpipe.plan(**kw)
    printed = cli_json(capsys, "plan", "--model", "mistral-7b", "--hw", "h200", "--context", "16K",
                       "--decode-tokens", "3", "--gpu-mem", "20GB", "--group", "2")
    assert res.to_json() == printed
    assert isinstance(res, kvpipe.PlanResult) and res.plan.prefill.group == 2
    assert res.fits and res.budgets["gpu"] == 20 * 10**9
    assert res.predicted.report.timing.total_s == printed["predicted"]["total_s"] > 0


def test_compare_result_is_what_the_cli_prints(capsys):
    # Fault caught: --compare's per-method entries (max_context included) built differently
    # by the API and the CLI.
    res = kvpipe.plan(context="8K", decode_tokens=1, compare=True)
    assert set(res.methods) == {"standard", "chunked", "layerwise", "headwise"}
    assert res.to_json() == cli_json(capsys, "plan", "--context", "8K", "--decode-tokens", "1", "--compare")
    assert all(m.max_context > 0 for m in res.methods.values())


def test_plan_runs_without_torch(tmp_path):
    # Fault caught: `import kvpipe` or `kvpipe.plan` pulling in torch/transformers (the planner
    # must work on a laptop without them).
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import kvpipe\n"
            "r = kvpipe.plan(context='8K', decode_tokens=2)\n"
            "assert r.fits and r.to_json()['workload']['context'] == 8192\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_plan_round_trips_through_plan_arg(capsys, tmp_path):
    # Fault caught: a plan printed by --json that --plan / plan= cannot read back identically.
    first = kvpipe.plan(context="32K", decode_tokens=2, group=4, chunk="8K", resident=40)
    again = kvpipe.plan(context="32K", decode_tokens=2, plan=first.plan.to_json())
    assert again.plan == first.plan
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(first.to_json()["plan"]))
    assert cli_json(capsys, "plan", "--context", "32K", "--decode-tokens", "2", "--plan", str(path)) \
        == again.to_json()


@pytest.mark.parametrize("command", ["plan", "run"])
def test_every_flag_is_a_keyword_argument(command):
    # Fault caught: a CLI flag the API does not take (the CLI passes flags by name, so a flag
    # without a parameter would be dropped silently).
    import inspect
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    dests = {a.dest for a in sub._actions} - {"help", "json"}
    params = set(inspect.signature(getattr(kvpipe, command)).parameters)
    assert dests <= params, dests - params


@pytest.mark.parametrize("kw, field", [
    (dict(gpu_mem="-8GB"), "gpu-mem"),
    (dict(host_mem=0), "host-mem"),
    (dict(disk_mem="-1GB"), "disk-mem"),
    (dict(method="fastest"), "method"),
    (dict(resident="lots"), "resident"),
    (dict(group=0), "group"),
    (dict(plan={"method": "headwise"}, group=2), "plan"),
])
def test_api_bad_input_names_the_argument(kw, field):
    # Fault caught: the API raising TypeError/KeyError, or a message that does not say which
    # argument was wrong.
    with pytest.raises(ValueError, match=f"^{field}"):
        kvpipe.plan(context="8K", decode_tokens=1, **kw)


def test_run_result_is_what_the_cli_prints(tiny_config, capsys):
    # Fault caught: `kvpipe.run` and `kvpipe run --json` disagreeing on anything but the clock.
    pytest.importorskip("torch")
    # the disk budget is given: by default it is the free space under --kv-dir, which other
    # writers on the machine change between the two runs
    kw = dict(context=64, decode_tokens=3, chunk=16, resident="none", group=1, seed=4, disk_mem="1GiB")
    res = kvpipe.run(model=tiny_config, random_weights=True, device="cpu", progress=False, **kw)
    capsys.readouterr()
    printed = cli_json(capsys, "run", "--model", tiny_config, "--random-weights", "--device", "cpu",
                       "--no-progress", "--context", "64", "--decode-tokens", "3", "--chunk", "16",
                       "--resident", "none", "--group", "1", "--seed", "4", "--disk-mem", "1GiB")
    mine = res.to_json()
    assert mine == json.loads(json.dumps(mine))          # JSON-native as is (lists, str keys)
    measured, printed_measured = mine.pop("measured"), printed.pop("measured")
    assert mine == printed                               # plan, prediction, tokens, digest, device ...
    assert measured.keys() == printed_measured.keys()    # timings differ run to run; the shape does not
    assert measured["peak_bytes"] == printed_measured["peak_bytes"]
    assert isinstance(res, kvpipe.RunResult) and len(res.tokens[0]) == 4 and res.device == "cpu"


def test_the_cli_and_the_api_share_one_options_type(capsys):
    # Fault caught: the CLI and the API building their requests apart (a flag the options drop,
    # a check one of them skips): the CLI's parsed flags are a PlanOptions whose plan is the
    # API's, and a bad field is refused when the options are built, naming it.
    from kvpipe.options import PlanOptions, RunOptions
    args = build_parser().parse_args(["plan", "--context", "8K", "--decode-tokens", "1", "--group", "2"])
    opts = PlanOptions.from_args(args)
    assert opts.context == "8K" and opts.group == "2" and opts.replay == "auto"
    assert kvpipe.plan(opts).to_json() == kvpipe.plan(context="8K", decode_tokens=1, group=2).to_json()
    assert kvpipe.plan(opts, group=4).plan.prefill.group == 4           # keywords over the options
    for cls, kw, field in ((PlanOptions, dict(group=0), "group"), (PlanOptions, dict(replay="yes"), "replay"),
                           (RunOptions, dict(chunk="lots"), "chunk"), (RunOptions, dict(objective="x"), "objective"),
                           (PlanOptions, dict(disk="max"), "disk"), (RunOptions, dict(lossy="int3"), "lossy")):
        with pytest.raises(ValueError, match=f"^{field}"):
            cls(**kw)
    with pytest.raises(TypeError):
        kvpipe.plan(compare=True, random_weights=True)                  # a run-only field is not a plan's


def test_a_positional_model_name_is_the_model():
    # Fault caught: kvpipe.plan("mistral-7b") refused, or read as another option; plan(42) a
    # TypeError rather than the ValueError naming the argument the API promises.
    assert kvpipe.plan("mistral-7b", context="32K").model.name == "mistral-7b"
    with pytest.raises(ValueError, match="^options: .*model name"):
        kvpipe.plan(42)
