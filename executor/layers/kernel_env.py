"""The environment switches of kvpipe's hand-written Triton kernels: a kernel's KVPIPE_* setting
(validated, `auto` when unset) and whether Triton's interpreter runs them (the CPU tests)."""
from __future__ import annotations

import os


def setting(var: str, choices: tuple[str, ...]) -> str:
    """Environment variable `var`, lower-cased and one of `choices` (the first when unset)."""
    name = os.environ.get(var, choices[0]).strip().lower() or choices[0]
    if name not in choices:
        raise ValueError(f"{var}={name!r}: expected one of {', '.join(choices)}")
    return name


def interpreted() -> bool:
    """TRITON_INTERPRET=1: the kernels run on CPU tensors in Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"
