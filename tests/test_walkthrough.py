"""What a new user hit walking through the README and each command's --help on a CPU machine:
flags that refuse the README's own spelling, help texts that say one thing and do another.
Parser-level and tiny-model checks only (no checkpoint is loaded here)."""
from __future__ import annotations

import pytest

from kvpipe.cli import build_parser, main
from test_chat import PLACE, chat, chat_model  # noqa: F401  (a tiny Llama with SmolLM2's chat template)
from test_generate_smollm2 import smollm2  # noqa: F401  (the converted GGUF, a session fixture)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_max_context_takes_the_token_units_the_readme_writes(command):
    """Fault caught: `kvpipe chat --model DIR --max-context 16K` (the README's line) exiting 2 with
    "invalid int value: '16K'" because --max-context was type=int while --context takes 16K."""
    args = build_parser().parse_args([command, "--model", "m", "--max-context", "16K"])
    assert args.max_context == 16 * 1024
    assert build_parser().parse_args([command, "--model", "m", "--max-context", "300"]).max_context == 300


def test_a_bad_max_context_says_which_units_it_takes(capsys):
    """Fault caught: `--max-context 16x` answered "invalid int value", hiding that 16K is
    accepted, or a token-count error reaching the user as a traceback instead of one line."""
    rc = main(["chat", "--model", "m", "--max-context", "16x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvpipe: error: --max-context: "), err
    assert "128K" in err[0] and "Traceback" not in err[0], err


def test_chat_save_faults_are_one_line_and_the_session_goes_on(chat_model, monkeypatch, capsys, tmp_path):
    """Fault caught: `/save DIR` where DIR cannot be created ending the whole chat session (the
    conversation lost) with `kvpipe: error: [Errno 20] ...`; `/save` after /reset (or before the
    first turn) printing transformers' "Cannot apply chat template to an empty conversation";
    `/save` without DIR and `/foo` answered by the help line alone, not saying what was wrong."""
    (tmp_path / "file").write_text("x")
    script = (f"/save {tmp_path / 'early'}\n/save\n/foo\nHi\n/save {tmp_path / 'file' / 'kv'}\n"
              f"Hi again\n/reset\n/save {tmp_path / 'late'}\n/exit\n")
    code, turns, err = chat(chat_model, monkeypatch, capsys, script, "--max-context", "200", *PLACE)
    lines = [x for x in err.splitlines() if not x.startswith("kvpipe: chat, up to")]
    assert code == 0 and len(turns) == 2, err
    assert "Traceback" not in err and "chat template" not in err and "error:" not in err, err
    assert sum("nothing to save yet" in x for x in lines) == 2, lines
    assert any(x.startswith("kvpipe: /save needs a directory") for x in lines), lines
    assert any(x.startswith("kvpipe: unknown command /foo") for x in lines), lines
    assert any(x.startswith(f"kvpipe: /save {tmp_path / 'file' / 'kv'}: ") for x in lines), lines
    assert not (tmp_path / "early").exists() and not (tmp_path / "late").exists()


def test_ctrl_d_at_the_chat_prompt_ends_its_line(monkeypatch, capsys):
    """Fault caught: Ctrl-D at `> ` leaving the shell's next prompt on the same line as `> `
    (input() prints no newline at end of file)."""
    from kvpipe.chat_cli import _lines

    def eof(prompt):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    assert list(_lines(tty=True)) == []
    assert capsys.readouterr().err == "\n"


def test_generate_save_kv_says_what_it_saved_and_where(chat_model, capsys, tmp_path):
    """Fault caught: `generate --save-kv DIR` finishing with no word that anything was saved (the
    user cannot tell a save happened, or how many tokens --load-kv will reuse)."""
    import json
    kv = tmp_path / "doc.kv"
    rc = main(["generate", "--model", str(chat_model), "--random-weights", "--device", "cpu", "--prompt", "Hi",
               "--max-new-tokens", "2", "--save-kv", str(kv), *PLACE])
    err = capsys.readouterr().err.splitlines()
    n = json.loads((kv / "manifest.json").read_text())["tokens_saved"]
    assert rc == 0 and f"kvpipe: saved {n} tokens' KV to {kv} (continue with --load-kv {kv})" in err, err


def test_a_cpu_run_does_not_name_the_gpu_as_where_it_ran(tiny_config, capsys):
    """Fault caught: `kvpipe run --device cpu` printing "measured critical lane: gpu" on a machine
    with no GPU (the compute lane's name, unexplained)."""
    rc = main(["run", "--model", tiny_config, "--random-weights", "--device", "cpu", "--context", "32",
               "--decode-tokens", "2", "--resident", "all", "--no-progress"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "measured critical lane:" in x)
    assert rc == 0 and "gpu" in line and "ran on the CPU" in line, line


def test_the_buyers_table_reports_its_rows_as_they_complete():
    """Fault caught: `kvpipe plan --hw a,b --host-mem x,y` silent for minutes (about 7 s of CPU a
    row) with no sign of progress: the counter must be called once per row, ending at the total."""
    from kvpipe import buyers
    from kvpipe.options import PlanOptions
    seen = []
    opts = PlanOptions.from_args({"model": "llama-3-8b", "hw": "rtx4090", "context": "8K"})
    rows = buyers.table(opts, ["rtx4090", "rtx5090"], ["32GB"], contexts=(8192,), workers=1,
                        progress=lambda done, total: seen.append((done, total)))
    assert len(rows) == 2 and seen == [(1, 2), (2, 2)]


def test_the_readme_commands_table_lists_each_subcommand_once():
    """Fault caught: the README's Commands table listing `kvpipe generate` twice with two
    different descriptions, or missing a subcommand `kvpipe --help` offers."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `kvpipe (\w+)` \|", table, flags=re.M)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(listed) == sorted(sub.choices), listed


@pytest.mark.parametrize("flag", [["--compare"], ["--max-context"], ["--out", "p.json"], ["--trace", "t.json"]])
def test_the_buyers_table_refuses_flags_it_would_drop(capsys, tmp_path, monkeypatch, flag):
    """Fault caught: `kvpipe plan --hw rtx4090,rtx5090 --compare` (or --max-context, --out FILE,
    --trace FILE) printing the buyer's table as if the flag were not there: no comparison, and
    no plan or trace file written though the user asked for one."""
    monkeypatch.chdir(tmp_path)
    rc = main(["plan", "--hw", "rtx4090,rtx5090", *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"kvpipe: error: {flag[0]}: "), err
    assert not any(tmp_path.iterdir())


def test_the_readmes_cpu_run_names_a_model_the_repository_ships(monkeypatch, capsys):
    """Fault caught: the README's first CPU run (`kvpipe run --model ./tiny/config.json
    --random-weights ...`) and its `kvpipe.run(...)` line naming a config.json no clone has, so a
    new user's first real run exits 2 ("model: no file")."""
    import re
    import shlex
    from pathlib import Path

    from kvpipe.pipeline.model import load_model
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("kvpipe run --model") and "--device cpu" in ln)
    api_model = re.search(r'kvpipe\.run\("([^"]+)", random_weights=True', readme).group(1)
    argv = shlex.split(line)[1:]
    monkeypatch.chdir(root)   # the README's paths are a clone's
    for model in (argv[argv.index("--model") + 1], api_model):
        assert load_model(model).layers > 0, model
    rc = main(argv + ["--decode-tokens", "2", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
