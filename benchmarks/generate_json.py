"""`kvpipe generate --json` on a prompt of token ids, in its own process (each model load starts
under the GPU cap from a clean allocator): the JSON it prints. Used by savekv.py and serve_doc.py."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile


def generate_json(model: str, ids: list[int], new: int, *flags: str) -> dict:
    """The JSON of `kvpipe generate --model MODEL --random-weights` over `ids`, `new` tokens with
    EOS ignored, and `flags`; SystemExit with its stderr's tail when it fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(" ".join(map(str, ids)))
        f.flush()
        done = subprocess.run([sys.executable, "-m", "kvpipe", "generate", "--model", str(model), "--random-weights",
                               "--prompt-file", f.name, "--prompt-format", "ids", "--max-new-tokens", str(new),
                               "--ignore-eos", "--json", *flags], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"kvpipe generate exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)
