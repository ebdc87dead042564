"""`kvpipe generate` on the engine with a tiny random model from a config.json (prompts as token
ids: it has no tokenizer), and its command line's bad-input lines."""
from __future__ import annotations

import json
import shutil

import pytest

import kvpipe

pytest.importorskip("torch")

PROMPT = " ".join(str((7 * i + 3) % 256) for i in range(40))
COMMON = dict(random_weights=True, device="cpu", prompt_format="ids", chunk=16, seed=5)


@pytest.fixture(scope="module")
def model_dir(tiny_config, tmp_path_factory):
    """A folder holding only the tiny config.json (generation_config.json added by tests)."""
    d = tmp_path_factory.mktemp("gen")
    shutil.copy(tiny_config, d / "config.json")
    return d


def gen(model_dir, **kw):
    return kvpipe.generate(str(model_dir), PROMPT, **dict(COMMON, **kw))


def test_greedy_generate_is_kvpipe_runs_greedy_decoding(model_dir):
    # Fault caught: the token seam changing the greedy choice, or --max-new-tokens N running
    # N + 1 tokens (kvpipe run's decode steps plus the prefill's token).
    g = gen(model_dir, max_new_tokens=6, resident="none", group=1)
    r = kvpipe.run(str(model_dir), prompt_ids=[int(t) for t in PROMPT.split()], decode_tokens=5, progress=False,
                   random_weights=True, device="cpu", chunk=16, seed=5, resident="none", group=1)
    assert g.tokens == r.tokens[0] and len(g.tokens) == 6
    assert g.finish_reason == "length" and g.text is None
    js = g.to_json()
    assert js["usage"] == {"prompt_tokens": 40, "completion_tokens": 6}
    assert set(js) >= {"text", "tokens", "finish_reason", "usage", "timings", "plan", "output_digest"}
    assert json.loads(json.dumps(js)) == js


def test_stops_at_the_generation_configs_eos_and_skips_the_rest(model_dir):
    # Fault caught: EOS ignored (generation running into junk past it), the EOS token dropped from
    # tokens, or the steps past it still run in full (their heads executed).
    full = gen(model_dir, max_new_tokens=10, resident="all", group=1, ignore_eos=True)
    k = 3
    eos = full.tokens[k]
    first = full.tokens.index(eos)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, eos]}))
    try:
        g = gen(model_dir, max_new_tokens=10, resident="all", group=1)
        ignored = gen(model_dir, max_new_tokens=10, resident="all", group=1, ignore_eos=True)
    finally:
        (model_dir / "generation_config.json").unlink()
    assert g.tokens == full.tokens[:first + 1] and g.finish_reason == "stop"
    assert ignored.tokens == full.tokens and ignored.output_digest == full.output_digest


def test_the_gate_issues_no_stage_of_a_step_past_the_end():
    # Fault caught: decode steps after the end still issued (wasted work; on a GPU, seconds),
    # or a step before the end skipped (a token missing its KV write-back).
    from types import SimpleNamespace as NS

    import torch

    from kvpipe.executor.engine.decoding import Decoding
    from kvpipe.pipeline.sampling import Sampling
    from kvpipe.pipeline.stage import Phase
    dec = Decoding(Sampling(), [1, 2], vocab=8, n_tokens=6, device="cpu", take=lambda i, t: i == 2)
    issued = []
    gate = dec.gate(issued.append)
    tokens = torch.zeros(1, 6, dtype=torch.long)
    stages = [NS(phase=Phase.PREFILL, step=0, tag=t) for t in ("embed", "head")]
    for k in range(5):
        stages += [NS(phase=Phase.DECODE, step=k, tag=t) for t in ("kv_fetch", "embed", "attn", "head", "kv_store")]
    for s in stages:
        gate(s)
        if s.tag == "head":   # the head writes token 0 (prefill) or k + 1 (decode step k)
            i = 0 if s.phase is Phase.PREFILL else s.step + 1
            dec.produced(tokens, i)
    assert {s.step for s in issued if s.phase is Phase.DECODE} == {0, 1}   # token 2 ends it: step 2 not needed
    assert dec.finish() == 3


