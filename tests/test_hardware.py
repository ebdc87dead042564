"""Tests of pipeline/hardware.py and the hw_profiles loader: bundled profiles, one-line errors, no torch."""
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpipe.hw_profiles import ProfileError, known_profiles, load_profile
from kvpipe.pipeline.hardware import HardwareProfile

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ["a100-80g", "h100-sxm", "h200", "h200-testbox", "l40s", "rtx3090", "rtx4060", "rtx4060ti-16g", "rtx4090", "rtx5090",
           "rtx6000-ada"]
H200_TEXT = (ROOT / "hw_profiles" / "h200.toml").read_text()


def _user_toml(tmp_path: Path, key: str, value: str | None, text: str = H200_TEXT) -> str:
    """Write h200.toml to tmp_path with `key = ...` set to `value` (None drops the line)."""
    line = re.compile(rf"^{re.escape(key)} = .*$", re.M)
    assert len(line.findall(text)) == 1, key
    new = line.sub("" if value is None else f"{key} = {value}", text)
    path = tmp_path / "x.toml"
    path.write_text(new)
    return str(path)


def _error(path: str) -> str:
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert path in msg
    return msg


def test_known_profiles_lists_bundled_files():
    """Fault caught: a bundled profile missing from the list (or a stray file in it)."""
    assert known_profiles() == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_profile_loads(name):
    """Fault caught: a bundled profile that fails to load, lacks a dtype, or has effective rates
    above peak."""
    hw = load_profile(name)
    assert isinstance(hw, HardwareProfile)
    assert hw.name == name
    assert set(hw.dtypes) == {"bf16", "fp16", "fp32"}
    for dtype in hw.dtypes:
        assert 0 < hw.flops_eff(dtype) <= hw.flops_peak(dtype)
    assert 0 < hw.hbm_eff_bytes_per_s <= hw.hbm_peak_bytes_per_s
    assert hash(hw) == hash(load_profile(name)) and hw == load_profile(name)


@pytest.mark.parametrize("name", BUNDLED)
def test_every_number_has_a_source(name):
    for line in (ROOT / "hw_profiles" / f"{name}.toml").read_text().splitlines():
        if re.match(r"^\w+ = [-+0-9.e_]+|^\w+ = (true|false)", line):
            assert "# source:" in line, line


def test_h200_numbers():
    """Fault caught: H200 numbers drifting from their measured sources (fields swapped, units
    wrong)."""
    hw = load_profile("h200")
    assert hw.flops_eff("bf16") == 780e12
    assert hw.hbm_eff_bytes_per_s == 4.21e12
    assert hw.h2d_bytes_per_s == 55.4e9 and hw.d2h_bytes_per_s == 55.3e9
    mib = 2**20
    assert hw.h2d_alpha_s == pytest.approx(mib / 38e9 - mib / 55.4e9, rel=1e-3)
    assert hw.host_mem_bytes == 125 * 2**30


def test_unknown_name_lists_known_ones():
    """Fault caught: an unknown profile name failing without listing the known ones."""
    with pytest.raises(ProfileError) as e:
        load_profile("foo")
    assert str(e.value) == f"unknown hardware 'foo' (known: {', '.join(BUNDLED)}); or give a path to a .toml file"


def test_unknown_dtype_raises():
    """Fault caught: a missing dtype rate returned as 0 or a default instead of an error naming it."""
    hw = load_profile("rtx4090")
    with pytest.raises(ValueError, match="fp8"):
        hw.flops_eff("fp8")
    with pytest.raises(ValueError, match="fp8"):
        hw.flops_peak("fp8")


def test_user_path_loads(tmp_path):
    """Fault caught: a user's TOML path not loaded like the bundled file it copies."""
    path = _user_toml(tmp_path, "name", '"my-gpu"')
    hw = load_profile(path)
    assert hw.name == "my-gpu"
    assert replace(hw, name="h200") == load_profile("h200")


