"""One `kvpipe run` on the torch side: the device and its budgets, the model (local HF directory, or
random weights from a preset or config.json), the prompt, and the execution of the graph with the
allocator capped and a progress bar. The CLI refuses plans over budget before calling in here."""
from __future__ import annotations

import gc
import hashlib
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvpipe.pipeline.builder import build, step_count
from kvpipe.pipeline.plan import Method, Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.stage import Graph, Phase, Stage
from kvpipe.pipeline.workload import Workload

from kvpipe.executor.layers.attention import CUDNN_MIN_ROWS
from kvpipe.executor.kv.layout import DiskOptions
from kvpipe.executor.kv.pinned import release_cached_pinned
from kvpipe.executor.engine.runner import RunResult, execute

log = logging.getLogger("kvpipe")   # progress lines: printed by the CLI, quiet from Python

WARMUP_MAX_TOKENS = 8192   # the warm-up runs one prefill chunk, at most this long
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# CUDA device name fragment -> bundled hardware profile used for the prediction.
KNOWN_GPUS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g"), ("4090", "rtx4090"),
              ("4060", "rtx4060"))


def resolve_device(name: str | None) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, any case; None picks cuda when torch sees a GPU, else cpu."""
    if name is None:
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(name).strip().lower()
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "cpu") or (index and not (kind == "cuda" and index.isdigit())):
        raise ValueError(f"device: {name!r} is not cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but torch sees no CUDA GPU (use --device cpu)")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device: {name!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    if kind == "cpu":
        return torch.device("cpu")
    # the allocator cap needs an index
    return torch.device("cuda", int(index) if index else torch.cuda.current_device())


def h2d_codec_runs(device: torch.device, name: str = "nvcomp-ans-planes") -> bool:
    """Whether GPU codec `name` can run on the h2d link here (CUDA and nvCOMP)."""
    from kvpipe.executor.codecs.nvcomp_ans_planes import check_available
    try:
        check_available(name, device)
    except ValueError:
        return False
    return True


def check_codecs(codecs, device: torch.device) -> None:
    """The user's h2d codecs, refused (one line) before the prediction where this run cannot
    execute them (the profile may not rate them either)."""
    from kvpipe.executor.codecs.nvcomp_ans_planes import check_available
    for link, name in codecs:
        if link == "h2d" and name not in ("none", "auto"):
            check_available(name, device)


def check_runnable(plan: Plan, device: torch.device, spec=None) -> None:
    """Refuse (ValueError naming the field) a plan this executor cannot run here: sparse decode
    reads host-RAM units, quantised records go to disk as they are, an h2d codec needs its GPU
    implementation, and softcapped attention with offloaded units was not bit-exact on CUDA."""
    from kvpipe.executor.codecs.nvcomp_ans_planes import check_available
    if spec is not None and spec.softcap and device.type == "cuda" and plan.resident < spec.units:
        # the H200 saw offloaded != resident logits for a tiny Gemma 2 (the capped score GEMMs)
        raise ValueError("--resident: attention logit softcapping (Gemma 2) runs on CUDA with every unit "
                         "resident only (--resident all): offloaded, it is not yet bit-exact there")
    sp = plan.lossy
    if sp is not None and sp.sparse is not None and (plan.disk or plan.decode.codec("h2d") != "none"):
        raise ValueError("sparse: kvpipe run executes --sparse over host-RAM units: "
                         "not with disk units or an h2d codec")
    if sp is not None and any(p.codec("disk") != "none" for p in (plan.prefill, plan.decode)):
        raise ValueError("codec: a disk codec cannot run with --lossy (quantised records go to disk as they are)")
    if plan.decode.codec("h2d") != "none":
        check_available(plan.decode.codec("h2d"), device)


def guess_profile(device: torch.device) -> str | None:
    """The bundled profile of this GPU, by name; None when unknown (or on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((prof for frag, prof in KNOWN_GPUS if frag in name), None)


def device_budget(device: torch.device) -> int:
    """All memory of the GPU (what the allocator could take), or physical RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_ram_bytes()


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def has_weights(model_arg: str) -> bool:
    """A directory with safetensors files: `run` loads its weights (unless --random-weights)."""
    path = Path(model_arg)
    return path.is_dir() and any(path.glob("*.safetensors"))


def load_hf_model(model_arg: str, random_weights: bool, device: torch.device, dtype: torch.dtype,
                  seed: int) -> torch.nn.Module:
    """A local HF directory with safetensors, or random weights from a preset / config.json."""
    from kvpipe.pipeline.model import preset
    from kvpipe.executor.layers.loader import load_pretrained, random_model
    path = Path(model_arg)
    if has_weights(model_arg) and not random_weights:
        return load_pretrained(path, device, dtype)
    if not random_weights:
        where = "a preset" if preset(model_arg) else f"{model_arg!r}"
        raise ValueError(f"model: {where} has no weights here; pass --random-weights "
                         "(same shapes, same cost) or a local HF directory with safetensors")
    if preset(model_arg):
        config = preset_config(preset(model_arg))
    else:
        import json
        cfg_path = path / "config.json" if path.is_dir() else path
        config = json.loads(cfg_path.read_text())
    return random_model(config, device, dtype, seed)


def preset_config(spec) -> dict:
    """A Hugging Face config dict with the preset's shapes."""
    cfg = {"model_type": spec.family, "vocab_size": spec.vocab, "hidden_size": spec.hidden,
           "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
           "num_attention_heads": spec.q_heads, "num_key_value_heads": spec.kv_heads,
           "head_dim": spec.head_dim, "max_position_embeddings": 1 << 21, "rope_theta": 500000.0,
           "tie_word_embeddings": spec.tie_embeddings}
    if spec.family in ("mistral", "qwen2", "qwen3"):
        cfg["sliding_window"] = None
    if spec.family == "qwen2":
        cfg["use_sliding_window"] = False
    from kvpipe.pipeline.layer_kinds import hf_fields
    return {**cfg, **hf_fields(spec)}   # the family's layer kinds (windows, softcaps, rope)


def read_prompt(prompt_file: str | os.PathLike, model_arg: str, vocab: int) -> list[int]:
    """Token ids from a file of whitespace-separated ids, or of text tokenized with the model
    directory's tokenizer. Empty files, negative ids and ids past the vocabulary are refused."""
    try:
        text = Path(prompt_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"prompt-file: cannot read {str(prompt_file)!r} ({getattr(e, 'strerror', None) or e})") from None
    words = text.split()
    if not words:
        raise ValueError(f"prompt-file: {str(prompt_file)!r} is empty; give token ids or text")
    if all(w.lstrip("+-").isdigit() for w in words):
        ids = [int(w) for w in words]
        if min(ids) < 0:
            raise ValueError(f"prompt-file: token id {min(ids)} is negative; ids run from 0 to {vocab - 1}")
    else:
        d = Path(model_arg)
        if not (d.is_dir() and ((d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file())):
            raise ValueError("prompt-file: holds text, but the model has no tokenizer; give token ids")
        from transformers import AutoTokenizer
        ids = AutoTokenizer.from_pretrained(model_arg, local_files_only=True)(text)["input_ids"]
        if not ids:
            raise ValueError(f"prompt-file: {str(prompt_file)!r} tokenizes to no tokens")
    if max(ids) >= vocab:
        raise ValueError(f"prompt-file: token id {max(ids)} is outside the vocabulary (0 to {vocab - 1})")
    return ids


def prompt_tensor(ids: list[int] | None, batch: int, context: int, vocab: int, seed: int) -> torch.Tensor:
    """[batch, context] ids: `ids` (exactly `context` of them) repeated over the batch, or random
    from `seed` when None."""
    if ids is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, context), generator=gen)
    assert len(ids) == context, (len(ids), context)   # the caller sized the context from the prompt
    return torch.tensor(ids).expand(batch, context).contiguous()


