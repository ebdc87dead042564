"""The wait a refused request is told in `Retry-After`: the expected time for the work ahead of
it to finish, the running generation's remainder plus one mean generation per queued request,
the mean taken over the recent measured generations only."""
from __future__ import annotations

import math
import threading
import time
from collections import deque

RECENT = 16   # generations the mean is taken over: it follows the load as the prompts change


class WaitEstimate:
    """`started()` and `finished()` from the engine's worker around each generation;
    `seconds(queued)` from the event loop: whole seconds, at least 1. `clock` returns seconds."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.durations_s: deque[float] = deque(maxlen=RECENT)
        self.started_at: float | None = None   # the running generation's start, None between them

    def started(self) -> None:
        with self.lock:
            self.started_at = self.clock()

    def finished(self) -> None:
        with self.lock:
            if self.started_at is not None:
                self.durations_s.append(self.clock() - self.started_at)
            self.started_at = None

    def seconds(self, queued: int) -> int:
        """The running generation's expected remainder plus `queued` mean generations, rounded up."""
        with self.lock:
            elapsed = None if self.started_at is None else self.clock() - self.started_at
            if self.durations_s:
                mean = sum(self.durations_s) / len(self.durations_s)
            else:   # nothing measured yet: the first generation's time so far is all there is
                mean = elapsed or 0.0
        ahead = queued * mean + (0.0 if elapsed is None else max(mean - elapsed, 0.0))
        return max(1, math.ceil(ahead))
