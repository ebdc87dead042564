"""`kvpipe run` on the CPU with a tiny random model from a config.json: in this process through
`kvpipe.cli.main` (cheap), and through a subprocess where signals matter."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TINY_LLAMA as TINY


def run_json(capsys, *args: str) -> dict:
    """`kvpipe run --device cpu --no-progress --json ...` in this process (no torch import per run)."""
    from kvpipe.cli import main
    rc = main(["run", "--device", "cpu", "--no-progress", "--json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_offloaded_and_resident_runs_have_the_same_digest(tiny_config, tmp_path, capsys):
    common = ("--model", tiny_config, "--random-weights", "--context", "200", "--decode-tokens", "8",
              "--chunk", "48", "--seed", "3")
    offloaded = run_json(capsys, *common, "--resident", "none", "--group", "1", "--trace", str(tmp_path / "t.json"))
    resident = run_json(capsys, *common, "--resident", "all", "--group", "1")
    mixed = run_json(capsys, *common, "--resident", "3", "--group", "2")
    assert offloaded["output_digest"] == resident["output_digest"]
    assert offloaded["attention"] == "cpu flash"
    assert offloaded["tokens"] == resident["tokens"] and len(offloaded["tokens"][0]) == 9
    assert mixed["tokens"] == resident["tokens"]     # another grouping: same tokens (bits may differ)
    m = offloaded["measured"]
    for key in ("prefill_s", "ttft_s", "decode_s_per_token", "total_s", "peak_bytes", "critical_lane"):
        assert key in m
    assert offloaded["predicted"] is None and offloaded["hardware"] is None   # no profile models a CPU
    import kvpipe   # the host tier's bytes are modelled exactly, on any device: the API keeps the prediction
    res = kvpipe.run(model=tiny_config, random_weights=True, context=200, decode_tokens=8, chunk=48, seed=3,
                     resident="none", group=1, device="cpu", progress=False)
    assert res.measured.peak_bytes["host"] == res.predicted.report.peak_bytes["host"] == m["peak_bytes"]["host"] > 0
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    procs = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"kvpipe sim", "kvpipe real"}


def test_prompt_file_of_token_ids(tiny_config, tmp_path, capsys):
    ids = tmp_path / "prompt.txt"
    ids.write_text(" ".join(str(i % 256) for i in range(64)))
    rc, out, err = cli(capsys, "--model", tiny_config, "--random-weights", "--context", "64", "--decode-tokens", "2",
                       "--prompt-file", str(ids), "--json")
    assert rc == 0, err
    assert len(json.loads(out)["tokens"][0]) == 3


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`kvpipe run --device cpu --no-progress ...` in this process (cheap: no torch import per call)."""
    from kvpipe.cli import main
    rc = main(["run", "--device", "cpu", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_in_process_exit_2(rc: int, err: str, needle: str) -> None:
    assert rc == 2, (rc, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, needle", [
    (["--context", "64", "--gpu-mem", "100KB"], "--gpu-mem: "),
    (["--context", "4000", "--gpu-mem", "1MB", "--resident", "all"], "gpu needs"),
])
def test_a_run_nothing_fits_is_one_line_exit_3(tiny_config, capsys, args, needle):
    """Fault caught: weights over --gpu-mem, or a plan over it, exiting 2 (bad input) where the
    rule says 3 (valid input, nothing fits the budgets), or more than one line."""
    rc, _, err = cli(capsys, "--model", tiny_config, "--random-weights", *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 3 and len(lines) == 1 and needle in lines[0], (rc, err[-2000:])


@pytest.mark.parametrize("args, needle", [
    (["--model", "llama-3-8b", "--context", "64"], "--random-weights"),
    (["--model", "/no/such/dir", "--random-weights"], "/no/such/dir"),
    (["--model", "{gpt2}", "--random-weights", "--context", "64"], "supported"),
    (["--model", "{tiny}", "--random-weights", "--context", "64", "--prompt-file", "/no/file"], "prompt-file"),
    # issue 7: budgets are validated as in `plan`
    (["--model", "{tiny}", "--random-weights", "--context", "64", "--host-mem", "0"], "host-mem: must be a positive size"),
    (["--model", "{tiny}", "--random-weights", "--context", "64", "--disk-mem=-1GB"], "disk-mem: must be a positive size"),
    (["--model", "{tiny}", "--random-weights", "--context", "64", "--gpu-mem=-1GB"], "gpu-mem: must be a positive size"),
    # issue 7: the mixes `plan` refuses are refused by `run` too
    (["--model", "{tiny}", "--random-weights", "--context", "64", "--method", "standard", "--resident", "3"],
     "resident: method standard"),
    (["--model", "{tiny}", "--random-weights", "--context", "64", "--plan", "{plan}", "--chunk", "16"], "drop --chunk"),
])
def test_bad_run_input_is_one_line_exit_2(tiny_config, tmp_path, capsys, args, needle):
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema": 2, "method": "headwise", "prefill": {"group": 1, "chunk": 32},
                                "decode": {"group": 1, "chunk": 1}, "resident": 0}))
    args = [a.replace("{tiny}", tiny_config).replace("{gpt2}", str(gpt2)).replace("{plan}", str(plan)) for a in args]
    assert_in_process_exit_2(*cli(capsys, *args)[::2], needle)


