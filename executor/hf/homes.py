"""Whole-cache operations on a HeadStream's KV homes, across tiers: read a layer's K/V back as
one tensor, reorder or resize the batch (beam search, num_return_sequences, batch selection),
and copy every home into a fresh stream (`copy.deepcopy` of a cache). Each runs between steps."""
from __future__ import annotations

from dataclasses import replace

import torch

from kvpipe.executor.hf.headstream import HeadStream


def settle(stream: HeadStream) -> None:
    """Wait for every copy in flight (the d2h stores of offloaded heads, the h2d prefetches)."""
    if stream.cuda:
        torch.cuda.synchronize(stream.store.device)


def homes(stream: HeadStream, layer: int) -> list[torch.Tensor]:
    """The layer's home buffers, resident heads first: [B, n, S_cap, 2, D] per tier present."""
    store = stream.store
    return [t for t in (store.gpu[layer], store.host[layer]) if t is not None]


def materialise(stream: HeadStream, layer: int, length: int) -> torch.Tensor:
    """A copy of the layer's K/V over positions [0, length): [B, H, length, 2, D] on the device."""
    settle(stream)
    parts = [t[:, :, :length].to(stream.store.device) for t in homes(stream, layer)]
    return torch.cat(parts, dim=1)


def regather(stream: HeadStream, index: torch.Tensor) -> HeadStream:
    """Sequence i of the result is sequence index[i] of `stream`, in every home. Same batch: in
    place (the same stream); another batch: a new stream, and `stream` is closed."""
    settle(stream)
    lo, n = stream.layout, int(index.numel())
    same = n == lo.batch
    out = stream if same else HeadStream(replace(lo, batch=n), stream.groups, stream.store.device,
                                         stream.store.dtype, stream.replay).open()
    try:
        for layer in range(lo.layers):
            for src, dst in zip(homes(stream, layer), homes(out, layer)):
                dst.copy_(src.index_select(0, index.to(src.device)))
    except BaseException:
        if not same:
            out.close()
        raise
    if not same:
        stream.close()
    settle(out)
    return out


def duplicate(stream: HeadStream, length: int) -> HeadStream:
    """A new stream of the same layout holding a copy of the first `length` tokens of every home."""
    settle(stream)
    lo = stream.layout
    out = HeadStream(lo, stream.groups, stream.store.device, stream.store.dtype, stream.replay).open()
    for layer in range(lo.layers):
        for src, dst in zip(homes(stream, layer), homes(out, layer)):
            dst[:, :, :length].copy_(src[:, :, :length])
    settle(out)
    return out
