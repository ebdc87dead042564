"""`kvpipe run --gpus N` as a user runs it on CPU (kvpipe/multi_run.py, executor/dist/): the ranks
spawned by kvpipe agree bit for bit and their greedy tokens equal `kvpipe run` in one process."""
import json
import subprocess
import sys

TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
        "max_position_embeddings": 4096, "torch_dtype": "float32"}


def _run(cfg: str, *extra: str):
    argv = [sys.executable, "-m", "kvpipe", "run", "--model", cfg, "--random-weights", "--device", "cpu",
            "--context", "128", "--decode-tokens", "4", "--resident", "none", "--no-progress", "--json", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_run_gpus_matches_one_process(tmp_path):
    """Fault: `--gpus` is ignored (one process runs), the ranks build different weights or
    prompts than one process would (tokens differ), or a rank's result is dropped."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    two = _run(str(cfg), "--gpus", "2")
    assert two.returncode == 0, two.stderr
    out = json.loads(two.stdout)
    assert out["multi_gpu"]["tp"] == 2 and out["ranks_agree"] is True and len(out["ranks"]) == 2
    one = _run(str(cfg))
    assert one.returncode == 0, one.stderr
    assert out["tokens"] == json.loads(one.stdout)["tokens"]


def test_run_gpus_refuses_pipeline_stages(tmp_path):
    """Fault: `run --pp 2` starts ranks it cannot run (stages are predicted only) instead of one line, exit 2."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = _run(str(cfg), "--gpus", "2", "--pp", "2")
    assert r.returncode == 2 and r.stderr.strip().startswith("kvpipe: error: --pp:"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
