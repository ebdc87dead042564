"""A server killed with SIGKILL leaves its prefix-cache folders (host RAM on /dev/shm, disk under
--cache-dir); the next server's store removes those of dead processes before making its own."""
from __future__ import annotations

import os
import subprocess
import sys

from kvpipe.serve.cache_store import DirStore


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_left_folders_of_dead_servers_are_removed_live_ones_kept(tmp_path, capsys):
    """Faults caught: the store never reclaiming (a SIGKILLed server's KV stays in RAM for good),
    or reclaiming a live server's folder (its entries vanish under it), or anything not named as
    a cache folder."""
    dead = tmp_path / f"kvpipe-cache-host-{_dead_pid()}-abc123"
    (dead / "entry-1").mkdir(parents=True)
    (dead / "entry-1" / "data").write_bytes(b"x" * 1000)
    live = tmp_path / f"kvpipe-cache-host-{os.getppid()}-def456"
    live.mkdir()
    other = tmp_path / "not-kvpipe-999999"
    other.mkdir()
    store = DirStore({"host": str(tmp_path)})
    root = store.root("host")
    assert not dead.exists()
    assert live.exists() and other.exists() and root.exists()
    assert "removed 1 prefix-cache folder (1000 bytes)" in capsys.readouterr().err
    store.close()
    assert not root.exists()
