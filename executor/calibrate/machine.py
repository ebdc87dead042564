"""`kvpipe calibrate`: measure this machine and write a hardware profile whose numbers are
measurements — GEMM rate at the graph's shapes, small-kernel floor and elementwise rate of one
decoder layer's non-GEMM ops, HBM copy rate and kernel launch cost (calibrate/gpu.py), attention
rate per kernel (calibrate/attention.py), pinned H2D/D2H as alpha + bytes/beta and O_DIRECT disk
read/write (calibrate/links.py), the executor's host issue costs (calibrate/host_issue.py), and the
codecs of the h2d and disk links on random-weight K/V (calibrate/codecs.py); then, after a clock
warm-up, the rates at the run's shapes (`run_shape_steps`: the prefill stages timed in a run's
sequence at the planner's chunks and the prefixes real plans reach, giving the stages' GEMM rates
and the prefill attention grid; the decode GEMMs, the LOSSY quantise and sparse score). Timings are CUDA
events around the region, medians of repeats, after a warm-up. Datasheet peaks (which no
measurement gives) come from a base profile and are labelled so."""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch

from kvpipe.pipeline.calibration import Calibration
from kvpipe.pipeline.hardware import HardwareProfile

from kvpipe.executor.calibrate.attention import attention, decode_attention
from kvpipe.executor.calibrate.gpu import gemm, hbm, launch, small_kernels
from kvpipe.executor.calibrate.host_issue import host_issue, host_spread, host_stage_costs
from kvpipe.executor.calibrate.links import disk, link_series, links


def link_codecs(cal: Calibration, quick: bool, tokens: int = 32768) -> None:
    """The codecs on the K/V of a prefill of `tokens` random ids through two random-weight
    Llama-3-8B-shaped layers (executor/calibrate/codecs.py): the disk link's CPU codec
    ([codec.zstd-planes], host.cpu_codec_bytes_per_s) and the h2d link's GPU codec
    ([codec.nvcomp-ans-planes]: per-call cost and rate of encode and decode on batches of the
    executor's blocks, the byte-plane kernels, whether a decode waits for in-flight H2D copies).
    Each is optional: a failure (no zstandard, no nvCOMP) leaves its table out and says so."""
    from kvpipe.pipeline.codecs import H2D_BLOCK_TOKENS

    from kvpipe.executor.calibrate import codecs
    from kvpipe.executor.kv.layout import DiskOptions
    from kvpipe.pipeline.disk_rows import MAX_BLOCK
    made: list[torch.Tensor] = []

    def kv() -> torch.Tensor:                    # [units, tokens, 2, D] bf16, made once (a failure: each step says so)
        if not made:
            made.append(codecs.llama_kv(tokens, "cuda"))
        return made[0]
    what = f"the K/V of a {tokens}-token prefill through 2 random-weight Llama-3-8B-shaped layers"
    _optional(cal, "codec.zstd-planes", lambda c: codecs.cpu_codec(c, kv(), DiskOptions().threads, MAX_BLOCK, what,
                                                                   (64 if quick else 256) << 20))
    _optional(cal, "codec.nvcomp-ans-planes", lambda c: gpu_codec(c, kv(), H2D_BLOCK_TOKENS, what))
    made.clear()
    torch.cuda.empty_cache()


