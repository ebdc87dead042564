"""Lossy options, opt-in and labelled: group-wise int8/int4 quantisation of offloaded KV and sparse
decode (each step fetches a fraction of the offloaded tokens, chosen by chunk key summaries).
This module holds the spec and the byte-size formulas the builder and the simulator use; the
tensor code is in executor/quant.py and executor/sparse.py. Torch-free."""
from __future__ import annotations

import math
from dataclasses import dataclass

QUANT_BITS = {"int8": 8, "int4": 4}
# Default values per scale/zero-point: int4 needs smaller groups to stay near 1e-1 output error on
# the synthetic needle set (benchmarks/lossy_error.py: group 64 gave 0.12, group 32 about 0.09).
DEFAULT_GROUP = {"int8": 64, "int4": 32}
META_BYTES = 2     # scale and zero-point (the group minimum) are float16 each


@dataclass(frozen=True)
class LossySpec:
    """`quant`: None, "int8" or "int4" (asymmetric min-max, one scale and zero-point per `group`
    elements). `sparse`: None or the fraction of each decode step's offloaded tokens fetched, in
    (0, 1], chosen by key summaries (per-channel min/max) of `chunk`-token chunks, `sink` first
    tokens and the `recent` last tokens always included. `error` is a measured error to report
    (e.g. {"attn_rel_err": ...}), or None where nothing was measured."""

    quant: str | None = None
    group: int | None = None
    sparse: float | None = None
    chunk: int = 64
    sink: int = 64
    recent: int = 256
    error: tuple[tuple[str, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.quant is not None and self.quant not in QUANT_BITS:
            raise ValueError(f"lossy: unknown quantisation {self.quant!r} (known: {', '.join(QUANT_BITS)})")
        if self.sparse is not None and not (isinstance(self.sparse, (int, float)) and 0 < self.sparse <= 1):
            raise ValueError(f"sparse: must be a fraction in (0, 1], got {self.sparse!r}")
        if self.group is None:
            object.__setattr__(self, "group", DEFAULT_GROUP.get(self.quant, 64))
        for f in ("group", "chunk"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0 or v % 2:
                raise ValueError(f"{f}: must be a positive even integer, got {v!r}")
        for f in ("sink", "recent"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{f}: must be >= 0 tokens, got {v!r}")
        if self.quant is None and self.sparse is None:
            raise ValueError("lossy: a lossy spec needs quant or sparse (exact runs have no spec)")

    @property
    def bits(self) -> int | None:
        return QUANT_BITS.get(self.quant) if self.quant else None

    def stored_bytes(self, elements: int, dtype_bytes: int) -> int:
        """Bytes that `elements` KV values occupy once stored: codes plus per-group metadata."""
        if self.quant is None:
            return elements * dtype_bytes
        groups = math.ceil(elements / self.group)
        return math.ceil(elements * self.bits / 8) + 2 * META_BYTES * groups

    def ratio(self, dtype_bytes: int) -> float:
        """Stored bytes per exact byte (1 without quantisation); int4, group 32, bf16: 0.3125."""
        return self.stored_bytes(self.group, dtype_bytes) / (self.group * dtype_bytes)

    def fetched_tokens(self, prefix: int) -> int:
        """Tokens of a `prefix`-token cache one sparse decode step fetches (all without `sparse`):
        the budget ceil(sparse * prefix), never below sink + recent, never above the prefix."""
        if self.sparse is None:
            return prefix
        return min(prefix, max(math.ceil(self.sparse * prefix), self.sink + self.recent))

    def summary_bytes(self, prefix: int, head_dim: int, dtype_bytes: int) -> int:
        """Key summaries of one (layer, KV head) unit: per-channel min and max per chunk."""
        return 0 if self.sparse is None else math.ceil(prefix / self.chunk) * 2 * head_dim * dtype_bytes

    def describe(self) -> str:
        parts = []
        if self.quant:
            parts.append(f"{self.quant} KV (group {self.group})")
        if self.sparse is not None:
            parts.append(f"sparse decode {self.sparse:.0%} of tokens (chunks {self.chunk}, sink {self.sink}, "
                         f"recent {self.recent})")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {"quant": self.quant, "group": self.group if self.quant else None, "sparse": self.sparse,
                "chunk": self.chunk if self.sparse is not None else None,
                "sink": self.sink if self.sparse is not None else None,
                "recent": self.recent if self.sparse is not None else None,
                "measured_error": dict(self.error) if self.error else None}

    @classmethod
    def from_json(cls, obj: dict | None) -> "LossySpec | None":
        if obj is None:
            return None
        keep = {k: obj[k] for k in ("quant", "group", "sparse", "chunk", "sink", "recent") if obj.get(k) is not None}
        err = obj.get("measured_error")
        return cls(**keep, error=tuple(sorted(err.items())) if err else None)
