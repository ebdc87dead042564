"""The Retry-After of a full queue (kvpipe/serve/wait.py) against a fake clock and known
generation times: the wait told is the time the work ahead takes, rounded up to whole seconds."""
from kvpipe.serve.wait import RECENT, WaitEstimate


class Clock:
    """Seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def run(w: WaitEstimate, clock: Clock, durations_s) -> None:
    for d in durations_s:
        w.started()
        clock.now_s += d
        w.finished()


def test_the_wait_is_the_work_ahead_not_a_prior_times_the_queue():
    """Fault caught: Retry-After from a running mean that starts at a made-up 1 s and counts the
    running generation whole (mean x (queued + 1)): 12 s told where the work ahead, 16 queued
    generations of 0.5 s and the running one's last 0.25 s, ends in 8.25 s."""
    clock = Clock()
    w = WaitEstimate(clock)
    run(w, clock, [0.5] * 4)
    w.started()
    clock.now_s += 0.25
    assert w.seconds(16) == 9   # 8.25 s rounded up


def test_whole_seconds_at_least_one():
    """Fault caught: Retry-After 0 (retry at once, refused again) when nothing is measured yet or
    the running generation is past the mean, or a fraction, which the header does not allow."""
    clock = Clock()
    w = WaitEstimate(clock)
    assert w.seconds(0) == 1 and w.seconds(5) == 1     # nothing measured, nothing running
    run(w, clock, [0.2])
    w.started()
    clock.now_s += 3.0                                # the running one well past the mean
    assert w.seconds(0) == 1 and w.seconds(4) == 1    # 4 x 0.2 s = 0.8 s, rounded up


def test_the_mean_follows_the_recent_generations():
    """Fault caught: a mean over every generation since start, so after a run of long documents
    the short questions that follow are still told the long documents' wait."""
    clock = Clock()
    w = WaitEstimate(clock)
    run(w, clock, [30.0] * RECENT + [1.0] * RECENT)
    assert w.seconds(4) == 4
