"""Bad input as a new user types it, through the API and the CLI: every option of kvpipe/options.py
given a wrong type is a ValueError naming the argument; the CLI's line names the flag
(`--decode-tokens`), once, after one `kvpipe: error:` prefix; and one exit-code rule: bad input 2,
valid input that nothing fits 3."""
from __future__ import annotations

import typing
from dataclasses import fields

import pytest

import kvpipe
from conftest import write_config
from kvpipe.options import PlanOptions, RunOptions


class _Odd:
    """A value of no type any option takes."""

    def __repr__(self) -> str:
        return "<odd>"


def _wrong_values(cls, name: str) -> list:
    """Wrong values for field `name`: an object of no type, and a bool or text where an int or float is due."""
    hint = str(typing.get_type_hints(cls)[name])
    out = [_Odd()]
    if "int" in hint or "float" in hint:
        out.append("abc" if "str" not in hint else [1])
    if "bool" not in hint and ("int" in hint or "float" in hint):
        out.append(True)
    if "bool" in hint:
        out.append(1)
    return out


CASES = [(cls, f.name, v) for cls in (PlanOptions, RunOptions) for f in fields(cls) for v in _wrong_values(cls, f.name)]


@pytest.mark.parametrize("cls, name, value", CASES, ids=[f"{c.__name__}.{n}={v!r}" for c, n, v in CASES])
def test_every_option_of_a_wrong_type_is_a_value_error_naming_it(cls, name, value):
    """Fault caught: an option of the wrong type reaching the code that uses it (an
    AttributeError from `.strip()`, `open(42)` reading file descriptor 42, `int('abc')`
    unnamed, True taken as 1)."""
    with pytest.raises(ValueError, match=f"^{name}: expected "):
        cls(**{name: value})


@pytest.mark.parametrize("call, name", [
    (lambda: kvpipe.plan(model=123), "model"),
    (lambda: kvpipe.plan(model=None), "model"),
    (lambda: kvpipe.plan(plan=42), "plan: expected"),
    (lambda: kvpipe.plan(decode_tokens="abc"), "decode_tokens"),
    (lambda: kvpipe.run(seed="x"), "seed"),
    (lambda: kvpipe.run(decode_tokens="abc"), "decode_tokens"),
    (lambda: kvpipe.plan(42), "options"),
])
def test_the_reported_api_calls_raise_value_error_naming_the_argument(call, name):
    """Fault caught: plan(model=123 / None) an AttributeError, plan(plan=42) opening file
    descriptor 42, decode_tokens='abc' an unnamed int() error, seed='x' found after the model
    loaded, plan(42) a TypeError."""
    with pytest.raises(ValueError, match=f"^{name}[: ]"):
        call()


def test_a_path_object_is_a_model(tmp_path_factory):
    """Fault caught: the type check refusing pathlib.Path for --model (or passing it on to code
    that calls .strip() on it)."""
    from pathlib import Path
    assert kvpipe.plan(model=Path(write_config(tmp_path_factory)), context="1K").fits


