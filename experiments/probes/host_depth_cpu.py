"""Probe (CPU): does the executor's host cost per stage grow with the model's depth? Tiny Llama
models of 2, 8 and 32 layers (same widths), a headwise plan all resident and all offloaded, 512-token
prefill in 128-token chunks + 8 decode steps; wall per stage, best of 3 after a warm-up run. On CPU
the stages run synchronously and their compute is tiny, so the wall is mostly the host's issue work.
    python experiments/probes/host_depth_cpu.py"""
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload

torch.manual_seed(0)
for layers in (2, 8, 32):
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=8, num_hidden_layers=layers, max_position_embeddings=4096)
    m = LlamaForCausalLM(cfg).eval()
    spec = HFAdapter(m).spec()
    ids = torch.randint(0, 256, (1, 512))
    for res in (spec.units, 0):
        g = build(spec, Workload(512, 8, 1), Plan(Method.HEADWISE, PhasePlan(2, 128, 2), PhasePlan(2, 1, 2), res, 0))
        execute(g, m, ids)
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            execute(g, m, ids)
            walls.append(time.perf_counter() - t0)
        best = min(walls)
        print(f"layers {layers:2d} resident {res:3d}: stages {len(g.stages):5d}, wall {best * 1e3:7.1f} ms, "
              f"per stage {best / len(g.stages) * 1e6:6.1f} us")