def test_tokens_are_handed_over_on_the_runs_thread_only():
    """Fault caught: a disk lane's stage (gated on its worker thread) handing a token over there,
    so `take` ran off the run's thread: `generate`'s Ctrl-C keeper (signal handlers can only be
    set on the main thread) did not take over, and Ctrl-C lost the answer."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace as NS

    import torch

    from kvpipe.executor.engine.decoding import Decoding
    from kvpipe.pipeline.sampling import Sampling
    from kvpipe.pipeline.stage import Phase
    threads = []
    dec = Decoding(Sampling(), [1, 2], vocab=8, n_tokens=4, device="cpu",
                   take=lambda i, t: threads.append(threading.get_ident()) and False)
    gate = dec.gate(lambda s: None)
    dec.produced(torch.zeros(1, 4, dtype=torch.long), 0)   # the prefill's token reached the host
    with ThreadPoolExecutor(1) as worker:                   # the disk lane's read for step 0
        worker.submit(gate, NS(phase=Phase.DECODE, step=0, tag="kv_read")).result()
    gate(NS(phase=Phase.DECODE, step=0, tag="embed"))
    assert threads == [threading.get_ident()]


def test_seeded_sampling_repeats_whatever_the_placement(model_dir):
    # Fault caught: sampling noise drawn from a stream whose state depends on the run (a global
    # RNG, host timing), or any placement changing a bit of the sampled output.
    kw = dict(max_new_tokens=8, temperature=1.2, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
              seed=11, group=1)
    runs = [gen(model_dir, resident=r, **kw) for r in ("all", "none", "2")]
    runs.append(gen(model_dir, resident="none", disk=2, **kw))
    assert runs[-1].run.plan.disk == 2
    assert len({r.output_digest for r in runs}) == 1 and len({tuple(r.tokens) for r in runs}) == 1
    other = gen(model_dir, resident="all", **dict(kw, seed=12))
    greedy = gen(model_dir, resident="all", **dict(kw, temperature=0))
    assert other.tokens != runs[0].tokens and greedy.tokens != runs[0].tokens


def cli(capsys, *argv):
    from kvpipe.cli import main
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, flag", [
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--top-p", "2"], "top-p"),
    (["--temperature", "-1"], "temperature"),
    (["--prompt-format", "ids", "--prompt", "1 2 x"], "prompt"),
    (["--prompt-format", "ids", "--prompt", "1 99999"], "prompt"),
    (["--prompt-format", "text", "--prompt", "hello"], "prompt-format"),
    (["--system", "be brief"], "system"),
    (["--prompt-file", "/nonexistent/q.txt", "--prompt", None], "prompt-file"),
    (["--stop", ""], "stop"),
    (["--prompt-format", "words"], "prompt-format"),
    (["--model", "/nonexistent/m.gguf"], "model"),
    (["--resident", "lots"], "resident"),
    (["--model", None], "model"),
])
def test_bad_input_is_one_line_naming_the_flag(model_dir, capsys, argv, flag):
    # Fault caught: a traceback, exit 1, or an error line that does not name the flag.
    base = {"--model": str(model_dir), "--prompt": "1 2 3", "--prompt-format": "ids"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    args = [x for k, v in base.items() if v is not None for x in (k, v)] + ["--random-weights", "--device", "cpu"]
    rc, out, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "error:" in lines[0] and (f"error: {flag}:" in lines[0] or f"--{flag}" in lines[0]), lines[0]


def test_every_generate_flag_reaches_the_api():
    # Fault caught: a flag parsed but dropped on its way to kvpipe.generate (it passes by name).
    import inspect

    from kvpipe import generate_cli
    from kvpipe.cli import build_parser
    from kvpipe.generation import RUN_OPTIONS
    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    dests = {a.dest for a in sub._actions} - {"help", "json"}
    assert dests <= set(generate_cli.OWN) | set(RUN_OPTIONS), dests - set(generate_cli.OWN) - set(RUN_OPTIONS)
    assert set(generate_cli.OWN) <= set(inspect.signature(kvpipe.generate).parameters)


def test_api_refuses_what_generate_does_not_take(model_dir):
    # Fault caught: a misspelt or workload keyword (decode_tokens) silently dropped or passed on.
    with pytest.raises(ValueError, match="^decode-tokens: not an option of generate"):
        gen(model_dir, decode_tokens=4)
    with pytest.raises(ValueError, match="^max-new-tokens: "):
        gen(model_dir, max_new_tokens="8")


def test_cli_streams_ids_and_prints_the_summary(model_dir, capsys):
    # Fault caught: nothing on stdout without a tokenizer, or the timings / placement / plan
    # lines missing from stderr (or mixed into stdout).
    rc, out, err = cli(capsys, "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format",
                       "ids", "--prompt", PROMPT, "--max-new-tokens", "3", "--resident", "none", "--group", "1")
    assert rc == 0, err
    assert len(out.split()) == 3 and all(w.isdigit() for w in out.split())
    for needle in ("TTFT", "decode", "KV (layer, head) units: 0 on cpu, 4 in host RAM, 0 on disk", "plan: headwise"):
        assert needle in err, (needle, err)


def test_save_and_load_kv_print_the_executing_line_first(model_dir, tmp_path, capsys):
    """Fault caught: `generate --save-kv/--load-kv` (kvpipe/kept.py) printed no "executing up to N
    new tokens" line, so nothing showed before the prefill ended; or the library call printed it."""
    line = "kvpipe: executing up to 3 new tokens on cpu (Ctrl-C stops cleanly)"
    for flag, prompt in (("--save-kv", PROMPT), ("--load-kv", "9 10")):
        rc, _, err = cli(capsys, "--model", str(model_dir), "--random-weights", "--device", "cpu", "--prompt-format",
                         "ids", "--prompt", prompt, "--max-new-tokens", "3", flag, str(tmp_path / "kv"))
        assert rc == 0 and err.splitlines().count(line) == 1 and err.startswith(line), (flag, err)
    gen(model_dir, max_new_tokens=3, load_kv=str(tmp_path / "kv"), seed=0)   # the CLI's weights
    assert capsys.readouterr().err == ""


