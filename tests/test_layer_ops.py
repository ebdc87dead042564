"""pipeline/layer_ops.py (the simulator's count of small kernels and their bytes per stage) against
the aten ops that real HF modules and the executor's attention dispatch on CPU, counted by
executor/calibrate/op_inventory.py. Faults caught: a form that misses or invents a kernel (a norm's casts,
RoPE's rotate_half, q's contiguous copy, the LSE merge), bytes off by a factor (dtype size, fp32
intermediates, head counts, GQA repeat), a form that does not follow Qwen3's q/k norms or fp32
models, Gemma's (1 + w) norms, its extra norms and scaled embedding, Gemma 2's final logit
softcap, Phi-3's RoPE cat, and a transformers upgrade that changes HF's op sequence (the count then differs). The
fused decode forms are held against the kernels inductor emits for executor/layers/fused.py's functions."""
from __future__ import annotations

import functools
import shutil
from dataclasses import replace

import pytest
import torch

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.loader import random_model
from kvpipe.executor.calibrate.op_inventory import record, tensor_bytes
from kvpipe.pipeline import layer_ops
from kvpipe.pipeline.model import load_model

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
           num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
           tie_word_embeddings=False)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# What each family adds to CFG (Gemma: (1 + w) norms around attention and MLP, the scaled embedding,
# Gemma 2's final logit softcap; Phi-3: RoPE's pass-through cat; Qwen3: q/k norms)
FAMILY_CFG = {"llama": {}, "qwen3": {}, "mistral": {}, "qwen2": {}, "phi3": dict(pad_token_id=0),
              "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=12, layer_types=["full_attention"]),
              "gemma2": dict(sliding_window=4, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                             final_logit_softcapping=3.0)}


@functools.lru_cache(maxsize=None)   # one model per (family, dtype) for the whole module
def _setup(model_type: str, dtype: str):
    model = random_model(dict(CFG, model_type=model_type, **FAMILY_CFG[model_type]), "cpu", DTYPES[dtype], 0)
    a = HFAdapter(model)
    return a, a.spec()


def _check(form, inv, extra_kernels: int = 0, extra_bytes: int = 0) -> None:
    assert (form.kernels, form.bytes) == (inv.kernels - extra_kernels, inv.bytes - extra_bytes), inv.small


@pytest.mark.parametrize("model_type,dtype", [("llama", "bf16"), ("llama", "fp32"), ("qwen3", "bf16"), ("mistral", "bf16"),
                                              ("qwen2", "bf16"), ("phi3", "bf16"), ("gemma2", "bf16"),
                                              ("gemma3_text", "bf16"), ("gemma3_text", "fp32")])
