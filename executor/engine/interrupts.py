"""SIGTERM handled like Ctrl-C during a run, so that every `with` block releases what it holds
(the disk tier's file above all) and the process exits with the shell's code for SIGTERM."""
from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run, raised like Ctrl-C so that every `with` block releases its resources
    (the disk file above all); `exit_code` is the shell's 128 + SIGTERM."""

    exit_code = 128 + signal.SIGTERM


@contextlib.contextmanager
def sigterm_raises():
    """While inside, SIGTERM stops the run like Ctrl-C (asyncio cancels it cleanly when it owns
    SIGINT) and surfaces as Terminated; an ignored SIGINT (a background job) raises
    KeyboardInterrupt while inside; outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = threading.Event()
    # A shell starts a background job (`kvpipe run ... &`) with SIGINT ignored. Then asyncio would
    # not take SIGINT for its clean cancel, and SIGTERM could only be raised at whatever line was
    # running: a traceback, printed after the run's own "terminated" line (seen under CI's nohup).
    # While inside, SIGINT raises KeyboardInterrupt again, as in a foreground run.
    sigint = signal.getsignal(signal.SIGINT)
    swap = sigint in (signal.SIG_IGN, signal.SIG_DFL)
    if swap:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def handler(signum, frame):
        hit.set()
        if callable(signal.getsignal(signal.SIGINT)):
            signal.raise_signal(signal.SIGINT)
        else:       # SIGINT ignored (a background job): raise here
            raise Terminated("terminated (SIGTERM)")

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except KeyboardInterrupt:
        if hit.is_set():
            raise Terminated("terminated (SIGTERM)") from None
        raise
    finally:
        signal.signal(signal.SIGTERM, before)
        if swap:
            signal.signal(signal.SIGINT, sigint)