def gpu_codec(cal: Calibration, kv: torch.Tensor, block_tokens: int, what: str) -> None:
    """[codec.nvcomp-ans-planes] as executor/codecs/h2d_store.py runs it (nvCOMP on the gpu lane's stream)."""
    from kvpipe.executor.calibrate import codecs
    from kvpipe.executor.codecs.nvcomp_ans_planes import AnsBlocks
    try:
        import nvidia.nvcomp  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"nvCOMP does not import ({e})") from None
    name = "codec.nvcomp-ans-planes"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())      # the prefill that made `kv`
    with torch.cuda.stream(stream):
        blocks = codecs.kv_blocks(kv, block_tokens)
        ans = AnsBlocks(torch.device("cuda", torch.cuda.current_device()), stream, blocks[0].numel())
        try:
            points, ratio, (kept, decode, planes) = codecs.gpu_codec_points(blocks, ans, codecs.queued_timer(stream))
            codecs.set_gpu_codec(cal, "nvcomp-ans-planes", points, ratio, block_tokens, what)
            idle = next(p["decode_host_s"] for p in points if p["blocks"] == kept)
            try:   # the rates stand without it: a failed probe leaves only the wait flag out
                probe = codecs.decode_waits_for_h2d(decode, planes, stream, idle)
            except Exception as e:   # noqa: BLE001 - recorded and said, as _optional does for a table
                probe = {"waits": None, "error": f"{type(e).__name__}: {e}"}
        finally:
            ans.close()
    cal.extra[name + ".waits_probe"] = probe
    if probe["waits"] is None:
        print("kvpipe: calibrate: whether an nvCOMP decode waits for in-flight H2D copies is undecided "
              "(see the JSON record); the profile leaves it out", file=sys.stderr)
        return
    ms = ", ".join(f"{r['decode_end_ms']:.1f}" for r in probe["rows"])
    copy = ", ".join(f"{r['decode_copy_end_ms']:.1f}" for r in probe["rows"])
    host = ", ".join(f"{r['decode_host_ms']:.1f}" for r in probe["rows"])
    cal.set(name + ".decompress_waits_h2d", probe["waits"],
            f"a decode of {kept} blocks issued on the codec's stream just after a "
            f"{probe['copy_bytes'] >> 20} MiB pinned H2D copy on another stream ended at {ms} ms, the copy at {copy} ms "
            f"(host ms in the call: {host}; {probe['idle_host_ms']:.2f} with no copy in flight; torch kernels in "
            "the same place ended before the copy: they overlap)")


def _optional(cal: Calibration, what: str, step) -> None:
    """Run a step whose table the profile can do without (the planner then never picks it): a
    failure is recorded in the JSON record and printed, and the calibration goes on."""
    try:
        step(cal)
    except Exception as e:   # noqa: BLE001 - any failure leaves the table out, said so
        for key in [k for k in cal.values if k.startswith(what + ".")]:   # no half-written table
            del cal.values[key], cal.notes[key]
        cal.extra[what] = f"not measured: {type(e).__name__}: {e}"
        print(f"kvpipe: calibrate: {what} not measured ({type(e).__name__}: {e}); the profile has no such table",
              file=sys.stderr)

def run_shape_steps(cal: Calibration, dev: torch.device, base: HardwareProfile, dims: dict | None = None,
                    grids: dict | None = None, chunks=None) -> list:
    """The steps that measure at the run's shapes after the run's warm-up (executor/calibrate/run_shapes.py,
    prefill_stages.py, gemm_shapes.py, lossy.py): the clock warm-up, the prefill stages timed in a
    run's sequence at the planner's chunks, groups and the prefixes real plans reach (the GEMM rate
    and half, [gpu.stage_gemm], [gpu.attention_rates]; attention_efficiency becomes the grids'
    fastest rate over the GEMM rate: the estimate's bound), the decode step's one-row GEMMs, the
    quantise and the sparse score (each optional). `base` supplies what no step before measured;
    `dims`, `grids` (d, rows, keys, groups), `chunks`: smaller shapes for a CPU check (default:
    Llama-3-8B, pipeline/run_rates.py's grids)."""
    from kvpipe.pipeline.run_rates import CALIBRATE_CHUNKS, OWN_GROUPS, PREFIX_KEYS, PREFIX_ROWS

    from kvpipe.executor.calibrate import gemm_shapes, lossy, prefill_stages, run_shapes
    dims = dims or gemm_shapes.llama_dims()
    chunks = chunks or CALIBRATE_CHUNKS
    g = {"d": 128, "rows": PREFIX_ROWS, "keys": PREFIX_KEYS, "groups": OWN_GROUPS, **(grids or {})}
    quant_chunks = tuple(c for c in (2048, 8192, 32768) if c <= max(chunks)) or tuple(chunks)
    steps = [("clock warm-up", lambda: run_shapes.warm_clock(cal, dev)),
             ("prefill stages in sequence", lambda: prefill_stages.measure(cal, dev, base, dims, g["d"], g["groups"],
                                                                          chunks, g["rows"], g["keys"])),
             ("decode GEMMs", lambda: gemm_shapes.decode_gemms(cal, dev, dims)),
             ("LOSSY quantise", lambda: _optional(cal, "gpu.quant", lambda c: lossy.quant(c, dev, quant_chunks))),
             ("LOSSY sparse score", lambda: _optional(cal, "gpu.sparse_score", lambda c: lossy.sparse_score(c, dev))),
             ("LOSSY sparse gather", lambda: _optional(cal, "link.gather", lambda c: lossy.gather(c, dev)))]
    if dev.type != "cuda":   # the UVA gather needs a GPU view of pinned memory
        steps = steps[:-1]
    return steps