@pytest.mark.parametrize("T", [1, 7])
def test_layer_forms_match_counted_hf_ops(model_type, dtype, T):
    a, m = _setup(model_type, dtype)
    ids = torch.randint(0, CFG["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    _check(layer_ops.embed(m, T), record(lambda: a.embed(ids, 3)))
    hidden, rope = a.embed(ids, 3)
    # qkv: the adapter's piece plus the interpreter's write home of the resident heads (copy_)
    res = 3
    home = torch.empty(1, m.kv_heads, T, 2, m.head_dim, dtype=DTYPES[dtype])

    def qkv():
        q, kv = a.qkv(0, hidden, rope)
        home[:, :res].copy_(kv[:, :res])
    _check(layer_ops.qkv(m, T, res), record(qkv))
    out = torch.randn(1, T, m.q_heads, m.head_dim, dtype=DTYPES[dtype])
    _check(layer_ops.mlp(m, T), record(lambda: a.mlp(0, hidden, out)))
    # head: the adapter's norm + lm_head + float, then argmax and the token written (interpreter)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    _check(layer_ops.head(m, 1), record(lambda: tokens.__setitem__((slice(None), 1), a.head(hidden).argmax(-1))))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("G,T,P", [(1, 5, 0), (2, 5, 0), (1, 5, 9), (2, 1, 9), (4, 6, 11)])
def test_attention_form_matches_counted_ops(dtype, G, T, P):
    a, m = _setup("llama", dtype)
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, m.q_heads, T, m.head_dim, generator=g).to(dt)
    kv = torch.randn(1, m.kv_heads, T, 2, m.head_dim, generator=g).to(dt)
    pre = torch.randn(1, m.kv_heads, P, 2, m.head_dim, generator=g).to(dt)
    out = torch.empty(1, T, m.q_heads, m.head_dim, dtype=dt)
    r = m.gqa_ratio
    qs = slice(0, G * r)

    def attn():   # the interpreter's _attn for group 0: attention, then the output copied in place
        o = a.attend(0, q[:, qs], pre[:, :G, :, 0], pre[:, :G, :, 1], kv[:, :G, :, 0], kv[:, :G, :, 1])
        out[:, :, qs] = o.transpose(1, 2)
    inv = record(attn)
    assert inv.attention == (2 if P else 1)
    # The CPU kernel returns its LSE as [B, T, H]: reshaping the prefix part's LSE copies it there
    # (one float32 value per query row and head); the CUDA kernels return [B, H, T] (a view).
    lse_copy = [b for name, b, _ in inv.small if name == "clone" and b == 4 * G * r * T]
    extra = (1, 2 * lse_copy[0]) if P and lse_copy else (0, 0)
    _check(layer_ops.attn(m, T, G, P), inv, *extra)


def test_tensor_bytes_counts_a_broadcast_once():
    """The recorder itself: a stride-0 (expanded) operand is read once, not per broadcast copy."""
    x = torch.zeros(3, 1, 5)
    assert tensor_bytes(x.expand(3, 7, 5)) == 3 * 5 * 4
    assert tensor_bytes(torch.zeros(0, 4)) == 0


def test_calibration_layer_replays_the_kernels_the_simulator_counts():
    """`kvpipe calibrate` times one layer's small kernels by running their recorded calls again
    (executor/calibrate.layer_small_ops, replayer). Faults caught: a replay that skips or adds
    kernels (the floor and rate would then be per the wrong count), and a calibration layer that
    is not the layer the simulator costs (qkv with every head resident + one group's attention
    over a prefix + mlp, as layer_ops counts them)."""
    from kvpipe.executor.calibrate.gpu import layer_small_ops, replayer
    a, m = _setup("llama", "bf16")
    T, P = 6, 9
    inv = layer_small_ops(a, T, P)
    again = record(replayer(inv))
    assert again.small == inv.small and again.gemms == again.attention == 0
    form = layer_ops.qkv(m, T, m.kv_heads) + layer_ops.attn(m, T, m.kv_heads, P) + layer_ops.mlp(m, T)
    lse_copy = [b for name, b, _ in inv.small if name == "clone" and b == 4 * m.q_heads * T]   # CPU only
    assert len(lse_copy) == 1
    _check(form, inv, 1, 2 * lse_copy[0])


# ---- fused decode (executor/layers/fused.py) ----------------------------------------------------------------
# Inductor on CPU does not fuse a row reduction's pointwise epilogue into the reduction (two loop
# nests); Triton does (one persistent-reduction kernel). So on CPU each norm emits one kernel more
# than the GPU form counts. `force_pointwise_cat` is the lowering CUDA uses for cat/stack (inductor
# uses ConcatKernel copies on CPU only); the fx graph cache is off so every call really compiles.
CPU_EXTRA = {"norm": 1, "add_norm": 1, "rope": -1, "act_mul": 0}   # rope: Triton 3 (H200), C++ 2
_CPU_OPTIONS = {"emulate_precision_casts": True, "force_pointwise_cat": True, "fx_graph_cache": False}


def _fused_args(name: str, m, dt):
    g = torch.Generator().manual_seed(5)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dt)
    D = m.head_dim
    return {"norm": lambda: (r(1, 1, m.hidden), r(m.hidden), 1e-5),
            "add_norm": lambda: (r(1, 1, m.hidden), r(1, 1, m.hidden), r(m.hidden), 1e-5),
            "rope": lambda: (r(1, 1, m.q_heads, D), r(1, 1, m.kv_heads, D), r(1, 1, m.kv_heads, D), r(1, 1, D),
                             r(1, 1, D), None),
            "act_mul": lambda: (r(1, 1, m.intermediate), r(1, 1, m.intermediate), "silu")}[name]()


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor on CPU compiles C++: no C++ compiler on this machine")
def test_fused_forms_match_the_kernels_inductor_emits(single_thread):
    """layer_ops' fused forms against executor/layers/fused.py's functions as inductor compiles them.
    Faults caught: a fused function that no longer compiles to the kernels the simulator counts (an
    op inductor cannot fuse, a graph break or an aten fallback adds kernels; a form that invents or
    misses one), and bytes off (dtype size, head counts, an input or output forgotten): a fused
    kernel reads each input once and writes each output once, measured here on the real tensors
    (rope's two kernels each read cos and sin)."""
    import torch._inductor.metrics as metrics

    from kvpipe.executor.layers import fused
    m = load_model("llama-3-8b")    # the real shapes: q and K/V of unequal sizes, as Triton sees them
    try:
        for name in layer_ops.FUSED_FUNCTIONS:
            args = _fused_args(name, m, torch.bfloat16)
            torch._dynamo.reset()
            metrics.reset()
            fn = torch.compile(fused._MATH[name], fullgraph=True, dynamic=False, options=_CPU_OPTIONS)
            with torch.inference_mode():
                out = fn(*args)
            form = layer_ops.fused_function(name, m, 1)
            assert metrics.generated_kernel_count == form.kernels + CPU_EXTRA[name], (name, metrics.generated_kernel_count)
            outs = out if isinstance(out, tuple) else (out,)
            moved = sum(tensor_bytes(t) for t in args if isinstance(t, torch.Tensor)) + sum(map(tensor_bytes, outs))
            if name == "rope":
                moved += tensor_bytes(args[3]) + tensor_bytes(args[4])
            assert form.bytes == moved, (name, form.bytes, moved)
    finally:
        torch._dynamo.reset()


