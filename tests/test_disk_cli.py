"""`kvpipe run` with disk units through a subprocess on the CPU: same digest as host RAM, the
file removed on SIGTERM and Ctrl-C, a plan larger than the free disk refused with the numbers."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import write_config


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return write_config(tmp_path_factory, max_position_embeddings=8192)   # 256 + 4000 decode positions


def cmd(config, kv_dir, *args):
    return [sys.executable, "-m", "kvpipe", "run", "--device", "cpu", "--no-progress", "--model", config,
            "--random-weights", "--kv-dir", str(kv_dir), "--resident", "none", "--group", "1", *args]


def test_disk_units_and_host_units_print_the_same_digest(tiny_config, tmp_path, capsys):
    """Catches a disk tier that changes a bit of the output, end to end through the CLI (in
    process: the flags, the plan, the run and the JSON)."""
    from kvpipe.cli import main
    common = ("--context", "200", "--decode-tokens", "6", "--chunk", "48", "--json")
    out = {}
    for disk in ("0", "3"):
        assert main(cmd(tiny_config, tmp_path, "--disk", disk, *common)[3:]) == 0
        out[disk] = json.loads(capsys.readouterr().out)
    assert out["3"]["plan"]["disk"] == 3 and out["0"]["plan"]["disk"] == 0
    assert out["3"]["output_digest"] == out["0"]["output_digest"]
    assert out["3"]["measured"]["peak_bytes"]["disk"] > 0 and out["3"]["disk"]["read_bytes"] > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("background", [False, True])
def test_the_kv_file_is_removed_on_sigterm_and_ctrl_c(tiny_config, tmp_path, background):
    """Catches a KV file left on disk when the run is terminated (SIGTERM) or interrupted
    (Ctrl-C) mid-way. Both runs go at once, each in its own directory. `background`: started as
    a shell starts `kvpipe run ... &`, with SIGINT ignored; catches SIGTERM then raised wherever
    the run happened to be (a traceback after the run's own line) and `kill -INT` doing nothing."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None
    cases = {signal.SIGTERM: (143, "kvpipe: terminated (SIGTERM)"), signal.SIGINT: (130, "kvpipe: interrupted")}
    procs = {}
    try:
        for sig in cases:
            d = tmp_path / sig.name
            d.mkdir()
            procs[sig] = (d, subprocess.Popen(cmd(tiny_config, d, "--disk", "2", "--context", "256", "--chunk", "64",
                                                  "--decode-tokens", "4000", "--no-warmup"), preexec_fn=ignore,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 120
        for sig, (d, p) in procs.items():
            while not os.listdir(d):
                assert p.poll() is None and time.monotonic() < deadline, "the run never made its file"
                time.sleep(0.05)
        time.sleep(0.5)                      # well into the runs
        for sig, (d, p) in procs.items():
            p.send_signal(sig)
        for sig, (d, p) in procs.items():
            _, err = p.communicate(timeout=120)
            code, line = cases[sig]
            assert p.returncode == code, (sig, err[-2000:])
            assert err.strip().splitlines()[-1] == line and "Traceback" not in err, (sig, err[-2000:])
            assert os.listdir(d) == [], sig
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                p.kill()


def test_a_plan_needing_more_disk_than_is_free_is_refused_with_the_numbers(tiny_config, tmp_path):
    """Catches a run that starts (allocates, writes) although its disk units cannot fit: on a
    real 64 KiB tmpfs in a private mount namespace, the refusal is one line with both sizes."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    kv_dir = tmp_path / "small"
    kv_dir.mkdir()
    run = " ".join(f"'{a}'" for a in cmd(tiny_config, kv_dir, "--disk", "4", "--context", "4096",
                                         "--decode-tokens", "1"))
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{kv_dir}' && {run}"],
                       capture_output=True, text=True, timeout=300)
    if "mount" in r.stderr and r.returncode != 3:
        pytest.skip(f"cannot mount a private tmpfs here: {r.stderr.strip()[:200]}")
    assert r.returncode == 3, r.stderr[-2000:]   # valid input, nothing fits the disk budget
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "disk needs 2.0 MiB, 64.0 KiB available" in lines[0], lines[0]


def test_a_disk_that_fills_after_the_checks_fails_with_one_line_and_leaves_nothing(tiny_config, tmp_path):
    """Catches a run whose disk fills after every free-space check passed (another process took
    the space) ending in a traceback, a hang, or a half-made KV file left behind. Real kernel
    ENOSPC, no mock: tests/disk_fill.py mounts an 8 MiB tmpfs in a private mount namespace and,
    at the moment the run opens its KV file (a fanotify permission event holds the open), fills
    the tmpfs with its own file; the run's pre-allocation then gets ENOSPC from the kernel."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    kv_dir = tmp_path / "small"
    kv_dir.mkdir()
    helper = os.path.join(os.path.dirname(__file__), "disk_fill.py")
    run = cmd(tiny_config, kv_dir, "--disk", "4", "--context", "4096", "--decode-tokens", "1")
    r = subprocess.run(["unshare", "-m", sys.executable, helper, str(kv_dir), str(8 << 20), "--", *run],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 2 and ("mount" in r.stderr or "fanotify" in r.stderr):
        pytest.skip(f"cannot mount a private tmpfs or watch it with fanotify here: {r.stderr.strip()[-300:]}")
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["filled"], "the run never opened its KV file"
    assert r.returncode == 2 and report["rc"] == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]   # besides the progress line
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert errors[0] == r.stderr.strip().splitlines()[-1]
    assert errors[0].startswith("kvpipe: error: disk: no space to pre-allocate 2.0 MiB for ") and \
        "(No space left on device; 0 B free now)" in errors[0], errors[0]
    assert report["left"] == []                      # the KV file is gone


def test_without_disk_a_host_budget_too_small_places_units_on_disk_with_the_same_digest(tiny_config, tmp_path,
                                                                                       capsys):
    """Catches `kvpipe run` taking its disk budget as 0 when --disk is not given (the plan was
    refused with "disk 0 B available" although --kv-dir had room: the fix of 2026-11-30 makes the
    free space under --kv-dir the budget before the search): with --host-mem too small for the
    2 MiB of offloaded KV and no --disk, the run must put units on disk by itself and print the
    digest of the same workload run with all of it in host RAM."""
    from kvpipe.cli import main
    common = ("--context", "4096", "--decode-tokens", "3", "--json")
    out = {}
    for host in ("100MB", "2MB"):
        assert main(cmd(tiny_config, tmp_path, "--host-mem", host, *common)[3:]) == 0, capsys.readouterr().err
        out[host] = json.loads(capsys.readouterr().out)
    assert out["100MB"]["plan"]["disk"] == 0 and out["100MB"]["disk"] is None
    assert out["2MB"]["plan"]["disk"] > 0 and out["2MB"]["disk"]["read_bytes"] > 0
    assert out["2MB"]["budgets_bytes"]["disk"] > 0
    assert out["2MB"]["output_digest"] == out["100MB"]["output_digest"]
    assert os.listdir(tmp_path) == []
