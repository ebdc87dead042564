"""One tensor-parallel rank's model: the Hugging Face model with this rank's KV heads and their
query heads, the MLP width split by rows and columns as Megatron-LM splits it, and the row-split
projections (o_proj, down_proj) summed over the ranks by an all-reduce. Embedding, norms and head
are kept whole on every rank."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvpipe.executor.layers.loader import random_model


class Reduced(torch.nn.Module):
    """A row-split linear whose partial output is summed over the ranks (in place)."""

    def __init__(self, linear: torch.nn.Linear, reduce: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        assert linear.bias is None, "a row-split bias would be added tp times"
        self.linear, self.reduce = linear, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.reduce(y)
        return y


def shard_config(config: dict, tp: int) -> dict:
    """The rank's config: heads and MLP width / tp; ValueError naming --tp where it does not divide."""
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    inter = config["intermediate_size"]
    if kv % tp or inter % tp:
        raise ValueError(f"tp: {tp} does not divide the model's {kv} KV heads and MLP width {inter}")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return dict(config, num_attention_heads=heads // tp, num_key_value_heads=kv // tp,
                intermediate_size=inter // tp, head_dim=head_dim)


def _rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[1] // tp
    return w[:, rank * n:(rank + 1) * n]


@torch.no_grad()
def shard_model(full: torch.nn.Module, config: dict, rank: int, tp: int,
                reduce: Callable[[torch.Tensor], None]) -> torch.nn.Module:
    """Rank `rank`'s model of `full` (built from `config`): its slice of every projection; KV
    head h of the whole model is head h - rank * kv/tp of this rank's (a contiguous block)."""
    part = random_model(shard_config(config, tp), full.device, full.dtype, seed=0)
    src = dict(full.named_parameters())
    for name, p in part.named_parameters():
        w = src[name]
        if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            w = _rows(w, rank, tp)   # output features: this rank's heads / MLP columns (biases too)
        elif any(k in name for k in ("o_proj", "down_proj")):
            w = _cols(w, rank, tp)   # input features: this rank's heads / MLP rows
        assert p.shape == w.shape, (name, p.shape, w.shape)
        p.copy_(w)
    for layer in part.model.layers:
        layer.self_attn.o_proj = Reduced(layer.self_attn.o_proj, reduce)
        layer.mlp.down_proj = Reduced(layer.mlp.down_proj, reduce)
    return part.eval()