def test_fused_decode_step_forms_sum_to_the_calls_the_executor_makes():
    """A fused decode step's stage forms (fused_qkv, fused_mlp per layer, fused_head) against the
    compiled calls FusedDecode's chain makes through every layer (recorded; uncompiled: the calls
    are the same). Faults caught: the deferred residual add mis-attributed (its bytes dropped or
    counted twice, its norm counted as an extra kernel), a stage form missing a call (rope, the
    act*up), or layer 0's and the head's norms counted unlike the executor runs them."""
    from kvpipe.executor.layers import fused
    L = 3
    model = random_model(dict(CFG, model_type="llama", num_hidden_layers=L), "cpu", torch.bfloat16, 0)
    a = HFAdapter(model)
    m = a.spec()
    f = fused.FusedDecode(a, compile=False)
    calls = []

    def spy(name, fn):
        def call(*args, **kw):
            calls.append((name, args[0].shape[:2].numel()))   # tokens [B, T] of the call
            return fn(*args, **kw)
        return call
    for name in layer_ops.FUSED_FUNCTIONS:
        setattr(f, name, spy(name, getattr(f, name)))
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.inference_mode():
        hidden, rope = a.embed(ids, 0, positions=torch.zeros(1, 1, dtype=torch.long))
        pending = None
        for layer in range(L):
            hidden, q, _ = f.qkv(layer, hidden, pending, rope)
            hidden, pending = f.mlp(layer, hidden, q.transpose(1, 2))
        f.head(hidden, pending)
    made = layer_ops.NONE
    for name, rows in calls:
        made = made + layer_ops.fused_function(name, m, rows)
    tail = layer_ops.head(m, 1)
    norm = layer_ops.rms_norm(1, m.hidden, m.dtype_bytes)
    step = layer_ops.NONE
    for _ in range(L):
        step = step + layer_ops.fused_qkv(m, 1, 0) + layer_ops.fused_mlp(m, 1)
    step = step + layer_ops.fused_head(m, 1)
    # the head's tail (cast, argmax, token) is not a compiled call; on CUDA the down projection
    # folds act(gate) * up into its loads (gemv_triton.gated_linear), here F.linear after act_mul
    act = layer_ops.fused_act_mul(m, 1)
    folded = (L * act.kernels, L * (act.bytes - 2 * m.dtype_bytes * m.intermediate))
    assert (step.kernels - (tail.kernels - norm.kernels), step.bytes - (tail.bytes - norm.bytes)) == \
        (made.kernels - folded[0], made.bytes - folded[1]), calls
    names = [c for c, _ in calls]   # layer 0 has no pending add; the head adds the last MLP's
    assert names.count("norm") == 1 and names.count("add_norm") == 2 * L and names.count("rope") == L


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_forms_match_the_triton_kernels(qk_norm):
    """On CUDA, the fused forms are Triton's own kernel count (no CPU correction; cat/stack lowered
    as CUDA lowers them). Faults caught: Triton splitting a function the form counts as fused
    (e.g. a norm's epilogue, rope's two outputs, Qwen3's q/k norms folded into rope, which is an
    assumption on CPU), and the bytes of the real tensors moved."""
    import torch._inductor.metrics as metrics

    from kvpipe.executor.layers import fused
    m = replace(load_model("llama-3-8b"), qk_norm=qk_norm)   # Llama-3-8B's shapes; Qwen3's q/k norms
    try:
        for name in layer_ops.FUSED_FUNCTIONS:
            args = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in _fused_args(name, m, torch.bfloat16))
            if name == "rope" and m.qk_norm:
                w = lambda: torch.randn(m.head_dim, device="cuda").to(torch.bfloat16)
                args = args[:5] + ((w(), 1e-6, w(), 1e-6),)
            torch._dynamo.reset()
            metrics.reset()
            fn = torch.compile(fused._MATH[name], fullgraph=True, dynamic=False,
                               options={"emulate_precision_casts": True, "fx_graph_cache": False})
            with torch.inference_mode():
                out = fn(*args)
            form = layer_ops.fused_function(name, m, 1)
            assert metrics.generated_kernel_count == form.kernels, (name, metrics.generated_kernel_count)
            outs = out if isinstance(out, tuple) else (out,)
            inputs = [t for t in args if isinstance(t, torch.Tensor)]
            if name == "rope" and args[5] is not None:        # Qwen3's q/k norm weights
                inputs += [t for t in args[5] if isinstance(t, torch.Tensor)]
            moved = sum(map(tensor_bytes, inputs)) + sum(map(tensor_bytes, outs))
            if name == "rope":
                moved += tensor_bytes(args[3]) + tensor_bytes(args[4])
            assert form.bytes == moved, (name, form.bytes, moved)
    finally:
        torch._dynamo.reset()