def _main(capsys, *argv):
    from kvpipe.cli import main
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, flag", [
    (["plan", "--decode-tokens", "abc"], "--decode-tokens"),
    (["plan", "--decode-tokens=-1"], "--decode-tokens"),
    (["plan", "--batch", "0"], "--batch"),
    (["plan", "--hw", "nope"], "--hw"),
    (["plan", "--model", "nope"], "--model"),
    (["plan", "--kv-dir", "/nonexistent/kv"], "--kv-dir"),
    (["run", "--decode-tokens", "x"], "--decode-tokens"),
    (["run", "--device", "tpu"], "--device"),
    (["generate", "--max-new-tokens", "x"], "--max-new-tokens"),
    (["generate", "--prompt", "hi"], "--model"),
    (["calibrate", "--out", "x.txt"], "--out"),
    (["codecs", "--bogus"], None),
    (["plan", "--bogus"], None),
    (["nope"], "command"),
    (["plan", "--context", "abc"], "--context"),
    (["plan", "--gpu-mem", "12XB"], "--gpu-mem"),
    (["plan", "--host-mem", "-1"], "--host-mem"),
    (["plan", "--group", "7"], "--group"),
    (["run", "--model", "TINY", "--random-weights", "--device", "cpu", "--group", "3"], "--group"),
    (["generate", "--model", "/nonexistent", "--prompt", "hi"], "--model"),
    (["generate", "--model", "TINY", "--random-weights", "--prompt-format", "ids", "--prompt", "1 2",
      "--temperature", "-1"], "--temperature"),
    (["generate", "--model", "TINY", "--random-weights", "--prompt-format", "ids", "--prompt", "1 2",
      "--top-p", "2"], "--top-p"),
    (["generate", "--max-new-tokens", "0", "--prompt", "hi"], "--max-new-tokens"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),          # vLLM's and OpenAI's name
    (["plan", "--contxt", "1M"], "--contxt"),
    (["plan", "1M"], "command"),
    (["calibrate", "--base", "nosuch"], "--base"),
    (["calibrate", "--out", "/nonexistent/x.toml"], "--out"),
])
def test_each_subcommand_names_the_flag_once_after_one_prefix(capsys, tiny_config, argv, flag):
    """Fault caught: `kvpipe: error: kvpipe plan: argument --decode-tokens: ...` (the prefix
    doubled), `decode_tokens:` or `model:` (the API's name, not the flag), argparse's
    "unrecognized arguments: ..." naming no flag, calibrate's --base unnamed or its --out folder
    found missing only after the measurements, a traceback, or an exit code other than 2 for bad
    input."""
    rc, _, err = _main(capsys, *[tiny_config if a == "TINY" else a for a in argv])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert lines[0].startswith("kvpipe: error: ") and lines[0].count("kvpipe") == 1, lines
    if flag is not None:
        assert lines[0].startswith(f"kvpipe: error: {flag}: "), lines


@pytest.mark.parametrize("argv, line", [
    (["generate", "--max-tokens", "5"], "--max-tokens: not an option of generate (did you mean --max-new-tokens?)"),
    (["plan", "--gpu-memory=24GB"], "--gpu-memory: not an option of plan (did you mean --gpu-mem?)"),
    (["serve", "--served-name", "x"], "--served-name: not an option of serve (did you mean --served-model-name?)"),
    (["plan", "--bogus"], "--bogus: not an option of plan; --help lists them"),
    (["serve", "--json"], "--json: not an option of serve; --help lists them"),
    (["chat", "--trace", "t.json"], "--trace: not an option of chat; --help lists them"),
])
def test_an_unknown_flag_is_named_with_the_closest_one(capsys, argv, line):
    """Fault caught: argparse's "unrecognized arguments: --max-tokens 5" (no flag named first, no
    hint that generate spells it --max-new-tokens), or a hint from another subcommand's flags;
    or serve's --help listing --json/--trace/--plot (and chat's --trace/--plot), which it refused
    or dropped."""
    rc, _, err = _main(capsys, *argv)
    assert rc == 2 and err == f"kvpipe: error: {line}\n"


@pytest.mark.parametrize("argv, line", [
    (["plan", "--max-context", "128K"], "--max-context: takes no value here, got '128K' (it finds the largest "
                                         "context that fits; --context gives one)"),
    (["plan", "--json", "yes"], "--json: takes no value here, got 'yes'"),
])
def test_a_value_after_a_switch_names_the_switch(capsys, argv, line):
    """Fault caught: `kvpipe plan --max-context 128K` (generate, chat and serve take TOKENS there)
    answered "command: unexpected argument '128K' (plan takes flags only)", naming no flag."""
    rc, _, err = _main(capsys, *argv)
    assert rc == 2 and err == f"kvpipe: error: {line}\n", err


