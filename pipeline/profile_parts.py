"""The checked parts of a hardware profile: one codec's rates, the replayed decode attention per
head group, a FLOP/s table per dtype, and the one-line field error they all raise."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")  # same names as ModelSpec.dtype

FlopsTable = tuple[tuple[str, float], ...]  # ((dtype, FLOP/s), ...) sorted by dtype


@dataclass(frozen=True)
class CodecRates:
    """One codec on one machine: raw bytes per second through its pool each way, and the ratio
    raw / stored on K/V (data-dependent: each profile says on what K/V it was measured).

    A GPU codec is called once per batch of blocks: a call costs `*_call_s + raw bytes / rate`
    (`kvpipe calibrate` fits both on batches of the executor's block size; 0: no fixed cost, as
    profiles written before the fit say). `split_bytes_per_s` / `interleave_bytes_per_s`: raw bytes
    per second of the byte-plane kernels around the codec (split before the encode; set-aside and
    interleave after the decode); None: charged at the HBM copy rate. `decompress_waits_h2d`: a
    decode call issued while host -> device copies of another stream are in flight starts only
    after they end (measured by calibrate; the simulator then holds each decompress stage until
    the fetches the executor issued before it have ended)."""

    name: str
    compress_bytes_per_s: float
    decompress_bytes_per_s: float
    ratio: float
    compress_call_s: float = 0.0
    decompress_call_s: float = 0.0
    split_bytes_per_s: float | None = None
    interleave_bytes_per_s: float | None = None
    decompress_waits_h2d: bool = False

    def __post_init__(self) -> None:
        for f in ("compress_bytes_per_s", "decompress_bytes_per_s", "ratio"):
            object.__setattr__(self, f, number(f"codec.{self.name}.{f}", getattr(self, f), False))
        for f in ("compress_call_s", "decompress_call_s"):
            object.__setattr__(self, f, number(f"codec.{self.name}.{f}", getattr(self, f), True))
        for f in ("split_bytes_per_s", "interleave_bytes_per_s"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, number(f"codec.{self.name}.{f}", getattr(self, f), False))
        if not isinstance(self.decompress_waits_h2d, bool):
            raise HardwareFieldError(f"codec.{self.name}.decompress_waits_h2d",
                                     f"must be true or false, got {self.decompress_waits_h2d!r}")


@dataclass(frozen=True)
class DecodeAttention:
    """The replayed decode attention call on one machine for `group` KV heads per call
    (executor/attention.attend_decode, split-KV: Triton or FA2): `call_s + kv_bytes / bytes_per_s`,
    measured by `kvpipe calibrate` ([gpu.decode_attention.g<group>]). Few heads per call read
    their K/V far below the copy rate, so the rate is per group size."""

    group: int
    call_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group <= 0:
            raise HardwareFieldError(f"decode_attention.g{self.group}", f"group must be a positive integer, got {self.group!r}")
        object.__setattr__(self, "call_s", number(f"decode_attention.g{self.group}.call_s", self.call_s, True))
        object.__setattr__(self, "bytes_per_s", number(f"decode_attention.g{self.group}.bytes_per_s", self.bytes_per_s, False))

    def seconds(self, kv_bytes: float) -> float:
        return self.call_s + kv_bytes / self.bytes_per_s


class HardwareFieldError(ValueError):
    """A bad HardwareProfile field; `field` names it ('flops_eff_per_s.bf16' for a dtype entry)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"hardware.{field}: {problem}")
        self.field = field
        self.problem = problem


def number(field: str, value: object, allow_zero: bool) -> float:
    """`value` as a float, finite and > 0 (>= 0 with `allow_zero`), else a HardwareFieldError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HardwareFieldError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise HardwareFieldError(field, f"must be finite and {'>=' if allow_zero else '>'} 0, "
                                        f"got {value!r}")
    return float(value)


def flops_table(field: str, table: Mapping[str, float] | Iterable[tuple[str, float]]) -> FlopsTable:
    """((dtype, FLOP/s), ...) sorted by dtype, each dtype known and each rate checked."""
    pairs = list(table.items() if isinstance(table, Mapping) else table)
    if not pairs:
        raise HardwareFieldError(field, "needs at least one dtype")
    for dtype, _ in pairs:
        if dtype not in DTYPES:
            raise HardwareFieldError(f"{field}.{dtype}", f"unknown dtype {dtype!r} "
                                                         f"(known: {', '.join(DTYPES)})")
    return tuple(sorted((d, number(f"{field}.{d}", v, False)) for d, v in pairs))
