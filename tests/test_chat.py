"""`kvpipe chat` (kvpipe/chat_cli.py) on a kept conversation, scripted through a pipe: a tiny random
Llama with SmolLM2's tokenizer and chat template (vocabulary 49152; skipped without the GGUF)."""
from __future__ import annotations

import io
import json
import re
import shutil

import pytest

import kvpipe
from kvpipe.cli import main
from kvpipe.conversation import Conversation, common_prefix

torch = pytest.importorskip("torch")
from test_generate_smollm2 import smollm2  # noqa: E402,F401  (the converted GGUF, a session fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
PLACE = ["--resident", "2", "--disk", "2", "--chunk", "16", "--group", "1"]
N = 8


@pytest.fixture(scope="module")
def chat_model(smollm2, tmp_path_factory):
    """config.json of a tiny Llama (3 KV heads) beside SmolLM2's tokenizer files."""
    d = tmp_path_factory.mktemp("chat")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2[2] / f).is_file():
            shutil.copy(smollm2[2] / f, d / f)
    cfg = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 96, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
           "max_position_embeddings": 2048, "torch_dtype": "float32", "tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def chat(chat_model, monkeypatch, capsys, script: str, *flags) -> tuple[int, list[dict], str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    code = main(["chat", "--model", str(chat_model), "--random-weights", "--device", "cpu", "--json",
                 "--max-new-tokens", str(N), *flags])
    out = capsys.readouterr()
    return code, [json.loads(line) for line in out.out.splitlines() if line.startswith("{")], out.err


def test_turn_two_is_the_one_shot_run_and_prefills_only_its_new_tokens(chat_model, monkeypatch, capsys):
    """Fault caught: a turn prefilling the whole conversation again (the KV not kept between
    turns), a turn attending to KV of the wrong positions (disk rows not cut back after the decode
    steps run past the end), or the template's turns composed otherwise than a one-shot run sees."""
    code, turns, _ = chat(chat_model, monkeypatch, capsys, "Hello there\nWhat comes next?\n/exit\n",
                          "--max-context", "200", *PLACE)
    assert code == 0 and len(turns) == 2
    with Conversation(str(chat_model), random_weights=True, device="cpu", max_context=200) as c:
        first = c.render([{"role": "user", "content": "Hello there"}])
        msgs = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": turns[0]["text"]},
                {"role": "user", "content": "What comes next?"}]
        full = c.render(msgs)
    home = first + turns[0]["tokens"][:-1]
    kept = common_prefix(home, full)
    assert kept > len(first) // 2   # random text may retokenize across the turn seam (real text: test_chat_smollm2)
    assert turns[1]["timings"]["reused_tokens"] == kept
    assert turns[1]["timings"]["prefill_tokens"] == len(full) - kept
    assert turns[1]["usage"]["prompt_tokens"] == len(full)
    one = kvpipe.generate(str(chat_model), " ".join(map(str, full)), prompt_format="ids", max_new_tokens=N,
                          random_weights=True, device="cpu", resident="2", disk="2", chunk=16, group=1)
    assert turns[1]["tokens"] == one.tokens


def test_reset_forgets_and_save_writes_a_kv_directory(chat_model, monkeypatch, capsys, tmp_path):
    """Fault caught: /reset leaving the old conversation's tokens home (the turn after it not the
    first turn again), or /save writing a directory that --load-kv cannot continue from."""
    code, turns, err = chat(chat_model, monkeypatch, capsys,
                            f"Hi\n/reset\nHi\n/save {tmp_path / 'kv'}\n/exit\n", "--max-context", "200", *PLACE)
    assert code == 0 and turns[0]["tokens"] == turns[1]["tokens"]
    assert turns[1]["timings"]["reused_tokens"] == 0 and "saved" in err
    got = kvpipe.generate(str(chat_model), "More?", load_kv=tmp_path / "kv", max_new_tokens=3,
                          random_weights=True, device="cpu", resident="2", disk="2", chunk=16, group=1)
    man = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    assert got.timings["reused_tokens"] == man["tokens_saved"] > 0 and len(man["messages"]) == 2



def test_save_says_what_it_replaced_and_refuses_a_file_on_one_line(chat_model, monkeypatch, capsys, tmp_path):
    """Fault caught: a second /save replacing the first without a word, or /save to a file
    ("File exists") or to a folder of other files (their kv-*.bin deleted) instead of one line
    naming the problem, the session going on."""
    kv, afile = tmp_path / "kv", tmp_path / "afile"
    afile.write_text("x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kv-keep.bin").write_text("keep")
    code, turns, err = chat(chat_model, monkeypatch, capsys, f"Hi\n/save {kv}\nMore\n/save {kv}\n/save {afile}\n"
                            f"/save {mine}\nAgain\n/exit\n", "--max-context", "200", *PLACE)
    saves = [line for line in err.splitlines() if "/save" in line or "saved" in line]
    assert code == 0 and len(turns) == 3 and len(saves) == 4, err
    first = int(re.fullmatch(rf"kvpipe: saved (\d+) tokens' KV to {re.escape(str(kv))}", saves[0]).group(1))
    last = json.loads((kv / "manifest.json").read_text())["tokens_saved"]
    assert saves[1] == f"kvpipe: saved {last} tokens' KV to {kv}, replacing its save of {first} tokens"
    assert saves[2] == f"kvpipe: /save {afile}: {str(afile)!r} is a file; give a folder (new, empty, or a saved KV directory)"
    assert saves[3].startswith(f"kvpipe: /save {mine}: {str(mine)!r} holds other files") and (mine / "kv-keep.bin").exists()


