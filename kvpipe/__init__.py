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

__version__ = "0.1.0"

from kvpipe.api import PlanResult, Predicted, RunResult, plan, run  # noqa: E402
from kvpipe.options import PlanOptions, RunOptions  # noqa: E402
from kvpipe.pipeline.replay import Replay  # noqa: E402
from kvpipe.generation import GenerateResult, generate  # noqa: E402
from kvpipe.conversation import Conversation  # noqa: E402

__all__ = ["__version__", "plan", "run", "generate", "PlanOptions", "RunOptions", "Replay", "PlanResult", "RunResult",
           "GenerateResult", "Predicted", "HeadwiseCache", "Conversation"]


def __getattr__(name: str):
    """`kvpipe.HeadwiseCache` is imported on first use, so `import kvpipe` stays torch-free."""
    if name == "HeadwiseCache":
        from kvpipe.hf_cache import HeadwiseCache
        return HeadwiseCache
    raise AttributeError(f"module 'kvpipe' has no attribute {name!r}")
