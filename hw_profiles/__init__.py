"""Loader of hardware profiles: a bundled `hw_profiles/<name>.toml` or a user's TOML file becomes a
`pipeline.hardware.HardwareProfile`; every error is one line naming the file, the field and value."""
from __future__ import annotations

import math
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

from kvpipe.pipeline.hardware import CodecRates, DecodeAttention, HardwareFieldError, HardwareProfile
from kvpipe.pipeline.run_rates import STAGE_GEMM_TAGS, AttentionRates, RateGrid, StageGemmRates

_HERE = Path(__file__).resolve().parent
# TOML key -> (HardwareProfile field, kind). The [gpu.compute.<dtype>] tables are read apart.
_FIELDS = {
    "name": ("name", str),
    "description": ("description", str),
    "gpu.mem_bytes": ("gpu_mem_bytes", int),
    "gpu.hbm_peak_bytes_per_s": ("hbm_peak_bytes_per_s", float),
    "gpu.hbm_eff_bytes_per_s": ("hbm_eff_bytes_per_s", float),
    "gpu.small_shape_half_flops": ("small_shape_half_flops", float),
    "gpu.launch_overhead_s": ("launch_overhead_s", float),
    "gpu.attention_efficiency": ("attention_efficiency", float),
    "gpu.attention_plan_s": ("attention_plan_s", float),
    "link.h2d_alpha_s": ("h2d_alpha_s", float),
    "link.h2d_bytes_per_s": ("h2d_bytes_per_s", float),
    "link.d2h_alpha_s": ("d2h_alpha_s", float),
    "link.d2h_bytes_per_s": ("d2h_bytes_per_s", float),
    "link.pcie_duplex": ("pcie_duplex", bool),
    "host.mem_bytes": ("host_mem_bytes", int),
    "host.cpu_codec_bytes_per_s": ("cpu_codec_bytes_per_s", float),
    "host.issue_s_per_stage": ("host_issue_s_per_stage", float),
    "host.issue_s_per_op": ("host_issue_s_per_op", float),
    "host.graph_replay_s": ("graph_replay_s", float),
    "gpu.graph_node_s": ("graph_node_s", float),
    "gpu.launch_queue_ops": ("launch_queue_ops", float),
    "gpu.small_kernel_s": ("small_kernel_s", float),
    "gpu.elementwise_efficiency": ("elementwise_efficiency", float),
    "disk.read_bytes_per_s": ("disk_read_bytes_per_s", float),
    "disk.write_bytes_per_s": ("disk_write_bytes_per_s", float),
    "disk.alpha_s": ("disk_alpha_s", float),
    "disk.bytes": ("disk_bytes", int),
}
_OPTIONAL = {   # TOML key -> HardwareProfile field: absent means the field's default
    "host.copy_s_per_stage": "host_copy_s_per_stage",
    "host.copy_s_per_op": "host_copy_s_per_op",
    "host.prefill_issue_s_per_stage": "host_prefill_issue_s_per_stage",
    "host.prefill_issue_s_per_launch": "host_prefill_issue_s_per_launch",
    "host.prefill_issue_gap_s": "host_prefill_issue_gap_s",
    "host.compile_s": "compile_s",
    "host.issue_p90": "host_issue_p90",
    "gpu.sparse_score_call_s": "sparse_score_call_s",
    "gpu.sparse_score_bytes_per_s": "sparse_score_bytes_per_s",
    "gpu.decode_gemm_bytes_per_s": "decode_gemm_bytes_per_s",
    "gpu.fp16_acc16_peak_flops_per_s": "fp16_acc16_peak_flops_per_s",
    "gpu.fp16_acc16_flops_per_s": "fp16_acc16_flops_per_s",
    "gpu.quant_call_s": "quant_call_s",
    "gpu.quant_bytes_per_s": "quant_bytes_per_s",
    "link.gather_call_s": "gather_call_s",
    "link.gather_bytes_per_s": "gather_bytes_per_s",
    "multi_gpu.host_mem_bytes_per_s": "host_mem_bytes_per_s",
    "multi_gpu.peer_alpha_s": "peer_alpha_s",
    "multi_gpu.peer_bytes_per_s": "peer_bytes_per_s",
}
# [gpu.attention_rates] (pipeline/run_rates.AttentionRates): each grid's two axes and its rates
_ATTENTION_RATES = {"prefix": ("prefix_rows", "prefix_keys", "prefix_flops_per_s"),
                    "own": ("own_groups", "own_chunks", "own_flops_per_s")}