@pytest.mark.parametrize("device", ["xyz", "cuda:x", "tpu", "cpu:0"])
def test_unknown_device_is_one_line_exit_2(tiny_config, capsys, device):
    # Fault caught (issue 7): `run --device xyz` ended in torch's RuntimeError traceback.
    from kvpipe.cli import main
    rc = main(["run", "--device", device, "--model", tiny_config, "--random-weights", "--context", "64"])
    assert_in_process_exit_2(rc, capsys.readouterr().err, "device:")


def test_device_names_ignore_case():
    # Fault caught (issue 7): `--device CPU` ended in a traceback; names are case-insensitive.
    import torch
    from kvpipe.executor.engine.session import resolve_device
    assert resolve_device("CPU") == resolve_device(" cpu ") == torch.device("cpu")


@pytest.mark.parametrize("flag, name", [("--trace", "{dir}"), ("--trace", "{dir}/t"), ("--plot", "{dir}/t")])
def test_run_checks_output_paths_before_loading_anything(tmp_path, capsys, flag, name):
    # Fault caught (issue 7): a bad --trace/--plot path failed after the whole run. The preset
    # without --random-weights would fail at model loading; the path is reported instead.
    rc, _, err = cli(capsys, "--model", "llama-3-8b", "--context", "64", flag, name.replace("{dir}", str(tmp_path)))
    assert_in_process_exit_2(rc, err, flag.lstrip("-") + ":")


@pytest.mark.parametrize("body, needle", [
    ("", "is empty"),
    ("  \n\t ", "is empty"),
    ("1 2 -3 4", "token id -3 is negative"),
    ("1 2 999", "token id 999 is outside the vocabulary"),
])
def test_bad_prompt_file_says_what_is_wrong(tiny_config, tmp_path, capsys, body, needle):
    # Fault caught (issue 7): an empty prompt file or negative ids got "holds text, but the
    # model has no tokenizer" (or a traceback) instead of saying what is wrong.
    path = tmp_path / "prompt.txt"
    path.write_text(body)
    rc, _, err = cli(capsys, "--model", tiny_config, "--random-weights", "--prompt-file", str(path))
    assert_in_process_exit_2(rc, err, needle)


def test_prompt_longer_than_context_is_refused(tiny_config, tmp_path, capsys):
    # Fault caught (issue 7): a prompt longer than --context was silently cut to it.
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(str(i % 256) for i in range(80)))
    rc, _, err = cli(capsys, "--model", tiny_config, "--random-weights", "--context", "64", "--prompt-file", str(path))
    assert_in_process_exit_2(rc, err, "prompt-file: its 80 tokens exceed the context 64")


def test_prompt_file_sets_the_context(tiny_config, tmp_path):
    # Fault caught (issue 7): with --prompt-file and no --context the context stayed 32K, so a
    # 301-token prompt was refused. The run also equals the same ids given with --context 301.
    import kvpipe
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(str((7 * i) % 256) for i in range(301)))
    kw = dict(model=tiny_config, random_weights=True, device="cpu", progress=False, decode_tokens=2, chunk=64)
    res = kvpipe.run(prompt_file=str(path), **kw)
    assert res.workload.context == 301 and len(res.tokens[0]) == 3
    same = kvpipe.run(prompt_file=str(path), context=301, **kw)
    assert same.output_digest == res.output_digest


def test_context_past_max_position_embeddings_warns_before_running(tmp_path, capsys):
    # Fault caught (issue 7): a context beyond max_position_embeddings ran silently (for
    # minutes at real sizes). One warning line, printed before execution starts.
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(TINY, max_position_embeddings=64)))
    rc, out, err = cli(capsys, "--model", str(cfg), "--random-weights", "--context", "64", "--decode-tokens", "2")
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "max_position_embeddings (64)" in warnings[0], err
    assert err.index("warning") < err.index("executing")