@dataclass(frozen=True)
class Measured:
    result: RunResult
    digest: str


def output_digest(result: RunResult) -> str:
    """sha256 of the final logits' bytes and the generated ids: equal digests, equal bits."""
    h = hashlib.sha256()
    h.update(result.last_logits.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(result.tokens.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def warm_up(graph: Graph, hf_model: torch.nn.Module, ids: torch.Tensor, device: torch.device,
            replay: Replay | str = Replay.OFF, disk: DiskOptions | None = None, fuse: str | None = None) -> int:
    """Run the same plan, untimed, on the first prefill chunk and one decode step: CUDA context,
    cuBLAS/cuDNN handles, kernel loading and the chunk's own attention plan are paid here, not in
    the measurement (HF's baselines warm up the same way). Returns the tokens run.
    When the run's later chunks attend to a prefix with cuDNN, a second chunk of CUDNN_MIN_ROWS
    tokens follows the first: the first prefix attention of a process costs far more host time
    than the next ones, which a one-chunk warm-up would leave to the run's second chunk."""
    w, plan = graph.workload, graph.plan
    first = min(w.context, plan.prefill.chunk, WARMUP_MAX_TOKENS)  # `standard`'s chunk is the prompt
    prefixed = plan.method is not Method.STANDARD and plan.prefill.chunk >= CUDNN_MIN_ROWS
    context = first + (CUDNN_MIN_ROWS if prefixed and w.context - first >= CUDNN_MIN_ROWS else 0)
    small_plan = replace(plan, prefill=replace(plan.prefill, chunk=first))
    small = build(graph.model, Workload(context, 1, w.batch), small_plan)
    execute(small, hf_model, ids[:, :context], device, replay=replay, disk=disk, fuse=fuse)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the real run starts from the same allocator state as a cold one
    # The warm-up's garbage (torch.compile's graphs when it compiled the fused pieces: millions of
    # objects) is collected here, not by a full collection that would fall inside the timed run.
    gc.collect()
    return context


def executing(what: str, device) -> None:
    """The progress line before a run's first step (the `kvpipe` logger: the CLI prints it)."""
    log.info(f"executing {what} on {device} (Ctrl-C stops cleanly)")


def run_graph(graph: Graph, hf_model: torch.nn.Module, ids: torch.Tensor, device: torch.device,
              gpu_budget: int, progress: bool = True, warmup: bool = True, replay: Replay | str = Replay.OFF,
              kv_dir: str | None = None, fuse: str | None = None, decoding=None, more=None) -> Measured:
    """Execute with the GPU allocator capped at `gpu_budget` and a progress bar over steps (on
    CUDA after an untimed warm-up unless `warmup` is False); `replay`, `fuse`, `decoding` and
    `more` as in `runner.execute` (the warm-up decodes greedily)."""
    from kvpipe.executor.layers.adapter import HFAdapter
    HFAdapter(hf_model).check(graph.model, graph.workload.kv_capacity)   # refused before any work
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_budget / total), device)
        if warmup:
            n = warm_up(graph, hf_model, ids, device, replay=replay, disk=DiskOptions(kv_dir), fuse=fuse)
            # The warm-up's torch-pinned KV homes (replayed runs) stay in torch's host cache, pinned,
            # in blocks the run cannot reuse: given back first.
            release_cached_pinned()
            log.info(f"warmed up on {n} tokens and 1 decode step (untimed)")
    steps = step_count(graph.workload, graph.plan)
    last_layer = graph.model.layers - 1
    # Announced before the bar exists: a line printed after it would land on the bar's line and
    # be overwritten by its next refresh on a terminal.
    executing(f"{steps} steps" if decoding is None else f"up to {graph.workload.decode_tokens + 1} new tokens",
              device)   # a generation may stop early
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, unit="step", desc="prefill", leave=False, dynamic_ncols=True,
                   disable=not sys.stderr.isatty())

    def tick(s: Stage) -> None:
        if s.tag == "mlp" and s.layer == last_layer:
            bar.set_description("prefill" if s.phase is Phase.PREFILL else "decode")
            bar.update(1)

    try:
        result = execute(graph, hf_model, ids, device, stage_hook=tick if bar else None, replay=replay,
                         disk=DiskOptions(kv_dir), fuse=fuse, decoding=decoding, more=more)
    finally:
        if bar:
            bar.close()
    return Measured(result, output_digest(result))
