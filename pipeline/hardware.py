"""One machine as the simulator sees it: GPU compute and memory rates, host link, host RAM, disk
and CPU codec throughput, in SI units; the numbers live in `hw_profiles/*.toml`."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .profile_parts import (DTYPES, CodecRates, DecodeAttention, FlopsTable, HardwareFieldError,  # noqa: F401
                            flops_table, number)
from .run_rates import AttentionRates, StageGemmRates
# The host's issue figures (seconds of host time per stage, launch, copy call, replayed step or
# attention plan), which `at_quantile` scales by the run-to-run spread.
HOST_ISSUE_FIELDS = ("host_issue_s_per_stage", "host_issue_s_per_op", "graph_replay_s", "attention_plan_s",
                     "host_copy_s_per_stage", "host_copy_s_per_op", "host_prefill_issue_s_per_stage",
                     "host_prefill_issue_s_per_launch", "host_prefill_issue_gap_s")
QUANTILES = ("p50", "p90")   # the runs a plan is ranked on: a median one, or a slow (90th percentile) one
_INT_FIELDS = ("gpu_mem_bytes", "host_mem_bytes", "disk_bytes")
_RATE_FIELDS = ("hbm_peak_bytes_per_s", "hbm_eff_bytes_per_s", "h2d_bytes_per_s",
                "d2h_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s",
                "cpu_codec_bytes_per_s")
# Fixed costs: zero means "none", so >= 0 is allowed.
_OVERHEAD_FIELDS = ("small_shape_half_flops", "launch_overhead_s", "attention_plan_s", "h2d_alpha_s",
                    "d2h_alpha_s", "disk_alpha_s", "host_issue_s_per_stage", "host_issue_s_per_op",
                    "graph_replay_s", "graph_node_s", "launch_queue_ops", "small_kernel_s")

@dataclass(frozen=True)
class HardwareProfile:
    """A GPU machine: datasheet peaks beside effective (reached) rates; SI units throughout.

    `flops_*_per_s` accept a mapping dtype -> FLOP/s and are stored as a sorted tuple of pairs,
    so the profile stays hashable; read them with `flops_eff(dtype)` / `flops_peak(dtype)`.
    """

    name: str
    description: str
    gpu_mem_bytes: int
    hbm_peak_bytes_per_s: float
    hbm_eff_bytes_per_s: float
    flops_peak_per_s: FlopsTable
    flops_eff_per_s: FlopsTable
    small_shape_half_flops: float  # FLOPs per kernel at which it reaches half of flops_eff
    attention_efficiency: float    # fused attention's rate as a fraction of flops_eff (0 < x <= 1)
    launch_overhead_s: float       # fixed cost of one kernel launch
    attention_plan_s: float        # host seconds the first attention call at a new prefix length
                                   # spends building cuDNN's execution plan (the GPU stalls only when
                                   # its queue runs dry, pipeline/cost.host_issue_seconds); 0 without
    h2d_alpha_s: float             # fixed cost of one host -> device copy
    h2d_bytes_per_s: float
    d2h_alpha_s: float
    d2h_bytes_per_s: float
    pcie_duplex: bool              # H2D and D2H copies overlap (two copy engines)
    host_mem_bytes: int
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_alpha_s: float            # fixed cost of one disk request
    disk_bytes: int
    cpu_codec_bytes_per_s: float   # throughput of the CPU codec thread pool
    host_issue_s_per_stage: float  # host seconds to issue one stage eagerly (events, actor turn) ...
    host_issue_s_per_op: float     # ... plus this per kernel launch or copy call it makes (Stage.ops)
    graph_replay_s: float          # host seconds per replayed decode step (buffer refresh + launch)
    graph_node_s: float            # GPU seconds per kernel inside a replayed graph (replaces launch_overhead_s)
    launch_queue_ops: float        # launches the host may have in flight before issuing blocks
    codecs: tuple[CodecRates, ...] = ()   # per codec rates and ratio ([codec.<name>] tables)
    # The small kernels of a stage (norms, RoPE, activations, residual adds, casts, copies; counted
    # by pipeline/layer_ops.py): each takes at least `small_kernel_s` of GPU time (one token's
    # kernel; 0 = no floor), their bytes stream at `elementwise_efficiency` x hbm_eff_bytes_per_s.
    # The defaults (free floor, copy rate) serve synthetic profiles; bundled ones state theirs.
    small_kernel_s: float = 0.0
    elementwise_efficiency: float = 1.0
    # The replayed decode attention call per group size ([gpu.decode_attention.g<G>]); empty: the
    # roofline (KV bytes at hbm_eff_bytes_per_s plus launches) stands in.
    decode_attention: tuple[DecodeAttention, ...] = ()
    # Host seconds to issue a copy stage (h2d / d2h): per stage plus per copy call. A copy call is
    # far cheaper to issue than a compute stage's launches (which bring their small kernels);
    # None: the compute figures above stand in.
    host_copy_s_per_stage: float | None = None
    host_copy_s_per_op: float | None = None
    # Host seconds to issue a PREFILL compute stage: per stage plus per kernel launch (Stage.ops +
    # Stage.small_ops), fitted by `kvpipe calibrate` on prefill stages alone
    # (pipeline/calibration.compute_issue_fit); and the host seconds between two prefill stage
    # issues (actor turn, stream-event waits), charged to every prefill stage. None: the
    # host_issue_s_* pair above stands in, with no gap.
    host_prefill_issue_s_per_stage: float | None = None
    host_prefill_issue_s_per_launch: float | None = None
    host_prefill_issue_gap_s: float | None = None
    # Host seconds to compile the fused decode pieces (executor/layers/fused.py) once per process; a
    # one-time cost the prediction reports beside total_s. None: the profile does not say.
    compile_s: float | None = None
    # LOSSY sparse decode's score stage (executor/sparse/rank_triton.py ranking + selection over the
    # sealed tokens' packed sketch codes), measured whole as `call_s + code bytes / bytes_per_s`
    # (benchmarks/sparse_score.py). None: the stage is costed from its bytes at the
    # decode-attention rate (9x too fast on the H200: 0.056 ms predicted, 0.558 measured at 128K).
    sparse_score_call_s: float | None = None
    sparse_score_bytes_per_s: float | None = None
    # The host's issue speed varies from run to run on a shared machine: the 90th percentile of a
    # run's host issue times as a multiple of the figures above, which are a median run's (1: no
    # spread known). Plans are ranked at that percentile (`at_quantile`): a plan that is fast
    # only on a good run is exposed to it.
    host_issue_p90: float = 1.0
    # Several GPUs of one host ([multi_gpu], sim/multi.py): the host memory bandwidth every link's
    # copies share (None: links independent); one collective on the GPU-to-GPU link costs
    # `peer_alpha_s + bytes / peer_bytes_per_s` (NCCL bus bandwidth; None: no figures, --gpus refused).
    host_mem_bytes_per_s: float | None = None
    peer_alpha_s: float | None = None
    peer_bytes_per_s: float | None = None
    # Measured at the run's shapes by `kvpipe calibrate` (None: the older single figures stand in):
    # the prefill attention calls' rates over call shapes ([gpu.attention_rates], pipeline/run_rates.py);
    # the weight bytes per second of a GEMM with a handful of rows (a decode step's qkv, mlp, head:
    # memory-bound, no small-shape half; replayed in a CUDA graph); the executor's quantise of the K/V
    # a step fills (LOSSY int8/int4) as `quant_call_s + (bytes read + written) / quant_bytes_per_s`.
    attention_rates: AttentionRates | None = None
    # The prefill qkv and mlp stages' GEMM rate and small-shape half each, fitted on stages timed
    # in a run's sequence ([gpu.stage_gemm], pipeline/stage_fit.py); None: the profile's one GEMM
    # rate and half cost both.
    stage_gemm: StageGemmRates | None = None
    decode_gemm_bytes_per_s: float | None = None
    quant_call_s: float | None = None
    quant_bytes_per_s: float | None = None
    # LOSSY sparse decode's gather of the selected rows from pinned host homes (executor/sparse/gather.py,
    # UVA index_select per unit): `gather_call_s + bytes / gather_bytes_per_s` per call; None: the
    # h2d copy figures stand in (a gather measured ~0.9x a bulk copy's rate on the H200).
    gather_call_s: float | None = None
    gather_bytes_per_s: float | None = None
    # fp16 tensor-core GEMMs that accumulate in fp16 (cuBLAS CUBLAS_COMPUTE_16F, what llama.cpp's
    # F16 matmuls use, sim/baselines.py): peak and effective FLOP/s. GeForce cards run them at twice
    # their fp32-accumulate rate (the `fp16` table's); None: the `fp16` rates stand in (workstation
    # and data-centre parts accumulate in fp32 at the full rate).
    fp16_acc16_peak_flops_per_s: float | None = None
    fp16_acc16_flops_per_s: float | None = None

    def __post_init__(self) -> None:
        for f in ("name", "description"):
            if not isinstance(getattr(self, f), str):
                raise HardwareFieldError(f, f"must be a string, got {getattr(self, f)!r}")
        if not self.name:
            raise HardwareFieldError("name", "must not be empty")
        for f in _INT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise HardwareFieldError(f, f"must be a positive integer, got {v!r}")
        for f in _RATE_FIELDS + _OVERHEAD_FIELDS:
            object.__setattr__(self, f, number(f, getattr(self, f), f in _OVERHEAD_FIELDS))
        eff = self.attention_efficiency
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise HardwareFieldError("attention_efficiency", f"must be a number in (0, 1], got {eff!r}")
        object.__setattr__(self, "attention_efficiency", float(eff))
        ew = self.elementwise_efficiency
        if isinstance(ew, bool) or not isinstance(ew, (int, float)) or not 0 < ew <= 1:
            raise HardwareFieldError("elementwise_efficiency", f"must be a number in (0, 1], got {ew!r}")
        object.__setattr__(self, "elementwise_efficiency", float(ew))
        spread = self.host_issue_p90
        if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not 1 <= spread < 100:
            raise HardwareFieldError("host_issue_p90", f"must be a number >= 1, got {spread!r}")
        object.__setattr__(self, "host_issue_p90", float(spread))
        for f in ("host_copy_s_per_stage", "host_copy_s_per_op", "compile_s", "sparse_score_call_s",
                  "sparse_score_bytes_per_s", "host_prefill_issue_s_per_stage", "host_prefill_issue_s_per_launch",
                  "host_prefill_issue_gap_s"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, number(f, getattr(self, f), f != "sparse_score_bytes_per_s"))
        for f in ("host_mem_bytes_per_s", "peer_alpha_s", "peer_bytes_per_s"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, number(f, getattr(self, f), f == "peer_alpha_s"))
        for f in ("decode_gemm_bytes_per_s", "quant_call_s", "quant_bytes_per_s", "gather_call_s", "gather_bytes_per_s"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, number(f, getattr(self, f), f in ("quant_call_s", "gather_call_s")))
        self._check_acc16()
        if (self.gather_call_s is None) != (self.gather_bytes_per_s is None):
            raise HardwareFieldError("gather_bytes_per_s", "gather_call_s and gather_bytes_per_s come together (one fit) "
                                     "or not at all")
        if (self.quant_call_s is None) != (self.quant_bytes_per_s is None):
            raise HardwareFieldError("quant_bytes_per_s", "quant_call_s and quant_bytes_per_s come together (one fit) "
                                     "or not at all")
        if self.attention_rates is not None and not isinstance(self.attention_rates, AttentionRates):
            raise HardwareFieldError("attention_rates", f"must be AttentionRates, got {self.attention_rates!r}")
        if self.stage_gemm is not None and not isinstance(self.stage_gemm, StageGemmRates):
            raise HardwareFieldError("stage_gemm", f"must be StageGemmRates, got {self.stage_gemm!r}")
        if (self.peer_alpha_s is None) != (self.peer_bytes_per_s is None):
            raise HardwareFieldError("peer_bytes_per_s", "peer_alpha_s and peer_bytes_per_s come together or not at all")
        if (self.sparse_score_call_s is None) != (self.sparse_score_bytes_per_s is None):
            raise HardwareFieldError("sparse_score_bytes_per_s", "sparse_score_call_s and sparse_score_bytes_per_s "
                                     "come together (both measured by benchmarks/sparse_score.py) or not at all")
        if (self.host_prefill_issue_s_per_stage is None) != (self.host_prefill_issue_s_per_launch is None):
            raise HardwareFieldError("host_prefill_issue_s_per_launch", "host_prefill_issue_s_per_stage and "
                                     "host_prefill_issue_s_per_launch come together (one fit) or not at all")
        table = tuple(sorted(self.decode_attention, key=lambda e: e.group))
        if any(not isinstance(e, DecodeAttention) for e in table):
            raise HardwareFieldError("decode_attention", "entries must be DecodeAttention")
        if len({e.group for e in table}) != len(table):
            raise HardwareFieldError("decode_attention", f"group sizes repeat: {[e.group for e in table]}")
        object.__setattr__(self, "decode_attention", table)
        if not isinstance(self.pcie_duplex, bool):
            raise HardwareFieldError("pcie_duplex", f"must be true or false, got {self.pcie_duplex!r}")
        for f in ("flops_peak_per_s", "flops_eff_per_s"):
            object.__setattr__(self, f, flops_table(f, getattr(self, f)))
        peak, eff = dict(self.flops_peak_per_s), dict(self.flops_eff_per_s)
        for dtype in sorted(set(peak) ^ set(eff)):
            side = "flops_eff_per_s" if dtype in peak else "flops_peak_per_s"
            raise HardwareFieldError(f"{side}.{dtype}", "is missing (peak and effective need "
                                                        "the same dtypes)")
        for dtype in peak:
            if eff[dtype] > peak[dtype]:
                raise HardwareFieldError(f"flops_eff_per_s.{dtype}", f"{eff[dtype]!r} exceeds "
                                         f"the peak {peak[dtype]!r}")
        if self.hbm_eff_bytes_per_s > self.hbm_peak_bytes_per_s:
            raise HardwareFieldError("hbm_eff_bytes_per_s", f"{self.hbm_eff_bytes_per_s!r} exceeds "
                                     f"the peak {self.hbm_peak_bytes_per_s!r}")

    def _check_acc16(self) -> None:
        peak, eff = self.fp16_acc16_peak_flops_per_s, self.fp16_acc16_flops_per_s
        if (peak is None) != (eff is None):
            raise HardwareFieldError("fp16_acc16_flops_per_s", "fp16_acc16_peak_flops_per_s and fp16_acc16_flops_per_s "
                                     "come together or not at all")
        if peak is None:
            return
        object.__setattr__(self, "fp16_acc16_peak_flops_per_s", number("fp16_acc16_peak_flops_per_s", peak, False))
        object.__setattr__(self, "fp16_acc16_flops_per_s", number("fp16_acc16_flops_per_s", eff, False))
        if self.fp16_acc16_flops_per_s > self.fp16_acc16_peak_flops_per_s:
            raise HardwareFieldError("fp16_acc16_flops_per_s", f"{eff!r} exceeds the peak {peak!r}")

    def at_quantile(self, quantile: str) -> HardwareProfile:
        """This machine on a run at `quantile` (QUANTILES) of the host's issue speed: every host
        issue figure scaled by its spread (p50: the profile as it is). Run time grows with the
        host's issue time, so a run's time at the host's p90 is the run's p90."""
        if quantile not in QUANTILES:
            raise ValueError(f"quantile: {quantile!r} is not one of {', '.join(QUANTILES)}")
        if quantile == "p50" or self.host_issue_p90 == 1.0:
            return self
        scaled = {f: getattr(self, f) * self.host_issue_p90 for f in HOST_ISSUE_FIELDS if getattr(self, f) is not None}
        return replace(self, **scaled)

    def decode_attention_seconds(self, group: int, kv_bytes: float) -> float | None:
        """GPU seconds of one replayed decode attention call of `group` KV heads reading `kv_bytes`
        of K/V, from the measured [gpu.decode_attention] table: the entry of that group size, else
        linear in the group size between the two measured sizes around it (the nearest one
        outside them); None when the profile has no table."""
        table = self.decode_attention
        if not table:
            return None
        if group <= table[0].group:
            return table[0].seconds(kv_bytes)
        if group >= table[-1].group:
            return table[-1].seconds(kv_bytes)
        hi = next(i for i, e in enumerate(table) if e.group >= group)
        a, b = table[hi - 1], table[hi]
        w = (group - a.group) / (b.group - a.group)
        return (1 - w) * a.seconds(kv_bytes) + w * b.seconds(kv_bytes)

    def codec(self, name: str) -> CodecRates:
        """Rates of codec `name` on this machine; ValueError naming the missing table."""
        for c in self.codecs:
            if c.name == name:
                return c
        raise HardwareFieldError(f"codec.{name}", f"is missing from profile {self.name!r} "
                                                  "(a plan uses it: add its rates and ratio)")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.flops_eff_per_s)

    def _lookup(self, table: FlopsTable, dtype: str) -> float:
        for d, v in table:
            if d == dtype:
                return v
        raise ValueError(f"hardware {self.name!r} has no compute rate for dtype {dtype!r} "
                         f"(has: {', '.join(self.dtypes)})")

    def flops_eff(self, dtype: str) -> float:
        """Effective (reached on large GEMMs) FLOP/s for `dtype`."""
        return self._lookup(self.flops_eff_per_s, dtype)

    def flops_peak(self, dtype: str) -> float:
        """Datasheet dense FLOP/s for `dtype`."""
        return self._lookup(self.flops_peak_per_s, dtype)

    def flops_rate(self, dtype: str, kernel_flops: float) -> float:
        """FLOP/s reached by one kernel of `kernel_flops`: eff * f / (f + small_shape_half_flops)."""
        if kernel_flops <= 0:
            raise ValueError(f"kernel_flops: must be > 0, got {kernel_flops!r}")
        return self.flops_eff(dtype) * kernel_flops / (kernel_flops + self.small_shape_half_flops)
