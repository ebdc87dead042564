"""Prefilled KV kept for the next question (`generate --save-kv/--load-kv`, kvpipe/conversation.py,
executor/engine/live.py, executor/kv/saved.py) with tiny random models on the CPU (prompts as ids)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import kvpipe
from kvpipe.cli import main
from kvpipe.conversation import Conversation

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("single_thread")

P = [(7 * i + 3) % 256 for i in range(40)]       # the document: not a multiple of the chunk
Q = [(5 * i + 1) % 256 for i in range(13)]       # the next question
COMMON = dict(random_weights=True, device="cpu", prompt_format="ids", chunk=16, seed=5)
# (resident units, group, disk units) over 2 layers x 3 KV heads: none, all, a mix, disk, group 1 and 3
PLACEMENTS = [("none", 1, None), ("all", 1, None), ("2", 1, None), ("none", 1, "2"), ("none", 3, None),
              ("3", 3, "3"), ("all", 3, None)]


def ids(t: list[int]) -> str:
    return " ".join(map(str, t))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with 3 KV heads (group 3 runs) as a config.json folder."""
    from conftest import TINY_LLAMA
    d = tmp_path_factory.mktemp("kv3")
    (d / "config.json").write_text(json.dumps(dict(TINY_LLAMA, num_key_value_heads=3, num_attention_heads=6, hidden_size=96)))
    return d


def place(resident, group, disk) -> dict:
    return dict(COMMON, resident=resident, group=group, **({"disk": disk} if disk else {}))


def reference(model_dir, prompt, breaks, n, **opts):
    """One uninterrupted run over `prompt` whose prefill chunks also break at `breaks`."""
    kw = {k: v for k, v in opts.items() if k != "prompt_format"}
    with Conversation(str(model_dir), max_context=len(prompt) + n, max_new_tokens=n, **kw) as c:
        return c.append(prompt, breaks=breaks, max_new_tokens=n)


@pytest.mark.parametrize("resident,group,disk", PLACEMENTS)
def test_continuation_is_the_uninterrupted_run_bit_for_bit(model_dir, tmp_path, resident, group, disk):
    """Fault caught: a unit of some tier (GPU-resident, host, disk) not written or not loaded, a
    loaded unit at the wrong place, the new tokens prefilled from 0 (not only the new ones), or the
    continuation's chunks differing from the uninterrupted run's with the same break."""
    opts = place(resident, group, disk)
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=5, save_kv=tmp_path / "kv", **opts)
    got = kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=6, load_kv=tmp_path / "kv", **opts)
    ref = reference(model_dir, P + Q, (len(P),), 6, **opts)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest
    assert got.timings["prefill_tokens"] == len(Q) and got.timings["reused_tokens"] == len(P)
    first = reference(model_dir, P + Q, (len(P),), 6, **place("all", 1, None))
    assert got.output_digest == first.output_digest   # the placement never changes a bit


def test_at_a_chunk_multiple_the_continuation_is_the_plain_run(model_dir, tmp_path):
    """Fault caught: the kept-session path computing other bits than `kvpipe generate`'s own run
    (the definition of exactness resting only on the session's reference)."""
    opts = place("2", 1, "2")
    doc = P[:32]
    kvpipe.generate(str(model_dir), ids(doc), max_new_tokens=4, save_kv=tmp_path / "kv", **opts)
    got = kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=6, load_kv=tmp_path / "kv", **opts)
    plain = kvpipe.generate(str(model_dir), ids(doc + Q), max_new_tokens=6, **opts)
    assert got.tokens == plain.tokens and got.output_digest == plain.output_digest


def test_manifest_names_model_dtype_tokens_plan_and_checksums(model_dir, tmp_path):
    """Fault caught: a manifest missing the fingerprint, dtype, tokens, plan or block checksums,
    or GPU-resident units left out of the file."""
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", **place("all", 1, None))
    man = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    assert set(man["model"]) >= {"config_sha256", "weights_sha256"} and man["dtype"] == "fp32"
    assert man["tokens"] == P and man["plan"]["resident"] == 6 and len(man["units"]) == 6
    assert all(u["crc32c"] for u in man["units"])
    assert os.path.getsize(tmp_path / "kv" / man["data"]) >= 6 * man["unit_bytes"]


@pytest.mark.parametrize("change,words", [
    (dict(seed=6), "other weights"),
    (dict(dtype="bf16"), "saved in fp32"),
    (dict(max_context=len(P)), "no room"),
])
def test_loading_into_another_model_dtype_or_a_short_context_is_refused(model_dir, tmp_path, change, words):
    """Fault caught: a KV loaded into other weights, another dtype or a capacity that cannot hold
    it (silently wrong text, or a shape error deep in the run)."""
    opts = place("2", 1, None)
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", **opts)
    with pytest.raises(ValueError, match=f"load-kv: .*{words}"):
        kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=3, load_kv=tmp_path / "kv", **dict(opts, **change))


