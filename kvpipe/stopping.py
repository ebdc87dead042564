"""Ctrl-C or SIGTERM during `kvpipe generate`'s answer stops it between two tokens, so that what
was made is kept (printed, its prompt's KV saved) instead of lost to a KeyboardInterrupt. Before
the first token (the prefill) and at a second signal, a signal does what it did before: the run's
own clean stop (asyncio's Ctrl-C, executor/engine/interrupts.py for SIGTERM)."""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 128 + signal.SIGINT   # the shell's code for Ctrl-C


def interrupted(e: KeyboardInterrupt) -> int:
    """The one line and exit code of a command stopped by Ctrl-C (or SIGTERM during a run:
    Terminated, whose `exit_code` is 143)."""
    print(f"kvpipe: {str(e) or 'interrupted'}", file=sys.stderr)
    return getattr(e, "exit_code", EXIT_INTERRUPTED)


def import_torch() -> None:
    """Imports torch with SIGINT held back: a KeyboardInterrupt raised inside its C++ start ends
    the process (pybind11's terminate); held, it comes after, where the command's guard takes it."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    except ImportError:   # the command that needs it says so in its own words
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class StopBetweenTokens:
    """A context manager around one generation; `asked` is generate's `interrupt`. Its first call
    on the main thread (after the first token: the prompt's KV is complete) takes over SIGINT and
    SIGTERM from the run; `armed()` is then called once. `signum`: the signal that stopped the
    answer (None: none came). On exit the handlers found on entry are back."""

    def __init__(self, armed: Callable[[], None] | None = None) -> None:
        self.signum: int | None = None
        self._armed = armed
        self._outer: dict = {}
        self._run: dict = {}     # the run's own handlers, which ours replaced while it decodes

    def __enter__(self) -> StopBetweenTokens:
        self._outer = {s: signal.getsignal(s) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        if self._run:
            for s, h in self._outer.items():
                signal.signal(s, h)

    def asked(self) -> bool:
        """Whether a signal came; arms on the first call on the main thread (handlers can only be
        set there; the engine hands tokens over on the thread that runs it, engine/decoding.py)."""
        if not self._run and threading.current_thread() is threading.main_thread():
            self._run = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
            if self._armed is not None:
                self._armed()
        return self.signum is not None

    def _on_signal(self, signum, frame) -> None:
        if self.signum is None:   # the first: the answer stops at the next token
            self.signum = signum
            return
        run = self._run.get(signum)   # a second: stop now, as the run would have
        if callable(run):
            run(signum, frame)
        else:
            raise KeyboardInterrupt