def test_executing_line_comes_before_the_progress_bar(tiny_model, monkeypatch):
    # Fault caught (issue 7): "kvpipe: executing ..." was printed after tqdm drew its bar, so on
    # a terminal it landed on the bar's line and the bar's next refresh overwrote it. A stderr
    # that says it is a terminal makes tqdm draw as it would there.
    import io
    import torch
    from kvpipe.executor.engine.session import run_graph
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.model import from_hf_config
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.text import stderr_log

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    hf = tiny_model("llama")
    spec = from_hf_config(hf.config.to_dict(), "tiny")
    plan = Plan(Method.HEADWISE, PhasePlan(1, 16), PhasePlan(1, 1), 0)
    graph = build(spec, Workload(32, 2), plan)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with stderr_log():   # the CLI's voice: the line is the CLI's to print
        run_graph(graph, hf, torch.randint(0, 128, (1, 32)), torch.device("cpu"), 2**30, progress=True)
    text = term.getvalue()
    assert "prefill" in text                                  # tqdm did draw
    first_line, _, rest = text.partition("\n")
    assert first_line.startswith("kvpipe: executing") and "%" not in first_line, text[:300]
    assert "kvpipe: executing" not in rest


def test_bad_attention_kernel_setting_is_one_line_exit_2(tiny_config, capsys, monkeypatch):
    monkeypatch.setenv("KVPIPE_ATTN", "fa3")
    rc, _, err = cli(capsys, "--model", tiny_config, "--random-weights", "--context", "64")
    assert_in_process_exit_2(rc, err, "KVPIPE_ATTN='fa3'")


def test_ctrl_c_mid_run_exits_cleanly(tmp_path):
    """SIGINT while the lanes run: pinned buffers are released by the KV store's context manager,
    the command says so in one line and exits 130, no traceback."""
    import signal
    import time
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(TINY, max_position_embeddings=65536)))
    p = subprocess.Popen([sys.executable, "-m", "kvpipe", "run", "--device", "cpu", "--no-progress",
                          "--model", str(cfg), "--random-weights", "--context", "40000", "--chunk", "16",
                          "--decode-tokens", "4", "--resident", "none", "--group", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()              # printed just before the lanes start
    assert "executing" in line, line
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert "output digest" not in out


def test_local_hf_directory_and_plot(tmp_path, capsys):
    """Weights from a local HF directory (safetensors, nothing downloaded) match the same model
    run through --random-weights from its config (same seed), and --plot draws sim and real."""
    import torch
    from kvpipe.executor.layers.loader import random_model
    model = random_model(dict(TINY), "cpu", torch.float32, seed=5)
    model.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    assert list((tmp_path / "tiny").glob("*.safetensors"))
    common = ("--context", "96", "--decode-tokens", "3", "--chunk", "32", "--resident", "none", "--seed", "5")
    local = run_json(capsys, "--model", str(tmp_path / "tiny"), *common, "--plot", str(tmp_path / "t.png"))
    rand = run_json(capsys, "--model", str(tmp_path / "tiny" / "config.json"), "--random-weights", *common)
    # Tokens, not the digest: the digest hashes logits, whose last bits may differ on AVX-512
    # CPUs when safetensors hands back unaligned tensors (the weights themselves are compared
    # bitwise in test_end_to_end.py::test_load_pretrained_from_a_local_directory).
    assert local["tokens"] == rand["tokens"]
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_cuda_oom_during_a_run_is_one_line_with_exit_3(monkeypatch, capsys):
    """Fault caught: a CUDA out-of-memory in the executor reaching the user as a traceback. The
    GPU's error is stood in by torch's own OutOfMemoryError with the message text the H200 gave:
    one line naming the budget, the size asked and the fragmentation, exit 3."""
    torch = pytest.importorskip("torch")
    from kvpipe import api, cli
    h200 = ("CUDA out of memory. Tried to allocate 896.00 MiB. GPU 0 has a total capacity of 139.80 GiB of "
            "which 117.32 GiB is free. Including non-PyTorch memory, this process has 22.46 GiB memory in use. "
            "22.35 GiB allowed; Of the allocated memory 18.95 GiB is allocated by PyTorch, and 2.76 GiB is "
            "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")

    def oom(*args, **kw):   # the options, as the CLI passes them
        raise torch.OutOfMemoryError(h200)
    monkeypatch.setattr(api, "run", oom)
    assert cli.main(["run", "--model", "llama-3-8b", "--random-weights"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvpipe: error: --gpu-mem: CUDA out of memory")
    assert "896.00 MiB" in err[0] and "2.76 GiB reserved but unallocated" in err[0]