def test_another_config_is_refused_on_one_line_by_the_cli(model_dir, tmp_path, capsys):
    """Fault caught: another model's KV loaded (or a traceback, or an exit code other than 2), or
    "executing up to N new tokens" printed before the refusal, as if the run had started."""
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", **place("2", 1, None))
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    code = main(["generate", "--model", str(other), "--random-weights", "--device", "cpu", "--prompt-format", "ids",
                 "--prompt", ids(Q), "--load-kv", str(tmp_path / "kv"), "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("kvpipe: error: --load-kv: saved with another model")
    assert not any("executing" in line for line in err), err


def test_a_corrupt_block_names_the_file_and_offset(model_dir, tmp_path):
    """Fault caught: a flipped byte loaded silently (no checksum verified), or an error that
    names neither the file nor where."""
    opts = place("none", 1, "2")
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", **opts)
    man = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    data, at = tmp_path / "kv" / man["data"], man["units"][4]["offset"]
    raw = bytearray(data.read_bytes())
    raw[at + 100] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"checksum mismatch in {data} at offset {at} "):
        kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=3, load_kv=tmp_path / "kv", **opts)


def test_a_crash_while_saving_leaves_the_previous_save_whole(model_dir, tmp_path, monkeypatch):
    """Fault caught: a save that overwrites the data file the manifest names before the new
    manifest is in place (a crash leaves a manifest over other bytes), or a half-written manifest."""
    from kvpipe.executor.kv import saved
    opts = place("2", 1, None)
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", **opts)
    before = (tmp_path / "kv" / "manifest.json").read_text()
    real = saved._write_atomic

    def crash(path, write):
        if path.name == saved.MANIFEST:
            raise KeyboardInterrupt("killed while writing the manifest")
        real(path, write)
    monkeypatch.setattr(saved, "_write_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        kvpipe.generate(str(model_dir), ids(P[:20]), max_new_tokens=3, save_kv=tmp_path / "kv", **opts)
    monkeypatch.undo()
    assert (tmp_path / "kv" / "manifest.json").read_text() == before
    got = kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=4, load_kv=tmp_path / "kv", **opts)
    assert got.output_digest == reference(model_dir, P + Q, (len(P),), 4, **opts).output_digest


def test_tokens_that_do_not_extend_the_saved_ones_are_refused(model_dir, tmp_path):
    """Fault caught: a continuation over tokens that do not start with the saved ones (the KV of
    another text attended to as if it were this one's)."""
    opts = {k: v for k, v in place("2", 1, None).items() if k != "prompt_format"}
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", prompt_format="ids", **opts)
    with Conversation(str(model_dir), max_context=80, max_new_tokens=3, **opts) as c:
        c.load(tmp_path / "kv")
        with pytest.raises(ValueError, match="not a prefix .* differ at token 3"):
            c.append(P[:3] + [9] + P[4:] + Q, max_new_tokens=3)


