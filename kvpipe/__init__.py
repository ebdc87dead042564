"""kvpipe: long-context LLM inference on one GPU with the KV cache split by attention head across
GPU memory, pinned host RAM and disk. The layers install under this package: `kvpipe.pipeline`
(vocabulary), `kvpipe.sim` (simulator), `kvpipe.executor` (real backend), `kvpipe.hw_profiles`,
`kvpipe.analysis`; this package holds the application layer (CLI and public API).

    import kvpipe
    kvpipe.plan(model="llama-3-8b", hw="rtx4090", context="1M")    # -> PlanResult (no torch)
    kvpipe.run(model="./tiny", context="4K", device="cpu")          # -> RunResult
    kvpipe.plan(kvpipe.PlanOptions(context="128K", replay="off"))   # the same options the CLI builds
    kvpipe.generate(model="./SmolLM2", prompt="Hi!", max_new_tokens=32)  # -> GenerateResult
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# where each public name lives: imported on first use, so `import kvpipe` (and so the command
# line's entry, kvpipe/__main__.py) does no work that a Ctrl-C could interrupt outside its guard
_PUBLIC = {"plan": "api", "run": "api", "PlanResult": "api", "RunResult": "api", "Predicted": "api",
           "PlanOptions": "options", "RunOptions": "options", "Replay": "pipeline.replay",
           "generate": "generation", "GenerateResult": "generation", "Conversation": "conversation",
           "HeadwiseCache": "hf_cache"}   # HeadwiseCache imports torch: `import kvpipe` stays torch-free

__all__ = ["__version__", "plan", "run", "generate", "PlanOptions", "RunOptions", "Replay", "PlanResult", "RunResult",
           "GenerateResult", "Predicted", "HeadwiseCache", "Conversation"]


def __getattr__(name: str):
    """`kvpipe.plan`, `kvpipe.generate`, ...: the public names, imported on first use."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvpipe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvpipe.{_PUBLIC[name]}"), name)