def test_missing_file(tmp_path):
    """Fault caught: a missing file surfacing as a traceback instead of a one-line error."""
    assert "not found" in _error(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("key, value, expect", [
    ("h2d_bytes_per_s", None, "field 'link.h2d_bytes_per_s' is missing"),
    ("h2d_bytes_per_s", '"fast"', "field 'link.h2d_bytes_per_s' is not a number: 'fast'"),
    ("h2d_bytes_per_s", "true", "field 'link.h2d_bytes_per_s' is a boolean"),
    ("h2d_bytes_per_s", "-1e9", "field 'link.h2d_bytes_per_s' must be finite and > 0, got -1000000000.0"),
    ("h2d_bytes_per_s", "nan", "field 'link.h2d_bytes_per_s' must be finite"),
    ("h2d_alpha_s", "-1e-6", "field 'link.h2d_alpha_s' must be finite and >= 0"),
])
def test_bad_field_names_it(tmp_path, key, value, expect):
    """Fault caught: a bad link field accepted or reported without its name."""
    msg = _error(_user_toml(tmp_path, key, value))
    assert msg.startswith("hw profile '") and expect in msg


@pytest.mark.parametrize("old, new, expect", [
    ("mem_bytes = 150754820096", "mem_bytes = 1.5", "field 'gpu.mem_bytes' is not a whole number"),
    ("mem_bytes = 150754820096", "mem_bytes = 0", "field 'gpu.mem_bytes' must be a positive integer"),
    ("pcie_duplex = true", "pcie_duplex = 1", "field 'link.pcie_duplex' is not true or false"),
    ("[disk]", "[disk]\nspeed = 3", "field 'disk.speed' is not a known field"),
    ("effective_flops_per_s = 780e12       # source: measured",
     "effective_flops_per_s = 990e12  # source: measured", "field 'gpu.compute.bf16.effective_flops_per_s'"),
    ("effective_flops_per_s = 780e12       # source: measured", "# dropped:", "field 'gpu.compute.bf16.effective_flops_per_s' is missing"),
    ("[gpu.compute.fp32]", "[gpu.compute.fp8]", "field 'gpu.compute.fp8.peak_flops_per_s' unknown dtype 'fp8'"),
    ("hbm_eff_bytes_per_s = 4.21e12", "hbm_eff_bytes_per_s = 5e12", "field 'gpu.hbm_eff_bytes_per_s' 5000000000000.0 exceeds"),
    ("[link]", "[link", "is not valid TOML: "),
    ("elementwise_efficiency = 1.0 ", "elementwise_efficiency = 1.5 ",
     "field 'gpu.elementwise_efficiency' must be a number in (0, 1], got 1.5"),
    ("elementwise_efficiency = 1.0 ", "# dropped ", "field 'gpu.elementwise_efficiency' is missing"),
    ("small_kernel_s = 1.05e-6 ", "small_kernel_s = -1e-6 ", "field 'gpu.small_kernel_s' must be finite and >= 0"),
    ("small_kernel_s = 1.05e-6 ", "small_kernel_s = 1.05e-6\nfp16_acc16_flops_per_s = 1e12 ",
     "field 'gpu.fp16_acc16_flops_per_s' fp16_acc16_peak_flops_per_s and fp16_acc16_flops_per_s come together"),
    ("small_kernel_s = 1.05e-6 ", "small_kernel_s = 1.05e-6\nfp16_acc16_peak_flops_per_s = 1e12\n"
     "fp16_acc16_flops_per_s = 2e12 ", "field 'gpu.fp16_acc16_flops_per_s' 2000000000000.0 exceeds the peak"),
])
def test_bad_structure_names_it(tmp_path, old, new, expect):
    """Fault caught: malformed TOML structure accepted or reported without the field."""
    assert H200_TEXT.count(old) == 1, old
    path = tmp_path / "x.toml"
    path.write_text(H200_TEXT.replace(old, new))
    assert expect in _error(str(path))


def test_dataclass_validates_directly():
    """Fault caught: a HardwareProfile built in code skipping the validation the loader does."""
    hw = load_profile("h200")
    with pytest.raises(ValueError, match="h2d_bytes_per_s.*-1"):
        replace(hw, h2d_bytes_per_s=-1)
    with pytest.raises(ValueError, match="gpu_mem_bytes.*True"):
        replace(hw, gpu_mem_bytes=True)
    with pytest.raises(ValueError, match="flops_eff_per_s.fp16.*missing"):
        replace(hw, flops_eff_per_s={"bf16": 1e12, "fp32": 1e12})
    assert replace(hw, flops_eff_per_s=dict(hw.flops_eff_per_s)) == hw


@given(st.floats(1.0, 1e16), st.floats(1.0, 1e16))
def test_flops_rate_grows_with_kernel_size_below_eff(a, b):
    """Fault caught: the small-shape efficiency curve not monotone, or reaching the effective rate."""
    hw = load_profile("rtx4090")
    lo, hi = sorted((a, b))
    assert hw.flops_rate("bf16", lo) <= hw.flops_rate("bf16", hi) < hw.flops_eff("bf16")
    half = hw.flops_rate("bf16", hw.small_shape_half_flops)
    assert half == pytest.approx(hw.flops_eff("bf16") / 2)


def test_imports_without_torch():
    """Fault caught: pipeline/hardware.py or the profile loader importing torch, directly or
    behind a try/except (torch is importable here, so the check is that it never got loaded)."""
    code = ("import sys\n"
            "import kvpipe.pipeline.hardware, kvpipe.hw_profiles as hw_profiles\n"
            "hw_profiles.load_profile('h200')\n"
            "loaded = sorted(m for m in ('torch', 'transformers', 'simpy') if m in sys.modules)\n"
            "print(','.join(loaded))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"loaded: {r.stdout.strip()}"


@pytest.mark.parametrize("table, key", [("[gpu.compute.bf16]", "gpu.compute.bf16.sparse_flops_per_s"),
                                        ("[codec.zstd-planes]", "codec.zstd-planes.level")])
def test_unknown_field_inside_a_table_is_named(tmp_path, table, key):
    """Fault caught: a misspelt or unsupported field inside a [gpu.compute.*] or [codec.*] table
    silently ignored (the loader must refuse it and name the key)."""
    assert H200_TEXT.count(f"\n{table}") == 1, table
    text = H200_TEXT.replace(f"\n{table}", f"\n{table}\n{key.rsplit('.', 1)[1]} = 1.0", 1)
    path = tmp_path / "x.toml"
    path.write_text(text)
    assert f"field '{key}' is not a known field" in _error(str(path))


def test_decode_attention_seconds_per_group_and_between():
    # Fault caught: a group size read from another group's entry (groups unsorted, off by one in
    # the bracket), or the table ignored. Entries by hand: g1 10 us + bytes/0.5 TB/s,
    # g4 5 us + bytes/2 TB/s; at 1 MB: g1 12 us, g4 5.5 us; g2 is 1/3 of the way: 12 - 6.5/3 us.
    from dataclasses import replace

    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.hardware import DecodeAttention
    base = replace(load_profile("h200"), decode_attention=())
    assert base.decode_attention_seconds(1, 1e6) is None        # no table: the caller's roofline
    hw = replace(base, decode_attention=(DecodeAttention(4, 5e-6, 2e12), DecodeAttention(1, 10e-6, 5e11)))
    assert [e.group for e in hw.decode_attention] == [1, 4]
    assert hw.decode_attention_seconds(1, 1e6) == pytest.approx(12e-6)
    assert hw.decode_attention_seconds(4, 1e6) == pytest.approx(5.5e-6)
    assert hw.decode_attention_seconds(2, 1e6) == pytest.approx(12e-6 - 6.5e-6 / 3)
    assert hw.decode_attention_seconds(8, 1e6) == pytest.approx(5.5e-6)      # beyond the table: nearest
    with pytest.raises(ValueError, match="decode_attention"):
        replace(base, decode_attention=(DecodeAttention(1, 1e-6, 1e12), DecodeAttention(1, 2e-6, 1e12)))
    with pytest.raises(ValueError, match="decode_attention.g1.bytes_per_s"):
        DecodeAttention(1, 1e-6, 0.0)