def _driver_version() -> str:
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0] if out else f"unknown (CUDA runtime {torch.version.cuda})"


def calibrate(base: HardwareProfile, name: str, kv_dir: str | None = None, quick: bool = False,
              progress=print) -> Calibration:
    """Measure this machine (CUDA required). `base` supplies only the datasheet peaks."""
    if not torch.cuda.is_available():
        raise ValueError("calibrate: needs a CUDA GPU (torch.cuda.is_available() is False)")
    kv_dir = kv_dir or tempfile.gettempdir()
    props = torch.cuda.get_device_properties(0)
    driver = _driver_version()
    source = (f"kvpipe calibrate{' --quick' if quick else ''} on {props.name}, CUDA driver {driver}, "
              f"torch {torch.__version__}, {datetime.date.today().isoformat()}")
    free_host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cal = Calibration(name, f"{props.name} (calibrated; datasheet peaks from profile {base.name})", source)
    cal.set("gpu.mem_bytes", torch.cuda.mem_get_info()[1], "cudaMemGetInfo total")
    cal.set("host.mem_bytes", free_host, "physical RAM (sysconf)")
    steps = [("HBM copy", lambda: hbm(cal)), ("kernel launch", lambda: launch(cal)),
             ("small kernels", lambda: small_kernels(cal))]
    eff = {}
    steps.append(("GEMM", lambda: eff.setdefault("bf16", gemm(cal, quick))))
    steps.append(("attention", lambda: attention(cal, eff["bf16"], quick)))
    steps.append(("decode attention", lambda: decode_attention(cal)))
    steps.append(("PCIe links", lambda: links(cal, quick)))
    steps.append(("PCIe back-to-back", lambda: link_series(cal)))
    steps.append(("disk", lambda: disk(cal, kv_dir, quick)))
    steps.append(("host issue", lambda: host_issue(cal)))
    steps.append(("host issue per stage", lambda: host_stage_costs(cal)))
    steps.append(("host issue spread", lambda: host_spread(cal)))
    steps += run_shape_steps(cal, torch.device("cuda", torch.cuda.current_device()), base)
    steps.append(("codecs", lambda: link_codecs(cal, quick)))
    for i, (label, step) in enumerate(steps, 1):
        t0 = time.perf_counter()
        step()
        progress(f"calibrate [{i}/{len(steps)}] {label}: {time.perf_counter() - t0:.1f} s")
    peak_hbm = max(base.hbm_peak_bytes_per_s, cal.values["gpu.hbm_eff_bytes_per_s"])
    cal.set("gpu.hbm_peak_bytes_per_s", peak_hbm, f"datasheet peak, from profile {base.name}", measured=False)
    for dtype in ("bf16", "fp16", "fp32"):
        key = f"gpu.compute.{dtype}.effective_flops_per_s"
        cal.set(f"gpu.compute.{dtype}.peak_flops_per_s", max(base.flops_peak(dtype), cal.values[key]),
                f"datasheet peak, from profile {base.name}", measured=False)
    if "host.cpu_codec_bytes_per_s" not in cal.values:   # the CPU codec step failed (said so)
        cal.set("host.cpu_codec_bytes_per_s", base.cpu_codec_bytes_per_s,
                f"the CPU codec step failed (see the JSON record); from profile {base.name}", measured=False)
    cal.set("gpu.launch_queue_ops", base.launch_queue_ops, f"assumption carried from profile {base.name}",
            measured=False)
    return cal
