"""One benchmark process measuring many plans: the random-weight model is built once, then each
row (a plan on a workload) runs its prefill and decode steps as `kvpipe run` does (the untimed
warm-up, the allocator capped at the GPU budget, decode replay and fusion at run's defaults unless
the caller says otherwise) and comes back as measured seconds and memory, or as the error that
stopped it (an OOM included); the next row starts from a cleaned allocator.

    with Bench("llama-3-8b", "cuda", 24_000_000_000, max_context=131072) as bench:
        row = bench.row(plan, Workload(32768, 16, 1))   # Row: .json (dict), .last_logits

Used by benchmarks/planner_regret.py, regimes.py, sim_check.py --measure and fused_decode.py."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kvpipe.api import default_alloc_conf


def host_rss_peak_bytes() -> int | None:
    """This process's peak resident host memory (VmHWM: pinned KV, weights' host copies, CUDA
    context, Python) since the last `reset_host_rss_peak()`; None where /proc has no figure."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def child_pids() -> list[int]:
    """This process's child processes (Linux /proc; [] where it has none to read)."""
    kids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


def reset_host_rss_peak() -> None:
    """Start VmHWM again from the current resident size (Linux clear_refs 5); silent where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def process_mem_bytes() -> int | None:
    """This process's GPU memory as nvidia-smi reports it (context and library workspaces included)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, mib = (x.strip() for x in line.partition(","))
        if pid == str(os.getpid()) and mib.isdigit():
            return int(mib) * 2**20
    return None


@dataclass(frozen=True)
class Row:
    """One measured row. `json`: `measured` (prefill_s, decode_s_per_token, total_s, ttft_s,
    peak_gpu_bytes from the allocator, reserved_gpu_bytes, process_gpu_bytes from nvidia-smi),
    the run's decode issue mode, graphs, capture/compile seconds, `warmup_s`, `run_s` (one timed
    run's wall, buffers included; the mean over `repeats`), `samples` (each timed run's times and its cudaMalloc
    count `device_allocs`; `measured` holds their medians), `repeat_outputs_agree`, `loadavg_1m`, `child_processes`, `pinned_alloc_s` (time torch spent creating pinned blocks) and
    `wall_s`, and in every row `host_rss_peak_bytes` (the process's peak resident host memory
    over the row, VmHWM) and `torch_pinned_peak_bytes` (torch's pinned allocator, its cached
    blocks and slack included; None on CPU); or `error` (with `oom` true for an out-of-memory)
    when it did not run to the end."""

    json: dict
    last_logits: object = None   # [B, vocab] fp32 on the CPU when asked for, else None

    @property
    def ok(self) -> bool:
        return "error" not in self.json


