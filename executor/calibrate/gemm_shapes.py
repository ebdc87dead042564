"""`kvpipe calibrate`'s decode GEMM rate: a decode step's one-row GEMMs replayed in a CUDA graph
over several layers' weights (gpu.decode_gemm_bytes_per_s), after the clock warm-up of
executor/calibrate/run_shapes.py. The prefill stages' GEMM rates are fitted on stages timed in a
run's sequence (executor/calibrate/prefill_stages.py)."""
from __future__ import annotations

import torch

from kvpipe.pipeline.calibration import Calibration

from kvpipe.executor.calibrate.run_shapes import back_to_back_s, stage_gemms
from kvpipe.executor.calibrate.timing import graph_median_s


def llama_dims(model=None) -> dict:
    """The GEMM dims of `model` (a pipeline ModelSpec; default Llama-3-8B)."""
    if model is None:
        from kvpipe.pipeline.model import load_model
        model = load_model("llama-3-8b")
    return {"hidden": model.hidden, "inner": model.intermediate, "q_dim": model.q_heads * model.head_dim,
            "kv_dim": model.kv_heads * model.head_dim}


def hidden_str(dims: dict) -> str:
    return f"hidden {dims['hidden']}, intermediate {dims['inner']}, q {dims['q_dim']}, kv {dims['kv_dim']}"


def decode_gemms(cal: Calibration, dev: torch.device, dims: dict, layers: int = 4) -> float:
    """A decode step's GEMMs at one token (the 4 of a layer as the fused step runs them: q/k/v one,
    o, gate/up one, down) over `layers` layers' own weights (a step's weights never sit in L2),
    replayed from a CUDA graph as a replayed step runs them (the host clock, eagerly, on a CPU);
    weight bytes read per second, less the graph's node time."""
    stages = [stage_gemms(dev, 1, dims["hidden"], dims["inner"], dims["q_dim"], dims["kv_dim"],
                          torch.bfloat16 if dev.type == "cuda" else torch.float32, fused=True) for _ in range(layers)]
    nbytes = sum(b for _, _, b in stages)

    def step() -> None:
        for (qkv, _), (mlp, _), _ in stages:
            qkv()
            mlp()
    if dev.type == "cuda":
        sec = graph_median_s(step, 5)
        node = cal.values.get("gpu.graph_node_s", 0.0)
        sec = max(sec - 4 * layers * node, sec / 2)
    else:
        sec = back_to_back_s(step, dev)
    rate = nbytes / sec
    cal.set("gpu.decode_gemm_bytes_per_s", rate,
            f"the 4 one-token GEMMs of each of {layers} layers as the fused decode runs them (q/k/v one, o, gate/up "
            f"one, down; {hidden_str(dims)}; {nbytes / 1e9:.2f} GB of weights) in one CUDA graph, median of 5 "
            f"replays less {4 * layers} graph nodes, weight bytes per second")
    return rate
