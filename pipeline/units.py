"""Parsing and printing of token counts, byte sizes and durations.

Units, as everywhere in kvpipe: token counts take binary K/M (`128K` = 131072, `1M` = 1048576,
as in "a 128K context"); byte sizes are decimal with SI suffixes (`24GB` = 24e9, `KB`, `MB`,
`TB`) or binary with IEC suffixes (`24GiB` = 24 * 2**30, `KiB`, `MiB`, `TiB`); a bare number is
tokens or bytes. Printed sizes are binary (GiB); long durations print as h / min / s."""
from __future__ import annotations

import re

_TOKEN_SUFFIX = {"": 1, "K": 1024, "M": 1024**2}
_BYTE_SUFFIX = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_tokens(text: str | int, field: str = "context") -> int:
    """`1M` -> 1048576, `128K` -> 131072, `131072` -> 131072 (binary K/M as in '128K context')."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
    if m and m.group(1).startswith("-"):
        raise ValueError(f"{field}: must be positive, got {text!r}")
    if not m:
        raise ValueError(f"{field}: cannot read {text!r} as a token count (e.g. 1M, 128K, 131072)")
    value = float(m.group(1)) * _TOKEN_SUFFIX[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"{field}: {text!r} is not a whole number of tokens")
    return int(value)


def parse_bytes(text: str | int, field: str) -> int:
    """`24GB` -> 24e9, `24GiB` -> 24*2**30; a bare number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _BYTE_SUFFIX:
        raise ValueError(f"{field}: cannot read {text!r} as a size (e.g. 24GB, 24GiB, 64e9)")
    return int(float(m.group(1)) * _BYTE_SUFFIX[m.group(2).upper()])


def fmt_bytes(n: float) -> str:
    """Human size in binary units, e.g. '16.4 GiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def fmt_tokens(n: int) -> str:
    """1048576 -> '1M', 131072 -> '128K', 35900 -> '35.1K', 1000 -> '1000' (binary K/M)."""
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n // scale}{unit}" if n % scale == 0 else f"{n / scale:.{2 if unit == 'M' else 1}f}{unit}"
    return str(n)


def fmt_seconds(x: float | None) -> str:
    """0.0123 -> '12.3 ms', 4.5 -> '4.50 s', 137 -> '2 min 17 s', 7384 -> '2 h 03 min'; None -> '-'."""
    if x is None:
        return "-"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    if x < 60:
        return f"{x:.2f} s"
    whole = round(x)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    minutes = round(x / 60)
    return f"{minutes // 60:,} h {minutes % 60:02d} min"