def test_a_full_conversation_says_so_on_one_line(chat_model, monkeypatch, capsys):
    """Fault caught: a conversation past its planned capacity failing deep in the run (or ending
    the session) instead of one line saying it is full; or, piped, the session exiting 0 although
    a turn was refused (a script cannot tell)."""
    code, turns, err = chat(chat_model, monkeypatch, capsys, "Hello there\nWhat comes next?\n/exit\n",
                            "--max-context", "40", *PLACE)
    assert code == 2 and len(turns) == 1
    assert any(line.startswith("kvpipe: max-context: the conversation is full") for line in err.splitlines())


def test_a_capacity_below_the_templates_first_turn_is_refused_at_start(chat_model, monkeypatch, capsys):
    """Fault caught: `--max-context 10`, which the chat template's turns alone overflow, accepted
    and every turn then refused as "the conversation is full" (nothing was said yet) with exit 0."""
    code, turns, err = chat(chat_model, monkeypatch, capsys, "hi\nhello\n", "--max-context", "10")
    lines = [ln for ln in err.splitlines() if ln.startswith("kvpipe: error:")]
    assert code == 2 and not turns and len(lines) == 1, err
    assert lines[0].startswith("kvpipe: error: --max-context: 10 tokens cannot hold a first turn"), lines


def test_ctrl_c_stops_the_answer_not_the_session(chat_model):
    """Fault caught: an interrupted answer leaving the session unusable, or its partial K/V (disk
    rows appended past the conversation) read by the next turn."""
    opts = dict(random_weights=True, device="cpu", resident="2", disk="2", chunk=16, group=1)

    def stop(piece):
        raise KeyboardInterrupt
    with Conversation(str(chat_model), max_context=200, **opts) as c:
        with pytest.raises(KeyboardInterrupt):
            c.say("Hello there", stream=stop, max_new_tokens=N, ignore_eos=True)
        again = c.say("Hello there", max_new_tokens=N)
    with Conversation(str(chat_model), max_context=200, **opts) as fresh:
        assert again.tokens == fresh.say("Hello there", max_new_tokens=N).tokens


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "2"), ("--min-p", "1")])
def test_a_bad_sampling_flag_is_refused_before_the_model_loads(chat_model, monkeypatch, capsys, flag, value):
    """Fault caught: `chat --temperature -1` loaded the model, then refused every turn on its own
    line and exited 0, where generate refuses it once, naming the flag, with exit 2."""
    import kvpipe.generation as generation
    monkeypatch.setattr(generation, "load", lambda *a, **k: pytest.fail("the model loaded before the flags were checked"))
    code, turns, err = chat(chat_model, monkeypatch, capsys, "Hello there\n", flag, value)
    assert code == 2 and turns == [] and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvpipe: error: {flag}:"), err


def test_an_interrupted_turn_is_not_counted(chat_model):
    """Fault caught: Ctrl-C during an answer dropped the turn but counted it, so the next turn's
    stderr line said "turn 2" in a conversation of one turn."""
    def stop(piece):
        raise KeyboardInterrupt
    with Conversation(str(chat_model), max_context=200, random_weights=True, device="cpu") as c:
        with pytest.raises(KeyboardInterrupt):
            c.say("Hello there", stream=stop, max_new_tokens=N, ignore_eos=True)
        c.say("Hello there", max_new_tokens=N)
        assert c.turns == 1


def test_a_loaded_conversation_counts_its_turns_on(chat_model, monkeypatch, capsys, tmp_path):
    """Fault caught: `kvpipe chat --load-kv DIR` numbered its first turn 1 although the saved
    conversation already held two."""
    chat(chat_model, monkeypatch, capsys, f"Hi\nAnd then?\n/save {tmp_path / 'kv'}\n/exit\n", "--max-context", "200", *PLACE)
    monkeypatch.setattr("sys.stdin", io.StringIO("More?\n/exit\n"))
    code = main(["chat", "--model", str(chat_model), "--random-weights", "--device", "cpu", "--max-new-tokens", "2",
                 "--max-context", "200", "--load-kv", str(tmp_path / "kv"), *PLACE])
    err = capsys.readouterr().err
    assert code == 0 and re.search(r"^kvpipe: turn 3: ", err, re.M), err


def test_no_loading_bar_when_stderr_is_not_a_terminal(smollm2, monkeypatch, capfd):  # noqa: F811
    """Fault caught: transformers' "Loading weights" bar written into a piped chat's stderr (a log,
    a script's capture), where `generate` writes none: a bar is for a terminal."""
    monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
    code = main(["chat", "--model", str(smollm2[2]), "--device", "cpu", "--max-context", "256"])
    err = capfd.readouterr().err
    assert code == 0 and "Loading weights" not in err and "%|" not in err, err[:400]