def test_a_missing_directory_is_one_line_naming_the_flag(model_dir, tmp_path, capsys):
    """Fault caught: a traceback or an unnamed flag for a --load-kv that is not a KV directory, or
    a folder that does not exist reported as one without a manifest."""
    code = main(["generate", "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format",
                 "ids", "--prompt", ids(Q), "--load-kv", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "load-kv:" in err[0] and "manifest.json" in err[0]
    code = main(["generate", "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format",
                 "ids", "--prompt", ids(Q), "--load-kv", str(tmp_path / "nope")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"kvpipe: error: --load-kv: {str(tmp_path / 'nope')!r} does not exist "
                                 "(give a folder --save-kv wrote)"]
    shutil.rmtree(tmp_path, ignore_errors=True)



def _cli(model_dir, capsys, *flags) -> tuple[int, str, list[str]]:
    code = main(["generate", "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format", "ids",
                 "--max-new-tokens", "2", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_a_second_save_says_what_it_replaced(model_dir, tmp_path, capsys):
    """Fault caught: --save-kv over an existing KV directory replacing the save there without a
    word (the line and --json's saved_kv say nothing of the earlier save's tokens)."""
    kv = str(tmp_path / "kv")
    code, _, err = _cli(model_dir, capsys, "--prompt", ids(P), "--save-kv", kv)
    assert code == 0 and err[-1] == f"kvpipe: saved {len(P)} tokens' KV to {kv} (continue with --load-kv {kv})"
    code, _, err = _cli(model_dir, capsys, "--prompt", ids(Q), "--save-kv", kv)
    assert code == 0 and err[-1].startswith(f"kvpipe: saved {len(Q)} tokens' KV to {kv}, replacing its save of {len(P)} tokens")
    code, out, _ = _cli(model_dir, capsys, "--prompt", ids(P), "--save-kv", kv, "--json")
    assert json.loads(out)["saved_kv"] == {"directory": kv, "tokens": len(P), "replaced_tokens": len(Q)}


@pytest.mark.parametrize("at", ["data", "manifest"])
@pytest.mark.parametrize("fresh", [True, False], ids=["new folder", "over a save"])
def test_a_save_that_fails_midway_leaves_no_partial_file(model_dir, tmp_path, monkeypatch, fresh, at):
    """Fault caught: a save that fails while writing (disk full: an OSError after some units of
    the data file, or at its manifest) leaving its temporary data file, its renamed data file
    (no manifest names it), or the folder it made for itself; or its error a raw errno not
    naming the flag."""
    from kvpipe.executor.kv import saved
    kv, opts = tmp_path / "kv", place("2", 1, None)
    if not fresh:
        kvpipe.generate(str(model_dir), ids(P), max_new_tokens=2, save_kv=kv, **opts)
    before = sorted(p.name for p in kv.iterdir()) if not fresh else None
    real_get, real_write, calls = saved._get, saved._write_atomic, []

    def get(*a):
        calls.append(1)
        if at == "data" and len(calls) > 2:
            raise OSError(28, "No space left on device")
        real_get(*a)

    def write(path, fn):
        if at == "manifest" and path.name == saved.MANIFEST:
            raise OSError(28, "No space left on device")
        real_write(path, fn)
    monkeypatch.setattr(saved, "_get", get)
    monkeypatch.setattr(saved, "_write_atomic", write)
    with pytest.raises(ValueError, match=r"^save-kv: cannot write in .* \(No space left on device\)$"):
        kvpipe.generate(str(model_dir), ids(P[:20]), max_new_tokens=2, save_kv=kv, **opts)
    monkeypatch.undo()
    if fresh:
        assert not kv.exists(), sorted(p.name for p in kv.iterdir())
    else:
        assert sorted(p.name for p in kv.iterdir()) == before


def test_a_file_or_a_folder_of_other_files_is_refused_before_the_run(model_dir, tmp_path, capsys):
    """Fault caught: --save-kv to a file failing only after the whole generation ("[Errno 17] File
    exists"), or a save into a folder of the user's files deleting its kv-*.bin files."""
    (tmp_path / "afile").write_text("x")
    code, out, err = _cli(model_dir, capsys, "--prompt", ids(P), "--save-kv", str(tmp_path / "afile"))
    assert code == 2 and out == "" and err == [f"kvpipe: error: --save-kv: {str(tmp_path / 'afile')!r} is a file; "
                                               "give a folder (new, empty, or a saved KV directory)"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (mine / "kv-keep.bin").write_text("keep")
    code, out, err = _cli(model_dir, capsys, "--prompt", ids(P), "--save-kv", str(mine))
    assert code == 2 and out == "" and len(err) == 1 and err[0].startswith("kvpipe: error: --save-kv: ")
    assert sorted(p.name for p in mine.iterdir()) == ["kv-keep.bin", "notes.txt"]


def test_a_folder_that_cannot_be_made_is_refused_before_the_run(model_dir, capsys):
    """Fault caught: --save-kv under a folder that takes no new folder (/proc, where access() says
    yes to root) found only after the whole generation, as a raw errno not naming the flag."""
    code, out, err = _cli(model_dir, capsys, "--prompt", ids(P), "--save-kv", "/proc/kvpipe-nope/kv")
    assert code == 2 and out == "" and len(err) == 1
    assert err[0].startswith("kvpipe: error: --save-kv: cannot make a folder in '/proc' (")


@pytest.mark.parametrize("flags, words", [
    ((), f"4 tokens cannot hold the prompt's {len(P)} tokens"),
    (("--save-kv", "KV"), f"4 tokens cannot hold the prompt's {len(P)} tokens"),
])
def test_max_context_is_refused_where_it_cannot_apply(model_dir, tmp_path, capsys, flags, words):
    """Fault caught: a --max-context smaller than the prompt ignored by a plain generate, or
    failing after the model loaded with chat's "/reset" advice."""
    flags = tuple(str(tmp_path / f) if f == "KV" else f for f in flags)
    code, out, err = _cli(model_dir, capsys, "--prompt", ids(P), "--max-context", "4", *flags)
    assert code == 2 and out == "" and len(err) == 1 and err[0].startswith(f"kvpipe: error: --max-context: {words}"), err


@pytest.mark.gpu
@pytest.mark.parametrize("resident,group,disk", [("none", 1, None), ("all", 3, None), ("2", 1, "2"), ("3", 3, None)])
def test_continuation_is_the_uninterrupted_run_on_the_gpu(model_dir, tmp_path, resident, group, disk):
    """Fault caught: on CUDA (bf16, replayed decode where the plan replays), a unit saved or
    loaded with a copy still in flight, or a continuation whose bits differ from the uninterrupted
    run broken at the same token, under any placement."""
    opts = dict(place(resident, group, disk), device="cuda", dtype="bf16")
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=5, save_kv=tmp_path / "kv", **opts)
    got = kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=6, load_kv=tmp_path / "kv", **opts)
    ref = reference(model_dir, P + Q, (len(P),), 6, **opts)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest
    # the same schedule with every head resident: disk units decode eagerly, so the reference does too
    same = {"replay": "off"} if disk else {}
    first = reference(model_dir, P + Q, (len(P),), 6, **dict(place("all", 1, None), device="cuda", dtype="bf16", **same))
    assert got.output_digest == first.output_digest


def test_new_tokens_cut_by_max_context_say_so(model_dir, tmp_path, capsys):
    """Fault caught: --max-new-tokens cut to what --max-context leaves after the prompt with
    finish_reason "length" and no word (warnings empty), so the user cannot tell why the answer
    is short."""
    code = main(["generate", "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format",
                 "ids", "--prompt", ids(P), "--save-kv", str(tmp_path / "kv"), "--max-context", str(len(P) + 3),
                 "--max-new-tokens", "10", "--ignore-eos", "--json"])
    out = capsys.readouterr()
    res = json.loads(out.out)
    note = (f"max-new-tokens: 10 new tokens do not fit: the conversation holds {len(P)} of its {len(P) + 3} "
            "tokens (--max-context), so at most 3 are generated")
    assert code == 0 and res["usage"]["completion_tokens"] == 3 and res["finish_reason"] == "length"
    assert res["warnings"] == [note] and note in out.err


@pytest.mark.parametrize("cmd, flags, flag", [
    (["generate", "--prompt-format", "ids", "--prompt", ids(P), "--save-kv", "KV"], ["--lossy", "int8"], "lossy"),
    (["generate", "--prompt-format", "ids", "--prompt", ids(P), "--save-kv", "KV"], ["--sparse", "0.2"], "sparse"),
    (["chat"], ["--lossy", "int4"], "lossy"),
    (["chat"], ["--codec", "h2d=zstd-planes"], "codec"),
])
def test_lossy_or_codec_flags_on_a_kept_conversation_name_the_flag_before_loading(model_dir, tmp_path, capsys,
                                                                                   monkeypatch, cmd, flags, flag):
    """Fault caught: chat or --save-kv with --lossy/--sparse/--codec refused only after the weights
    loaded, as an error naming --plan instead of the flag given."""
    import kvpipe.generation as generation
    monkeypatch.setattr(generation, "load", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    cmd = [str(tmp_path / "kv") if c == "KV" else c for c in cmd]
    code = main([cmd[0], "--model", str(model_dir), "--random-weights", "--device", "cpu", *cmd[1:], *flags])
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert code == 2 and out.out == "" and len(err) == 1 and err[0].startswith(f"kvpipe: error: --{flag}: "), err


def test_max_context_caps_a_plain_generate_and_says_so(model_dir, capsys):
    """Fault caught: a plain generate refusing --max-context (vLLM's and llama.cpp's users cap the
    context with it), or capping the answer silently or to another length than the prompt leaves;
    the capped tokens are the uncapped run's first ones (greedy)."""
    base = ["generate", "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format", "ids",
            "--prompt", ids(P), "--max-new-tokens", "8", "--ignore-eos", "--json"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(base + ["--max-context", str(len(P) + 3)]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    note = (f"max-new-tokens: 8 new tokens do not fit --max-context {len(P) + 3} after the prompt's {len(P)} "
            "tokens, so at most 3 are generated")
    assert got["tokens"] == full["tokens"][:3] and got["finish_reason"] == "length"
    assert got["warnings"] == [note] and note in out.err


def test_other_weights_are_refused_before_any_unit_is_read(model_dir, tmp_path, monkeypatch):
    """Fault caught: the readers started before the model's fingerprint is checked (a directory of
    another model read whole, 17 GB at 128K, before its refusal; the hash beside 16 readers waited
    on them for the GIL)."""
    from kvpipe.executor.engine.live import LiveSession
    opts = place("2", 1, None)
    kvpipe.generate(str(model_dir), ids(P), max_new_tokens=3, save_kv=tmp_path / "kv", **opts)
    started = []
    real = LiveSession.load
    monkeypatch.setattr(LiveSession, "load", lambda self, *a, **k: started.append(1) or real(self, *a, **k))
    with pytest.raises(ValueError, match="load-kv: .*other weights"):
        kvpipe.generate(str(model_dir), ids(Q), max_new_tokens=3, load_kv=tmp_path / "kv", **dict(opts, seed=6))
    assert not started