GPU = dict(random_weights=True, device="cuda", dtype="bf16", prompt_format="ids", chunk=16, seed=5, group=1)


@pytest.mark.gpu
def test_replayed_sampling_repeats_across_placements(model_dir):
    # Fault caught: the sampler not capturable (a host sync or host-side RNG state inside the CUDA
    # graph: every replay the same draw), or a placement changing a bit of the replayed output.
    kw = dict(GPU, max_new_tokens=24, temperature=1.0, top_p=0.9, top_k=40, repetition_penalty=1.2, seed=3)
    runs = [kvpipe.generate(str(model_dir), PROMPT, resident=r, replay="on", **kw) for r in ("all", "none", "2")]
    assert all(r.decode_replayed for r in runs)
    assert len({r.output_digest for r in runs}) == 1 and len(set(runs[0].tokens)) > 4


@pytest.mark.gpu
def test_replayed_greedy_is_runs_and_stops_at_eos(model_dir):
    # Fault caught: the replayed step's token choice differing from kvpipe run's greedy argmax,
    # or replay running on (or stopping short) past an EOS the host learns a few steps late.
    kw = dict(GPU, resident="none", replay="on")
    full = kvpipe.generate(str(model_dir), PROMPT, max_new_tokens=20, ignore_eos=True, **kw)
    r = kvpipe.run(str(model_dir), prompt_ids=[int(t) for t in PROMPT.split()], decode_tokens=19, progress=False,
                   **{k: v for k, v in kw.items() if k != "prompt_format"})
    assert full.decode_replayed and full.tokens == r.tokens[0]
    eos = full.tokens[6]
    first = full.tokens.index(eos)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    try:
        g = kvpipe.generate(str(model_dir), PROMPT, max_new_tokens=20, **kw)
    finally:
        (model_dir / "generation_config.json").unlink()
    assert g.tokens == full.tokens[:first + 1] and g.finish_reason == "stop" and g.decode_replayed
