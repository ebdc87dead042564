"""What the planner knows of each codec, torch-free: its name, whether it is lossless, the lane
it runs on and the links it may serve. The implementations live in `executor/codecs/` (CPU frame
codecs, one file each) and `executor/codecs/nvcomp_ans_planes.py` (the GPU codec of the h2d link); rates and
ratios live in the hardware profile (`[codec.<name>]`).

A GPU codec on h2d stores each offloaded host unit compressed: its tokens in blocks of
`H2D_BLOCK_TOKENS` or the prefill chunk, the smaller (a block is encoded once, when it fills;
the tokens of a block not yet full stay exact in a small GPU tail), so a fetch moves stored
bytes = raw / ratio."""
from __future__ import annotations

from dataclasses import dataclass

LINKS = ("h2d", "d2h", "disk")
H2D_BLOCK_TOKENS = 4096   # tokens per encoded block of a GPU h2d codec, at most (the prefill chunk if smaller)


@dataclass(frozen=True)
class CodecInfo:
    """`lane` is where it runs ("cpu" thread pool or "gpu"); `links` the links it can serve;
    `module` the Python package it needs at run time (empty: none)."""

    name: str
    lossless: bool
    lane: str
    links: tuple[str, ...]
    module: str
    description: str

    def __post_init__(self) -> None:
        if self.lane not in ("cpu", "gpu", "-"):
            raise ValueError(f"lane: {self.lane!r} is not cpu or gpu")
        if not set(self.links) <= set(LINKS):
            raise ValueError(f"links: {self.links!r} names a link outside {LINKS}")


REGISTRY: dict[str, CodecInfo] = {c.name: c for c in (
    CodecInfo("none", True, "-", LINKS, "", "no compression"),
    CodecInfo("zstd-planes", True, "cpu", ("disk",), "zstandard",
              "byte planes of bf16/fp16 (high byte: sign and exponent, apart) then zstd level 1"),
    CodecInfo("nvcomp-ans-planes", True, "gpu", ("h2d",), "nvidia.nvcomp",
              "byte planes of bf16/fp16 on the GPU, nvCOMP ANS on the high byte (sign, exponent), low byte raw"),
)}


def codec_info(name: str) -> CodecInfo:
    if name not in REGISTRY:
        raise ValueError(f"codec: unknown {name!r} (known: {', '.join(REGISTRY)})")
    return REGISTRY[name]


def parse_codec(text: str) -> tuple[str, str]:
    """`disk=zstd-planes` -> ('disk', 'zstd-planes'), checked against the registry."""
    link, sep, name = text.partition("=")
    if not sep or link not in LINKS:
        raise ValueError(f"codec: expected LINK=NAME with LINK one of {', '.join(LINKS)}, got {text!r}")
    if name == "auto":   # the simulator picks (sim.codec_choice)
        return link, name
    info = codec_info(name)
    if link not in info.links:
        raise ValueError(f"codec: {name} cannot serve the {link} link (it serves {', '.join(info.links)})")
    return link, name


def installed(info: CodecInfo) -> bool:
    """Whether the package the codec needs can be found here (only a namespace parent such as
    `nvidia` may be imported to look)."""
    import importlib.util
    if not info.module:
        return True
    try:
        return importlib.util.find_spec(info.module) is not None
    except ImportError:   # the parent package of a dotted name is missing
        return False


def h2d_codec(plan) -> str:
    """The codec of the plan's h2d link (one for both phases: `Plan.check` refuses two)."""
    return plan.decode.codec("h2d")


def describe() -> list[str]:
    """One line per codec, as `kvpipe codecs` prints them."""
    return [f"{c.name:17} {'lossless' if c.lossless else 'LOSSY':9} runs on {c.lane:4} links "
            f"{','.join(c.links):13} {c.description}"
            + ("" if installed(c) else f" [not installed: pip install {_PIP.get(c.module, c.module)}]")
            for c in REGISTRY.values()]


_PIP = {"nvidia.nvcomp": "nvidia-nvcomp-cu13"}   # import name -> the package that provides it