@pytest.mark.parametrize("argv, start", [
    (["--model", "llama-3-8b", "--context", "300", "--sparse", "0.5", "--hw", "h200", "--resident", "none"],
     "--sparse: 0.5 selects nothing at a 300-token context: "),
    (["--context", "8K", "--gpus", "4", "--tp", "2", "--pp", "1"], "--tp: 2 x --pp 1 is not --gpus 4"),
    (["--context", "8K", "--hw", "h200", "--plan", "PLAN", "--replay", "on"],
     "--replay: on disagrees with the plan's replay false; "),
])
def test_the_flag_is_not_named_twice(capsys, tmp_path, argv, start):
    """Fault caught: a message that named its flag itself (`sparse: --sparse 0.5 ...`) and was then
    prefixed with the flag by the CLI: `kvpipe: error: --sparse: --sparse 0.5 selects nothing`."""
    plan = tmp_path / "plan.json"   # a plan that decodes eagerly, for --replay on to disagree with
    assert _main(capsys, "plan", "--context", "8K", "--hw", "h200", "--replay", "off", "--out", str(plan))[0] == 0
    rc, _, err = _main(capsys, "plan", *[str(plan) if a == "PLAN" else a for a in argv])
    assert rc == 2 and err.startswith(f"kvpipe: error: {start}") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [
    ["plan", "--hw", "MISSING"],
    ["plan", "--hw", "BROKEN"],
    ["plan", "--hw", "MISSING,rtx4090"],                  # the buyer's table
    ["generate", "--model", "TINY", "--random-weights", "--prompt-format", "ids", "--prompt", "1 2",
     "--hw", "MISSING", "--device", "cpu"],
])
def test_a_missing_or_broken_profile_file_names_hw(capsys, tmp_path, tiny_config, argv):
    """Fault caught: `--hw ./my-gpu.toml` missing or not TOML answered "kvpipe: error: hw profile
    './my-gpu.toml': file not found", naming no flag (the API's check took any message starting
    "hw" as already named)."""
    (tmp_path / "broken.toml").write_text("[x")
    sub = {"MISSING": str(tmp_path / "nothere.toml"), "BROKEN": str(tmp_path / "broken.toml"), "TINY": tiny_config}
    rc, _, err = _main(capsys, *[",".join(sub.get(p, p) for p in a.split(",")) for a in argv])
    assert rc == 2 and err.startswith("kvpipe: error: --hw: ") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [
    ["plan", "--context", "1M", "--resident", "all"],   # the planner finds no plan
    ["plan", "--gpu-mem", "1GB"],                        # the weights alone exceed the budget
    ["plan", "--max-context", "--gpu-mem", "16GB", "--host-mem", "1GB", "--disk-mem", "1GB"],
])
def test_valid_input_that_nothing_fits_exits_3(capsys, argv):
    """Fault caught: "no plan fits" exiting 2 (bad input) where the README's rule says 3 (valid
    input, nothing fits the budgets), as a rule plan's `fits: NO` already does."""
    rc, _, err = _main(capsys, *argv)
    assert rc == 3 and len(err.strip().splitlines()) == 1 and err.startswith("kvpipe: error: --"), (rc, err)


def test_a_rule_plan_that_does_not_fit_exits_3_and_prints_the_report(capsys):
    """Fault caught: the rule plan's `fits: NO` and the planner's "no plan fits" given two codes."""
    rc, out, _ = _main(capsys, "plan", "--method", "standard", "--context", "1M")
    assert rc == 3 and "fits: NO" in out


def test_run_over_budget_exits_3_before_loading(capsys, tiny_config):
    """Fault caught: `run` with weights over --gpu-mem exiting 2, as if the input were bad."""
    rc, _, err = _main(capsys, "run", "--model", tiny_config, "--random-weights", "--device", "cpu",
                       "--context", "32", "--gpu-mem", "1KB")
    assert rc == 3 and err.startswith("kvpipe: error: --gpu-mem: ") and "executing" not in err, err


def test_help_epilog_states_the_exit_code_rule():
    """Fault caught: --help listing other exit codes than the README (141, 143 missing; 3 only
    for fits: NO)."""
    from kvpipe.cli import UNITS
    for needle in ("2 bad input", "3 valid input but nothing fits", "130", "141", "143"):
        assert needle in UNITS, needle
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for needle in ("| 2 | bad input", "| 3 | valid input, but nothing fits", "| 141 |", "| 143 |"):
        assert needle in readme, needle