# [gpu.stage_gemm] (pipeline/run_rates.StageGemmRates): a rate and a half per stage tag, and a dtype
_STAGE_GEMM = tuple(f"{tag}_{f}" for tag in STAGE_GEMM_TAGS for f in ("flops_per_s", "half_flops"))
_COMPUTE = {"peak_flops_per_s": "flops_peak_per_s", "effective_flops_per_s": "flops_eff_per_s"}
_CODEC = ("compress_bytes_per_s", "decompress_bytes_per_s", "ratio")   # [codec.<name>] fields
# optional [codec.<name>] fields (absent: CodecRates' defaults, as profiles written before them say)
_CODEC_OPTIONAL = {"compress_call_s": float, "decompress_call_s": float, "split_bytes_per_s": float,
                   "interleave_bytes_per_s": float, "decompress_waits_h2d": bool}


class ProfileError(ValueError):
    """A hardware profile that cannot be found, parsed or validated (one-line message)."""


def known_profiles() -> list[str]:
    """Sorted names of the bundled profiles (`hw_profiles/*.toml`)."""
    return sorted(p.stem for p in _HERE.glob("*.toml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A bundled profile by name, any case (`h200`, `H200`), or a user's TOML file by path
    (`./my-gpu.toml`)."""
    name = name_or_path.strip().lower()
    if name in known_profiles():
        return _load(_HERE / f"{name}.toml", f"{name}.toml")
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ProfileError(f"hw profile '{name_or_path}': file not found")
        return _load(path, name_or_path)
    raise ProfileError(f"unknown hardware '{name_or_path}' (known: {', '.join(known_profiles())}); "
                       f"or give a path to a .toml file")


def _load(path: Path, label: str) -> HardwareProfile:
    def fail(problem: str) -> ProfileError:
        return ProfileError(f"hw profile '{label}': {problem}".replace("\n", " "))

    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise fail(f"is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise fail(f"cannot read: {e}") from None
    flat = _flatten(doc)
    tabled = [k for k in flat if k.startswith(("gpu.compute.", "codec.", "gpu.decode_attention.", "gpu.attention_rates.",
                                            "gpu.stage_gemm."))]
    unknown = sorted(set(flat) - set(_FIELDS) - set(_OPTIONAL) - set(tabled))
    if unknown:
        raise fail(f"field '{unknown[0]}' is not a known field")
    kwargs: dict[str, object] = {}
    for key, (field, kind) in _FIELDS.items():
        if key not in flat:
            raise fail(f"field '{key}' is missing")
        try:
            kwargs[field] = _typed(flat[key], kind)
        except ValueError as e:
            raise fail(f"field '{key}' {e}") from None
    for key, field in _OPTIONAL.items():
        if key in flat:
            try:
                kwargs[field] = _typed(flat[key], float)
            except ValueError as e:
                raise fail(f"field '{key}' {e}") from None
    compute = _tables(flat, "gpu.compute", tuple(_COMPUTE), fail)
    if not compute:
        raise fail("field 'gpu.compute' is missing (e.g. [gpu.compute.bf16])")
    tables = {field: {dtype: rates[toml_name] for dtype, rates in compute.items()}
              for toml_name, field in _COMPUTE.items()}
    codecs = _tables(flat, "codec", _CODEC, fail, _CODEC_OPTIONAL)
    try:
        kwargs["codecs"] = tuple(CodecRates(n, **v) for n, v in codecs.items())
        kwargs["decode_attention"] = _decode_attention(flat, fail)
        if any(k.startswith("gpu.attention_rates.") for k in flat):
            kwargs["attention_rates"] = _attention_rates(flat, fail)
        if any(k.startswith("gpu.stage_gemm.") for k in flat):
            kwargs["stage_gemm"] = _stage_gemm(flat, fail)
        return HardwareProfile(**kwargs, **tables)
    except HardwareFieldError as e:
        raise fail(f"field '{_toml_key(e.field)}' {e.problem}") from None


def _decode_attention(flat: dict[str, object], fail) -> tuple:
    """The [gpu.decode_attention.g<G>] tables (call_s, bytes_per_s) as DecodeAttention entries."""
    out = []
    for name, v in _tables(flat, "gpu.decode_attention", ("call_s", "bytes_per_s"), fail).items():
        if not (name.startswith("g") and name[1:].isdigit() and int(name[1:]) > 0):
            raise fail(f"field 'gpu.decode_attention.{name}' is not a known field (expected g<KV heads per call>)")
        out.append(DecodeAttention(int(name[1:]), **v))
    return tuple(out)


def _attention_rates(flat: dict[str, object], fail) -> AttentionRates:
    """[gpu.attention_rates]: two grids (axes of integers, rates a list of rows of FLOP/s) and a dtype."""
    pre = "gpu.attention_rates."
    names = {f for axes in _ATTENTION_RATES.values() for f in axes} | {"dtype"}
    unknown = sorted(k for k in flat if k.startswith(pre) and k[len(pre):] not in names)
    if unknown:
        raise fail(f"field '{unknown[0]}' is not a known field")
    grids = {}
    for grid, (xs, ys, rates) in _ATTENTION_RATES.items():
        missing = [f for f in (xs, ys, rates) if pre + f not in flat]
        if missing:
            raise fail(f"field '{pre}{missing[0]}' is missing")
        try:
            grids[grid] = RateGrid(tuple(flat[pre + xs]), tuple(flat[pre + ys]),
                                   tuple(tuple(r) for r in flat[pre + rates]))
        except (TypeError, ValueError) as e:
            raise fail(f"field '{pre}{grid}' {e}") from None
    dtype = flat.get(pre + "dtype", "bf16")
    if not isinstance(dtype, str):
        raise fail(f"field '{pre}dtype' is not a string: {dtype!r}")
    return AttentionRates(grids["prefix"], grids["own"], dtype)


def _stage_gemm(flat: dict[str, object], fail) -> StageGemmRates:
    """[gpu.stage_gemm]: every stage tag's rate and half (numbers) and a dtype."""
    pre = "gpu.stage_gemm."
    unknown = sorted(k for k in flat if k.startswith(pre) and k[len(pre):] not in (*_STAGE_GEMM, "dtype"))
    if unknown:
        raise fail(f"field '{unknown[0]}' is not a known field")
    values = {}
    for f in _STAGE_GEMM:
        if pre + f not in flat:
            raise fail(f"field '{pre}{f}' is missing")
        try:
            values[f] = _typed(flat[pre + f], float)
        except ValueError as e:
            raise fail(f"field '{pre}{f}' {e}") from None
    dtype = flat.get(pre + "dtype", "bf16")
    if not isinstance(dtype, str):
        raise fail(f"field '{pre}dtype' is not a string: {dtype!r}")
    try:
        return StageGemmRates(**values, dtype=dtype)
    except ValueError as e:   # "<field>: <problem>"
        name, _, problem = str(e).partition(": ")
        raise fail(f"field '{pre}{name}' {problem}") from None


def _tables(flat: dict[str, object], prefix: str, fields: tuple[str, ...], fail,
            optional: dict[str, type] | None = None) -> dict[str, dict[str, object]]:
    """The `[prefix.NAME]` tables of `flat`, each holding exactly the float `fields` (and any of
    the `optional` {field: kind}), as {NAME: {field: value}} sorted by NAME; a missing,
    mistyped or unknown key fails."""
    optional = optional or {}
    keys = [k for k in flat if k.startswith(prefix + ".")]
    at = prefix.count(".") + 1
    names = sorted({k.split(".")[at] for k in keys})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        out[name] = {}
        for f in fields:
            key = f"{prefix}.{name}.{f}"
            if key not in flat:
                raise fail(f"field '{key}' is missing")
            try:
                out[name][f] = _typed(flat[key], float)
            except ValueError as e:
                raise fail(f"field '{key}' {e}") from None
        for f, kind in optional.items():
            key = f"{prefix}.{name}.{f}"
            if key in flat:
                try:
                    out[name][f] = _typed(flat[key], kind)
                except ValueError as e:
                    raise fail(f"field '{key}' {e}") from None
    unknown = sorted(set(keys) - {f"{prefix}.{n}.{f}" for n in names for f in (*fields, *optional)})
    if unknown:
        raise fail(f"field '{unknown[0]}' is not a known field")
    return out


def _flatten(doc: dict, prefix: str = "") -> dict[str, object]:
    """{'gpu': {'mem_bytes': 1}} -> {'gpu.mem_bytes': 1}."""
    out: dict[str, object] = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _typed(value: object, kind: type) -> object:
    """Check one TOML value against its kind; integral floats (`2e12`) are accepted as ints."""
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"is not a string: {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"is not true or false: {value!r}")
        return value
    if isinstance(value, bool):
        raise ValueError(f"is a boolean, expected a number: {str(value).lower()}")
    if not isinstance(value, (int, float)):
        raise ValueError(f"is not a number: {value!r}")
    if kind is int:
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"is not a whole number: {value!r}")
        return int(value)
    return value


def _toml_key(field: str) -> str:
    """HardwareProfile field ('flops_eff_per_s.bf16' for a dtype entry) -> its TOML key."""
    if field.startswith("decode_attention"):
        return "gpu." + field
    if field in _OPTIONAL.values():
        return next(k for k, f in _OPTIONAL.items() if f == field)
    base, _, dtype = field.partition(".")
    for toml_name, f in _COMPUTE.items():
        if base == f:
            return f"gpu.compute.{dtype}.{toml_name}" if dtype else "gpu.compute"
    return next((k for k, (f, _) in _FIELDS.items() if f == field), field)
