"""`kvpipe generate` stopped by Ctrl-C or SIGTERM during the answer, in a real subprocess on the
CPU: what was made is printed (finish_reason "interrupted") and the prompt's KV saved, and the
process still exits 130 / 143."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import kvpipe
from kvpipe.conversation import Conversation

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "5 6 7 8"
COMMON = dict(random_weights=True, device="cpu", chunk=4)   # one plan for the CLI and the references
LARGE = 3000    # far more tokens than the test waits for: only a signal ends the answer
WAIT_S = 60     # bound on each wait for the child (its start imports torch)


def _start(tiny_config, *flags, device: str = "cpu") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvpipe", "generate", "--model", tiny_config, "--random-weights", "--device", device,
           "--prompt-format", "ids", "--prompt", PROMPT, "--chunk", "4", "--ignore-eos", "--max-new-tokens", str(LARGE),
           *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _interrupt_when_prefilled(p: subprocess.Popen, sig) -> tuple[str, str]:
    """Waits (bounded) for --json's line that the prompt is prefilled, then signals the child."""
    seen, deadline = [], time.monotonic() + WAIT_S
    while not any("prompt prefilled" in line for line in seen):
        line = p.stderr.readline()
        assert line and time.monotonic() < deadline, "".join(seen) + p.stderr.read()
        seen.append(line)
    p.send_signal(sig)
    out, err = p.communicate(timeout=WAIT_S)
    return out, "".join(seen) + err


def _first_tokens(tiny_config, n: int, **over):
    """An uninterrupted run of n tokens, in process (greedy: its tokens start every longer run)."""
    return kvpipe.generate(tiny_config, PROMPT, prompt_format="ids", max_new_tokens=n, ignore_eos=True,
                           **{**COMMON, **over})


@pytest.mark.parametrize("sig, code, disk", [(signal.SIGINT, 130, None), (signal.SIGTERM, 143, None),
                                             (signal.SIGINT, 130, 3)])
def test_json_prints_what_was_made_when_interrupted(tiny_config, tmp_path, sig, code, disk):
    """Fault caught: Ctrl-C or SIGTERM during the answer of `generate --json` printing nothing
    (the tokens made lost to the KeyboardInterrupt), or the run not stopping between tokens
    (tokens or digest not those of an uninterrupted run's start), or the exit code not 130/143.
    `disk`: that many units on disk, whose lane hands tokens over on its worker thread unless the
    engine keeps them on the main one (then Ctrl-C was never taken over: the answer lost, no
    "prompt prefilled" line), or the KV file left in --kv-dir."""
    plan = {} if disk is None else dict(resident="none", group=1, disk=disk, kv_dir=str(tmp_path))
    p = _start(tiny_config, "--json", *(f"--{k.replace('_', '-')}={v}" for k, v in plan.items()))
    out, err = _interrupt_when_prefilled(p, sig)
    assert p.returncode == code, err
    res = json.loads(out)
    n = len(res["tokens"])
    assert res["finish_reason"] == "interrupted" and 0 < n < LARGE, err
    assert res["usage"]["completion_tokens"] == n and res["plan"]["disk"] == (disk or 0)
    ref = _first_tokens(tiny_config, n, **plan)
    assert res["tokens"] == ref.tokens and res["output_digest"] == ref.output_digest
    assert f"the answer was stopped after {n} tokens" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == [], "the run left its KV file"


def test_save_kv_keeps_the_prompt_when_interrupted(tiny_config, tmp_path):
    """Fault caught: Ctrl-C during the answer of `generate --save-kv` saving nothing although the
    prompt's KV was complete (or a save a later --load-kv refuses): the directory must load and
    continue as the uninterrupted run over the whole prompt does."""
    d = tmp_path / "kv"
    p = _start(tiny_config, "--json", "--save-kv", str(d))
    out, err = _interrupt_when_prefilled(p, signal.SIGINT)
    assert p.returncode == 130, err
    res = json.loads(out)
    assert res["finish_reason"] == "interrupted" and res["saved_kv"]["tokens"] == len(PROMPT.split()), err
    assert f"the prompt's KV is saved in {d}" in err, err
    prompt, more = [int(t) for t in PROMPT.split()], [9, 10]
    cont = kvpipe.generate(tiny_config, "9 10", prompt_format="ids", max_new_tokens=4, ignore_eos=True,
                           load_kv=str(d), **COMMON)
    with Conversation(tiny_config, max_context=len(prompt + more) + 4, max_new_tokens=4, **COMMON) as c:
        whole = c.append(prompt + more, breaks=(len(prompt),), max_new_tokens=4, ignore_eos=True)
    assert cont.tokens == whole.tokens and cont.output_digest == whole.output_digest


@pytest.mark.gpu
def test_json_prints_what_was_made_when_interrupted_on_cuda(tiny_config):
    """Fault caught: on CUDA with every unit streamed from pinned host RAM (copy streams in flight
    between tokens), Ctrl-C during the answer losing the tokens made, hanging on the streams, or
    stopping at a token whose bits differ from an uninterrupted run's (tokens and digest compared)."""
    p = _start(tiny_config, "--json", "--resident", "none", "--group", "1", device="cuda")
    out, err = _interrupt_when_prefilled(p, signal.SIGINT)
    assert p.returncode == 130, err
    res = json.loads(out)
    n = len(res["tokens"])
    assert res["finish_reason"] == "interrupted" and 0 < n < LARGE, err
    ref = _first_tokens(tiny_config, n, device="cuda", resident="none", group=1)
    assert res["tokens"] == ref.tokens and res["output_digest"] == ref.output_digest
