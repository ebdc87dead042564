"""The fused-decode setting, in one place for the CLI, the API, the simulator and the executor:
`auto` (the default) fuses the elementwise work of replayed decode steps with torch.compile
where it can run (CUDA replay and a working inductor/Triton), `on` insists (refused where it
cannot run), `off` keeps HF's modules. `--fuse` gives it; without the flag the environment
variable KVPIPE_FUSE does (1/on, 0/off, auto), else `auto`.

Fusion is exact across placements (every placement runs the same fused code: offloaded ==
resident bit for bit) but not bit-equal to HF eager: inductor keeps intermediates in fp32 where
HF rounds to bf16 and sums in another order, so logits agree within bf16 rounding."""
from __future__ import annotations

import os
from collections.abc import Mapping

FUSE_ENV = "KVPIPE_FUSE"
MODES = ("auto", "on", "off")
# Families with a fused form (executor/layers/fused.py): separate q/k/v and gate/up projections, two norms
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_ALIASES = {"1": "on", "true": "on", "0": "off", "false": "off"}


def fuse_mode(value: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The setting as one of MODES: `value` (the --fuse flag / `fuse=` argument) when given, else
    KVPIPE_FUSE from `env` (default: os.environ), else "auto". ValueError names the field."""
    if value is not None:
        v = str(value).strip().lower()
        if v not in MODES:
            raise ValueError(f"fuse: expected one of {', '.join(MODES)}, got {value!r}")
        return v
    raw = (os.environ if env is None else env).get(FUSE_ENV, "")
    v = raw.strip().lower()
    if not v:
        return "auto"
    v = _ALIASES.get(v, v)
    if v not in MODES:
        raise ValueError(f"{FUSE_ENV}={raw!r}: expected auto, on or off (or 1, 0)")
    return v


def decode_fused(mode: str, replayed: bool, family: str | None = None) -> bool:
    """Whether decode steps run (and the simulator models) the fused pieces: only replayed decode
    steps of a family in FAMILIES (None: assumed one) run them, under `auto` or `on`. Assumes the
    model's activation has a fused form (SiLU; executor/layers/fused.py runs others unfused) and
    that compile works."""
    if mode not in MODES:
        raise ValueError(f"fuse: expected one of {', '.join(MODES)}, got {mode!r}")
    return mode != "off" and replayed and (family is None or family in FAMILIES)


def refuse_unfusable(mode: str, replayed: bool) -> None:
    """`on` where decode steps are not replayed is refused (ValueError naming the field)."""
    if mode == "on" and not replayed:
        raise ValueError("fuse: on needs decode steps replayed as CUDA graphs (CUDA, bf16/fp16, batch 1, "
                         "no disk units or lossy KV); use --fuse auto or off")