@dataclass
class Bench:
    """The model, prompt and budgets of one measuring process; a context manager (builds on enter).
    `max_context`: the longest prompt any row uses (one random prompt, sliced per row)."""

    model: str
    device: str
    gpu_budget: int
    max_context: int
    seed: int = 0
    host_budget: int | None = None   # default: this machine's RAM, as `kvpipe run`
    spec: object = field(default=None, init=False)
    dev: object = field(default=None, init=False)     # torch.device
    cuda: bool = field(default=False, init=False)
    hf: object = field(default=None, init=False)
    ids: object = field(default=None, init=False)
    load_s: float = field(default=0.0, init=False)
    last_context: int | None = field(default=None, init=False)   # the previous row's (pinned blocks fit it)

    def __enter__(self) -> "Bench":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "Bench":
        default_alloc_conf()   # before torch starts CUDA; the user's own setting wins
        import torch

        from kvpipe.executor.engine import session
        from kvpipe.pipeline.model import load_model
        t0 = time.perf_counter()
        self.spec = load_model(self.model)
        self.dev = session.resolve_device(self.device)
        self.hf = session.load_hf_model(self.model, True, self.dev, session.TORCH_DTYPES[self.spec.dtype], self.seed)
        self.ids = session.prompt_tensor(None, 1, self.max_context, self.spec.vocab, self.seed)
        self.host_budget = self.host_budget or session.host_ram_bytes()
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(self.dev)
        self.load_s = time.perf_counter() - t0
        return self

    def close(self) -> None:
        self.hf = self.ids = None
        self._clean()
        if getattr(self, "cuda", False):   # the rows' allocator cap is process-wide: lift it, or later work runs capped
            import torch
            torch.cuda.set_per_process_memory_fraction(1.0, self.dev)

    @property
    def budgets(self) -> dict[str, int]:
        return {"gpu": self.gpu_budget, "host": self.host_budget, "disk": 0}

    def row(self, plan, work, replay: str = "auto", keep_logits: bool = False, fuse: str | None = None,
            repeats: int = 1) -> Row:
        """Measure `plan` on `work` (batch 1, context <= max_context). A plan over the budgets is
        refused without running, as `kvpipe run` refuses it; any error ends only this row. `fuse`:
        auto|on|off (None: run's default, KVPIPE_FUSE else auto). `repeats` timed runs after the
        one warm-up: `measured` holds each time's median over them, `samples` every run's times."""
        from kvpipe.pipeline.memory import breakdown
        from kvpipe.pipeline.report import budget_problems
        if work.context > self.max_context:
            raise ValueError(f"context: {work.context} exceeds the bench's max_context {self.max_context}")
        problems = budget_problems(breakdown(self.spec, work, plan), self.budgets)
        if problems:
            return Row({"error": "does not fit: " + "; ".join(problems), "oom": False})
        if self.last_context not in (None, work.context):
            self._release_pinned()   # another context: the cached blocks are the wrong sizes
        self.last_context = work.context
        reset_host_rss_peak()
        self._reset_host_peak()
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        try:
            info, logits = self._run(plan, work, replay, keep_logits, fuse, repeats)
        except Exception as e:   # one failed row must not lose the others
            info, logits = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                            "oom": type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e)}, None
        # outside the except block: the traceback's frames (and their tensors) are gone
        info["wall_s"] = time.perf_counter() - t0
        info["loadavg_1m"] = [load0, os.getloadavg()[0]]   # the host's load at the row's start and end
        info["child_processes"] = len(child_pids())       # e.g. a compile-worker pool left running
        info["host_rss_peak_bytes"] = host_rss_peak_bytes()
        info["torch_pinned_peak_bytes"] = self._pinned_bytes("peak")
        self._clean()
        return Row(info, logits)

    def _run(self, plan, work, replay: str, keep_logits: bool, fuse: str | None = None,
             repeats: int = 1) -> tuple[dict, object]:
        import statistics

        import torch

        from kvpipe.executor.engine import session
        from kvpipe.pipeline.builder import build
        from kvpipe.pipeline.report import timing_from_trace
        if repeats < 1:
            raise ValueError(f"repeats: {repeats} is not a positive count")
        graph, ids = build(self.spec, work, plan), self.ids[:, :work.context]
        alloc0 = self._pinned_alloc_s()
        t0 = time.perf_counter()
        if self.cuda:   # run_graph's own steps: cap, then the untimed warm-up
            # blocks the caller freed since the last row go back first: a CUDA graph capture cannot
            # release cached blocks to retry an allocation, so they would count against the cap
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(self.dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.gpu_budget / total), self.dev)
            session.warm_up(graph, self.hf, ids, self.dev, replay=replay, fuse=fuse)
        t1 = time.perf_counter()
        samples, digests = [], set()
        for _ in range(repeats):
            mallocs0 = self._device_allocs()
            m = session.run_graph(graph, self.hf, ids, self.dev, self.gpu_budget, progress=False, warmup=False,
                                  replay=replay, fuse=fuse)
            t = timing_from_trace(m.result.trace)
            digests.add(m.digest)
            mallocs1 = self._device_allocs()
            samples.append({"prefill_s": t.prefill_s, "decode_s_per_token": t.decode_s_per_token,
                            "total_s": t.total_s, "ttft_s": t.ttft_s,
                            "device_allocs": None if mallocs0 is None or mallocs1 is None else mallocs1 - mallocs0})
        t2 = time.perf_counter()
        r = m.result

        def med(key):
            vals = [s[key] for s in samples if s[key] is not None]
            return statistics.median(vals) if vals else None
        info = {"measured": {"prefill_s": med("prefill_s"), "decode_s_per_token": med("decode_s_per_token"),
                             "total_s": med("total_s"), "ttft_s": med("ttft_s"), "peak_gpu_bytes": r.peak_gpu_bytes,
                             "reserved_gpu_bytes": torch.cuda.max_memory_reserved(self.dev) if self.cuda else 0,
                             "process_gpu_bytes": process_mem_bytes() if self.cuda else None},
                "repeats": repeats, "samples": samples, "repeat_outputs_agree": len(digests) == 1,
                "decode_issue": r.decode_issue, "graphs": r.graphs, "capture_s": r.capture_s, "fused": r.fused,
                "compile_s": r.compile_s, "fuse_note": r.fuse_note, "warmup_s": t1 - t0, "run_s": (t2 - t1) / repeats,
                "pinned_alloc_s": None if alloc0 is None else self._pinned_alloc_s() - alloc0,
                "tokens": r.tokens[0].tolist(),
                "output_digest": m.digest}
        return info, (r.last_logits.detach().float().cpu().clone() if keep_logits else None)

    def _device_allocs(self) -> int | None:
        """cudaMalloc calls of the caching allocator so far (None on CPU or where torch has no count)."""
        if not self.cuda:
            return None
        import torch
        return torch.cuda.memory_stats(self.dev).get("num_device_alloc")

    def _host_stats(self) -> dict:
        """torch's pinned-host allocator statistics ({} on CPU, or where this torch has none)."""
        import torch
        stats = getattr(torch.cuda.memory, "host_memory_stats", None)
        return stats() if self.cuda and stats else {}

    def _pinned_bytes(self, which: str) -> int | None:
        """torch's pinned blocks, cached ones included: their `which` ("current" or "peak") bytes;
        torch 2.11 adds the "allocated_bytes" keys once a block was freed (until then active bytes
        are all it holds); None on CPU."""
        stats = self._host_stats()
        return stats.get(f"allocated_bytes.{which}", stats.get(f"active_bytes.{which}"))

    def _reset_host_peak(self) -> None:
        import torch
        reset = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
        if self.cuda and reset:
            reset()

    def _pinned_alloc_s(self) -> float | None:
        us = self._host_stats().get("host_alloc_time.total")
        return None if us is None else us / 1e6

    def _release_pinned(self) -> None:
        from kvpipe.executor.kv.pinned import release_cached_pinned
        if self.cuda:
            release_cached_pinned()

    def _clean(self) -> None:
        """Free what the last row left: Python garbage first (an exception's tensors), then the
        allocator's cached blocks. torch's cached pinned host blocks are kept for the next row of
        the same context to reuse (creating pinned memory is slow; the homes are carved from
        power-of-two blocks, executor/kv/pinned.carve: 34 GiB for 32 GiB of KV at 256K) unless they
        pass half the host budget; `pinned_alloc_s` shows what each row paid (torch-pinned homes
        only: replayed rows)."""
        gc.collect()
        if self.cuda:
            import torch
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.dev)
            if (self._pinned_bytes("current") or 0) > (self.host_budget or 0) / 2:
                self._release_pinned()


def note(name: str, row: Row) -> None:
    """One progress line on stderr: the row's times, or its error."""
    j = row.json
    if row.ok:
        m = j["measured"]
        dec = "-" if m["decode_s_per_token"] is None else f"{m['decode_s_per_token'] * 1e3:.2f} ms/token"
        print(f"{name}: prefill {m['prefill_s']:.3f} s, decode {dec} ({j['wall_s']:.1f} s wall, "
              f"warm-up {j['warmup_s']:.1f} s, pinned alloc {j['pinned_alloc_s'] or 0:.1f} s)", file=sys.stderr, flush=True)
    else:
        print(f"{name}: {j['error']}", file=sys.stderr, flush=True)
