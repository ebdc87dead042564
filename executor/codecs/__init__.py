"""Lossless K/V codecs, one file each, looked up by the names of `pipeline.codecs.REGISTRY`, and the
compressed host homes of the h2d link's GPU codec (h2d_store.py). A CPU codec turns one block of
raw K/V bytes (elements of `elem` bytes) into a self-describing frame and back, bit for bit;
`load(name)` imports it only when a plan uses it."""
from __future__ import annotations

import importlib

from kvpipe.pipeline.codecs import codec_info

IMPLEMENTATIONS = {"zstd-planes": "kvpipe.executor.codecs.zstd_planes"}   # name -> module with `Codec`


def load(name: str):
    """An instance of codec `name`; ValueError if it has no CPU implementation or its package
    is not installed."""
    info = codec_info(name)
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"codec: {name} has no implementation in this executor")
    try:
        module = importlib.import_module(IMPLEMENTATIONS[name])
    except ImportError as e:
        raise ValueError(f"codec: {name} needs the {info.module!r} package ({e.name} missing): "
                         "pip install -e '.[run]'") from None
    return module.Codec()
