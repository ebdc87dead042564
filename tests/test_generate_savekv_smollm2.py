"""Save, load and continue with a real trained model on the CPU (SmolLM2-135M-Instruct, fp32, its
chat template): the continuation is the uninterrupted run, its text HF's own generate() over the
same conversation, and a chat's second turn prefills only its new tokens. Skipped without the GGUF."""
from __future__ import annotations

import pytest

import kvpipe
from kvpipe.conversation import Conversation

torch = pytest.importorskip("torch")
from test_generate_smollm2 import hf, smollm2  # noqa: E402,F401  (session fixtures)

pytestmark = pytest.mark.usefixtures("single_thread")
DOC = "Note: the team meeting moved to Tuesday at 3 pm, in room 12. Bring the budget report."
QUESTION = "When and where is the meeting?"
N = 16


def hf_greedy_ids(hf, ids: list[int], n: int) -> list[int]:
    """HF's own generate(): greedy over the prompt ids, stopping at generation_config's EOS."""
    model, _ = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("resident,disk", [("40", None), ("20", "10")])
def test_save_load_and_continue_is_the_uninterrupted_run(smollm2, hf, tmp_path, resident, disk):
    """Fault caught: the saved conversation and the new turn composed otherwise than the template
    renders the whole conversation, a unit of the saved KV lost or misplaced (GPU-resident and
    disk units included), or a continuation whose bits differ from the uninterrupted run's."""
    model, tok = hf
    opts = dict(device="cpu", resident=resident, group=1, **({"disk": disk} if disk else {}))
    kvpipe.generate(str(smollm2[2]), DOC, max_new_tokens=4, save_kv=tmp_path / "kv", **opts)
    got = kvpipe.generate(str(smollm2[2]), QUESTION, max_new_tokens=N, load_kv=tmp_path / "kv", **opts)
    msgs = [{"role": "user", "content": DOC}, {"role": "user", "content": QUESTION}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    saved = len(tok.apply_chat_template(msgs[:1], tokenize=True, return_dict=False))
    assert got.timings["reused_tokens"] == saved and got.timings["prefill_tokens"] == len(full) - saved
    with Conversation(str(smollm2[2]), max_context=len(full) + N, max_new_tokens=N, **opts) as c:
        ref = c.append(list(full), breaks=(saved,), max_new_tokens=N)
    assert got.tokens == ref.tokens and got.output_digest == ref.output_digest
    assert got.tokens == hf_greedy_ids(hf, list(full), N)
    assert got.text == tok.decode(got.tokens, skip_special_tokens=True)


def test_chat_turn_two_prefills_only_its_new_tokens_and_is_hfs_text(smollm2, hf, monkeypatch, capsys):
    """Fault caught: the second turn prefilling the whole conversation, the reply's tokens not
    kept (only the prompt's), or a second answer other than HF's over the whole conversation."""
    import io
    import json
    from kvpipe.cli import main
    model, tok = hf
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    code = main(["chat", "--model", str(smollm2[2]), "--device", "cpu", "--json", "--max-context", "256",
                 "--max-new-tokens", str(N), "--resident", "40", "--group", "3"])
    one, two = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": one["text"]}, {"role": "user", "content": "And of Italy?"}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert code == 0 and "Paris" in one["text"]
    assert two["timings"]["reused_tokens"] == one["usage"]["prompt_tokens"] + len(one["tokens"]) - 1
    assert two["timings"]["prefill_tokens"] == len(full) - two["timings"]["reused_tokens"]
    assert two["tokens"] == hf_greedy_ids(hf, list(full), N)


def test_a_chat_save_continued_without_the_template_is_refused(smollm2, tmp_path):
    """Fault caught: a templated save (it ends after a closed user turn) continued with --no-chat,
    the raw text appended and the model answering nothing (an empty completion, exit 0)."""
    kvpipe.generate(str(smollm2[2]), DOC, max_new_tokens=1, save_kv=tmp_path / "kv", device="cpu")
    with pytest.raises(ValueError, match="^no-chat: the saved KV is a chat"):
        kvpipe.generate(str(smollm2[2]), QUESTION, max_new_tokens=4, load_kv=tmp_path / "kv", chat=False,
                        device="cpu")
