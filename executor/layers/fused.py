"""Fused decode pieces: the per-layer elementwise work of a decode step (RMSNorm, residual adds,
RoPE with the q/k/v layout, the MLP's act(gate) * up) as a few functions compiled by
torch.compile (inductor: Triton on CUDA, C++ on CPU), each computing HF's math from the HF
modules' own weights and config. The one-token matmuls are fused too: q, k and v are one GEMM, gate
and up another (`fuse_projections`: the modules' weights become views of one buffer each, so no
byte is added and prefill's own calls are unchanged), as one larger GEMM reads its weights nearer
the HBM rate (measured at Llama-3-8B shapes on the H200: experiments/decode_pieces.py); o and
down (with act(gate) * up in its loads) run as executor/layers/gemv_triton.py's kernel where it can.

On by default where it can run (`--fuse auto|on|off`, the setting of pipeline/fusion.py): only
the replayed decode step uses it (executor/replay/device_step.py), on CUDA with a working Triton, so
offloaded and resident placements run the same fused code; CPU and eager decode stay unfused.
Under `auto` a compile that fails falls back to HF's modules (`warm_or_fall_back`, one note).
Inductor keeps intermediates in fp32
where HF rounds them to bf16; `emulate_precision_casts` restores HF's roundings at its casts, but
the reductions' order differs, so fused != HF eager bit for bit (compared within bf16 rounding).
The residual add after the MLP is deferred into the next RMSNorm (next layer's input norm, or
the final norm), so one kernel does add + norm. Each function is compiled once per process for
every layer (same shapes; weights are arguments, not guarded), before any CUDA-graph capture
(`FusedDecode.warm`); no inductor cudagraphs: the replay captures the step itself."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpipe.executor.engine.compiling import compile_fn
from kvpipe.executor.layers import gemv_triton
from kvpipe.pipeline.fusion import FAMILIES, FUSE_ENV, fuse_mode  # noqa: F401  (the setting's one definition)

_ACTS = {"silu": F.silu}      # hidden_act -> the function HF's ACT2FN applies (extension: one line)


# ---- one buffer per fused matmul, the modules' weights views of it ------------------------------
def _joined(mods: list[torch.nn.Module], name: str) -> torch.Tensor | None:
    """The modules' `name` tensors (weight or bias) as one buffer, each module's now a view of its
    rows (parameters replaced one by one, so a layer's old tensors are freed as it goes); None
    where the modules have no such tensor."""
    parts = [getattr(m, name) for m in mods]
    if any(p is None for p in parts):
        return None
    whole = torch.cat([p.detach() for p in parts])
    at = 0
    for m, p in zip(mods, parts):
        setattr(m, name, torch.nn.Parameter(whole[at:at + p.shape[0]], requires_grad=p.requires_grad))
        at += p.shape[0]
    return whole


def _groups(layer: torch.nn.Module) -> tuple[list, list]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]


def _aliases(mods: list[torch.nn.Module], whole: torch.Tensor) -> bool:
    """Whether the modules' weights are still the consecutive row views of `whole`."""
    at = whole.data_ptr()
    for m in mods:
        if m.weight.data_ptr() != at:
            return False
        at += m.weight.numel() * m.weight.element_size()
    return True


def fuse_projections(layer: torch.nn.Module) -> tuple:
    """(qkv weight, qkv bias, gate-up weight, gate-up bias) of one HF decoder layer (a bias None
    where the modules have none), made once per model and kept on the layer, made again if a
    module's weight was replaced since: the same values, so every module call computes as before."""
    qkv, gate_up = _groups(layer)
    kept = getattr(layer, "_kvpipe_fused", None)
    if kept is None or not (_aliases(qkv, kept[0]) and _aliases(gate_up, kept[2])):
        with torch.inference_mode(False), torch.no_grad():   # plain tensors: HF's own calls may need grad off only
            kept = (_joined(qkv, "weight"), _joined(qkv, "bias"),
                    _joined(gate_up, "weight"), _joined(gate_up, "bias"))
        layer._kvpipe_fused = kept
    return kept


# ---- the math (pure; compiled below) --------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm: mean of squares in fp32, the normalised value cast back, times w."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def add_norm(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (x + d, rms_norm(x + d)); the sum rounded to x.dtype as in HF."""
    h = x + d
    return h, rms_norm(h, w, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                qk_norm: tuple[torch.Tensor, float, torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k, v [B, T, Hkv, D] (projections), cos, sin [1, T, D]; qk_norm: Qwen3's
    per-head (q weight, eps, k weight, eps) -> q [B, Hq, T, D] contiguous, roped; K/V [B, Hkv, T, 2, D]."""
    if qk_norm is not None:
        qw, q_eps, kw, k_eps = qk_norm
        q, k = rms_norm(q, qw, q_eps), rms_norm(k, kw, k_eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                     # [1, 1, T, D]
    q = _rotate(q.transpose(1, 2), cos, sin)                          # [B, Hq, T, D]
    k = _rotate(k.transpose(1, 2), cos, sin)                          # [B, Hkv, T, D]
    return q.contiguous(), torch.stack((k, v.transpose(1, 2)), dim=3)


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """The gated MLP's act(gate) * up."""
    return _ACTS[act](gate) * up


_MATH = {"norm": rms_norm, "add_norm": add_norm, "rope": rope_layout, "act_mul": act_mul}


@functools.cache
def compiled(name: str, compile: bool) -> Callable:
    """The function `name` of _MATH, torch.compile'd once per process (memoised: dynamo's cache
    then serves every layer and every run)."""
    fn = _MATH[name]
    if not compile:
        return fn
    return compile_fn(fn, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})


class FusedDecode:
    """The adapter's decode pieces with fused elementwise work. The residual stream is carried as
    (hidden, pending): `pending` is the last MLP's output, added by the next norm (None at layer 0)."""

    def __init__(self, adapter, compile: bool = True) -> None:
        act = getattr(adapter.model.config, "hidden_act", None)
        if act not in _ACTS:
            raise ValueError(f"fuse: hidden_act {act!r} has no fused form (supported: {', '.join(_ACTS)})")
        self.adapter, self.act = adapter, act
        self.norm, self.add_norm = compiled("norm", compile), compiled("add_norm", compile)
        self.rope, self.act_mul = compiled("rope", compile), compiled("act_mul", compile)
        layers = adapter.body.layers
        kept = [getattr(mod, "_kvpipe_fused", None) for mod in layers]
        self.weights = [fuse_projections(mod) for mod in layers]
        if adapter.device.type == "cuda" and any(a is not b for a, b in zip(kept, self.weights)):
            torch.cuda.empty_cache()   # the layers' old separate weights, freed, back to the cap
        self.compile_s = 0.0

    def _normed(self, hidden, pending, norm):
        """(hidden + pending, norm(hidden + pending)) with HF RMSNorm module `norm`'s weight and eps."""
        eps = float(norm.variance_epsilon)
        if pending is None:
            return hidden, self.norm(hidden, norm.weight, eps)
        return self.add_norm(hidden, pending, norm.weight, eps)

    def qkv(self, layer: int, hidden: torch.Tensor, pending: torch.Tensor | None,
            rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As HFAdapter.qkv, with the pending residual added first -> hidden, q [B, Hq, T, D], K/V."""
        mod = self.adapter.body.layers[layer]
        attn, D = mod.self_attn, self.adapter.head_dim
        B, T, _ = hidden.shape
        hidden, x = self._normed(hidden, pending, mod.input_layernorm)
        w, b = self.weights[layer][:2]
        nq, nkv = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        q, k, v = gemv_triton.linear(x, w, b).split((nq, nkv, nkv), dim=-1)
        q, k, v = q.view(B, T, -1, D), k.view(B, T, -1, D), v.view(B, T, -1, D)
        qk = None
        if hasattr(attn, "q_norm"):
            qk = (attn.q_norm.weight, float(attn.q_norm.variance_epsilon),
                  attn.k_norm.weight, float(attn.k_norm.variance_epsilon))
        q, kv = self.rope(q, k, v, rope[0], rope[1], qk)
        return hidden, q, kv

    def mlp(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As HFAdapter.mlp without its last residual add -> (hidden after attention, MLP output)."""
        mod = self.adapter.body.layers[layer]
        B, T = attn_out.shape[:2]
        o, down = mod.self_attn.o_proj, mod.mlp.down_proj
        hidden, x = self._normed(hidden, gemv_triton.linear(attn_out.reshape(B, T, -1), o.weight, o.bias),
                                 mod.post_attention_layernorm)
        gate_up = gemv_triton.linear(x, *self.weights[layer][2:])
        act_mul = functools.partial(self.act_mul, act=self.act)
        return hidden, gemv_triton.gated_linear(gate_up, down.weight, down.bias, self.act, act_mul)

    def head(self, hidden: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        """As HFAdapter.head: final norm (after the pending add) and lm_head -> fp32 logits [B, V]."""
        _, x = self._normed(hidden[:, -1:], None if pending is None else pending[:, -1:],
                            self.adapter.body.norm)
        return self.adapter.model.lm_head(x)[:, 0].float()

    def warm(self, positions: torch.Tensor) -> float:
        """Run every piece once on zeros of a decode step's shapes (layer 0's weights), so each
        function is compiled before a CUDA graph is captured; returns the seconds it took."""
        t0 = time.perf_counter()
        a = self.adapter
        ids = torch.zeros(1, 1, dtype=torch.long, device=a.device)
        hidden, rope = a.embed(ids, 0, positions=positions.view(1, 1))
        _, q, _ = self.qkv(0, hidden, None, rope)
        h, d = self.mlp(0, hidden, q.transpose(1, 2))
        self.qkv(0, h, d, rope)
        self.head(h, d)
        self.head(h, None)
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        self.compile_s = time.perf_counter() - t0
        return self.compile_s


# ---- where it runs, and the fallback ----------------------------------------------------------------
_FAMILIES = FAMILIES   # one list for the simulator (pipeline/fusion.decode_fused) and the executor


def unavailable(adapter) -> str | None:
    """Why the fused pieces cannot run for `adapter`'s model and device, or None when they can."""
    if adapter.family not in _FAMILIES:
        return f"the {adapter.family} family has no fused form (supported: {', '.join(_FAMILIES)})"
    act = getattr(adapter.model.config, "hidden_act", None)
    if act not in _ACTS:
        return f"hidden_act {act!r} has no fused form (supported: {', '.join(_ACTS)})"
    if adapter.device.type != "cuda":
        return "fused decode runs in replayed CUDA decode steps only"
    from torch.utils._triton import has_triton
    if not has_triton():
        return "no working Triton for torch.compile on this GPU"
    return None


def make_fused(adapter, mode: str) -> tuple[FusedDecode | None, str | None]:
    """The fused pieces for a replayed decode under setting `mode` (pipeline/fusion.MODES), or
    (None, why) where they cannot run: `on` then raises a ValueError, `auto` runs unfused."""
    if mode == "off":
        return None, None
    why = unavailable(adapter)
    if why is None:
        return FusedDecode(adapter), None
    if mode == "on":
        raise ValueError(f"fuse: on cannot run here: {why}")
    return None, f"fuse: auto runs decode unfused: {why}"


def warm_or_fall_back(fused: FusedDecode, mode: str, positions: torch.Tensor) -> tuple[float, str | None]:
    """Compile and warm `fused` (FusedDecode.warm) -> (seconds, None). A compile that fails under
    `auto` -> (seconds spent, one line saying decode runs unfused): the caller drops the fused
    pieces, so the answer is HF's modules', never a half-compiled step. Under `on` the failure is a
    ValueError. A CUDA out-of-memory is not a compile failure: it propagates."""
    t0 = time.perf_counter()
    try:
        return fused.warm(positions), None
    except torch.OutOfMemoryError:
        raise
    except Exception as e:   # inductor/Triton: compiler missing, codegen or Triton compile errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        what = f"{type(e).__name__}: {first}"[:300]
        if mode == "on":
            raise ValueError(f"fuse: torch.compile of the fused decode pieces failed ({what})") from None
        note = f"fuse: torch.compile of the fused decode pieces failed ({what}); decode runs unfused"
        return time.perf_counter() - t0, note
