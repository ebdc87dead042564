"""`python -m kvpipe` (kvpipe/__main__.py, also the `kvpipe` command): a Ctrl-C at any moment of
the start, while the command line is imported, is the same one line and exit 130 as during a
command."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("delay_s", [0.1, 0.2, 0.4, 0.8])
def test_ctrl_c_while_starting_is_one_line_and_130(delay_s):
    """Fault caught: Ctrl-C while kvpipe's modules were imported (before cli.main's guard) gave a
    KeyboardInterrupt traceback and the process killed by SIGINT. `plan` never imports torch, whose
    own C++ start cannot take a Ctrl-C cleanly; past the imports, the plan search is interrupted."""
    p = subprocess.Popen([sys.executable, "-m", "kvpipe", "plan", "--context", "1M"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay_s)   # any moment must do: there is no line to wait for before the imports end
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == "kvpipe: interrupted\n", (p.returncode, err[-2000:])


def test_import_kvpipe_imports_nothing_more():
    """Fault caught: `import kvpipe` importing the API (a second of planner modules) before the
    entry's guard can take a Ctrl-C."""
    code = "import sys, kvpipe; print(sorted(m for m in sys.modules if m.startswith('kvpipe')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "['kvpipe']", r.stdout + r.stderr
