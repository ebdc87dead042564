"""(helper, not a test) `kvpipe serve` as a real process on a free loopback port, for the serve
tests: started with the CLI, waited for on /health, stopped with SIGTERM (its exit code kept)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STARTUP_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")   # a file, not a pipe: a full pipe would block the server
        full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpipe", "serve", *argv, "--port", str(self.port)],
                                     env=full, stderr=self.log, text=True)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpipe serve exited {self.proc.returncode}: {self.stderr()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("kvpipe serve did not answer /health")

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(text: str, name: str) -> float:
    """The value of an unlabelled (or fully labelled) Prometheus sample."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def tiny_dir(root: Path, tokenizer_dir: Path, max_positions: int = 1 << 20) -> Path:
    """A tiny random Llama (2 layers, 2 KV heads) with SmolLM2's tokenizer and chat template."""
    d = root / "tiny"
    d.mkdir(exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(f, d / f.name)
    cfg = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
               rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    (d / "config.json").write_text(json.dumps(cfg))
    return d
