"""`python -m kvpipe` (kvpipe/__main__.py, also the `kvpipe` command): a Ctrl-C at any moment of
the start, while the command line is imported, is the same one line and exit 130 as during a
command."""
from __future__ import annotations

import os
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


@pytest.mark.parametrize("delay_s", [0.3, 0.6, 1.0, 1.5, 2.5])
def test_ctrl_c_while_torch_imports_is_one_line_and_130(delay_s):
    """Fault caught: a Ctrl-C inside `import torch` (the first second or two of generate, run, chat,
    serve) raised a KeyboardInterrupt in torch's C++ start: pybind11's terminate, exit -6."""
    cmd = [sys.executable, "-m", "kvpipe", "generate", "--model", "examples/tiny/config.json", "--random-weights",
           "--device", "cpu", "--prompt-format", "ids", "--prompt", "5 6"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay_s)   # the torch import spans about these delays on a small CPU machine
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err and "terminate" not in err, (p.returncode, err[-2000:])
    assert err.splitlines()[-1] == "kvpipe: interrupted", err[-2000:]


SITE_CTRL_C_IN_EXEC = '''import builtins
_import = builtins.__import__
def _ctrl_c_at_cli(name, *args, **kwargs):
    if name == "kvpipe.cli":
        builtins.__import__ = _import
        exec("raise KeyboardInterrupt")   # as a Ctrl-C inside a dataclass's generated method
    return _import(name, *args, **kwargs)
builtins.__import__ = _ctrl_c_at_cli
'''


def test_ctrl_c_out_of_an_exec_under_python_m_is_130(tmp_path):
    """Fault caught: `python -m kvpipe` exited by SIGINT (-2) after printing the one line when the
    Ctrl-C came inside an exec (dataclasses make methods so), as CPython's -m remembers it."""
    (tmp_path / "sitecustomize.py").write_text(SITE_CTRL_C_IN_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 130 and r.stderr == "kvpipe: interrupted\n", (r.returncode, r.stderr[-2000:])
