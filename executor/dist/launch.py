"""Launching the ranks: kvpipe spawns one process per rank itself (`launch`), or runs the one
rank torchrun started it as (`under_torchrun`, env RANK / WORLD_SIZE / LOCAL_RANK). A rank that
dies ends every rank within seconds: the launcher watches every process, stops the others
(SIGTERM, then SIGKILL), removes the run's folder (KV files of every rank) and raises one line
naming the rank. Pinned host memory is the processes' own and goes with them."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .rank import RankJob, rank_main

POLL_S = 0.1
STOP_GRACE_S = 3.0   # SIGTERM's time to clean up before SIGKILL


class RankFailed(RuntimeError):
    """A rank died or raised; the run was ended on every rank. `rank`: the first that failed."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"rank {rank} {why}; the run was ended on every rank")
        self.rank = rank


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _entry(rank: int, world: int, job: RankJob, folder: str) -> None:
    """A spawned rank: errors become one line in the run's folder (read by the launcher), no traceback."""
    try:
        rank_main(rank, world, job, folder)
    except BaseException as e:   # noqa: BLE001  (the launcher reports it; the process must end)
        (Path(folder) / f"error-{rank}").write_text(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        sys.stderr.flush()
        os._exit(1)


def _culprit(procs: list, folder: Path) -> tuple[int, str] | None:
    """The first rank that failed, or None: killed by a signal (wrote nothing) before one that
    raised (likely a peer's loss seen in a collective)."""
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if not failed:
        return None
    for r, code in failed:
        if not (folder / f"error-{r}").exists():
            why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            return r, why
    r = failed[0][0]
    return r, "failed: " + (folder / f"error-{r}").read_text()


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(job: RankJob, world: int, announce=None, start: str = "spawn") -> list[dict]:
    """Run `job` on `world` new processes (`start`: multiprocessing's start method; fork only
    where the caller has started no threads); each rank's results ({"rank", "runs": [...]}).
    RankFailed names the first rank that failed. `announce(line)` hears when every rank executes."""
    folder = Path(tempfile.mkdtemp(prefix="kvpipe-ranks-"))
    job = RankJob(**{**job.__dict__, "init_method": f"file://{folder / 'rendezvous'}"})
    ctx = mp.get_context(start)
    procs = [ctx.Process(target=_entry, args=(r, world, job, str(folder)), daemon=True) for r in range(world)]
    announced = False
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs) or any(p.exitcode is None for p in procs):
            bad = _culprit(procs, folder)
            if bad is not None:
                _stop(procs)
                raise RankFailed(*bad)
            if not announced and all((folder / f"ready-{r}").exists() for r in range(world)):
                announced = True
                if announce:
                    announce(f"executing on {world} ranks (pids {', '.join(str(p.pid) for p in procs)})")
            time.sleep(POLL_S)
        bad = _culprit(procs, folder)
        if bad is not None:
            raise RankFailed(*bad)
        return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(world)]
    finally:
        _stop(procs)
        shutil.rmtree(folder, ignore_errors=True)
