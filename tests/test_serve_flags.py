"""`kvpipe serve`'s flags checked before the model loads: a port already in use, a --host this
machine does not have, and a --max-context in the units the other commands take (16K); the
capped --cache-mem warning. Run in process; nothing is served."""
import socket

import pytest

from kvpipe.cli import main
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)


@pytest.fixture
def busy_port():
    """A port some other server listens on (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_one_line_before_the_model_loads(busy_port, tiny_config, capsys, monkeypatch):
    """Fault caught: a port in use found by uvicorn after the model loaded and "serving ..." was
    printed (exit 3, uvicorn's own error line) instead of one line naming --port, exit 2, first."""
    import kvpipe.generation as generation
    monkeypatch.setattr(generation, "load", lambda *a, **k: pytest.fail("the model loaded before the port was checked"))
    rc = main(["serve", "--model", str(tiny_config), "--random-weights", "--device", "cpu",
               "--port", str(busy_port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("kvpipe: error: --port:") and str(busy_port) in err[0], err


def test_max_context_takes_the_units_of_the_other_commands(tiny_config, capsys, monkeypatch):
    """Fault caught: `--max-context 16K` refused as "invalid int value" (serve's flag an int where
    generate's and chat's take 16K)."""
    import kvpipe.generation as generation
    seen = {}

    def stop(*a, **k):
        raise ValueError("model: stopped here by the test")
    monkeypatch.setattr(generation, "load", stop)
    from kvpipe.serve import cli as serve_cli
    real = serve_cli._checked
    monkeypatch.setattr(serve_cli, "_checked", lambda args: seen.setdefault("ctx", args.max_context) and real(args))
    with socket.socket() as s:   # a free port, released before serve checks it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["serve", "--model", str(tiny_config), "--random-weights", "--device", "cpu",
               "--max-context", "16K", "--port", str(port)])
    assert seen["ctx"] == 16384, capsys.readouterr().err
    assert rc == 2 and "stopped here by the test" in capsys.readouterr().err


def test_a_model_without_weights_names_model_not_max_context(smollm2, tmp_path, capsys):  # noqa: F811
    """Fault caught: a model folder holding a config and a tokenizer but no weights blamed on the
    default context ("--max-context: the default context ... does not fit (model: ...)") instead
    of one line naming --model."""
    from serve_helpers import tiny_dir
    d = tiny_dir(tmp_path, smollm2[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["serve", "--model", str(d), "--device", "cpu", "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("kvpipe: error: --model:"), err


def test_a_host_not_of_this_machine_names_host_not_port(tiny_config, capsys, monkeypatch):
    """Fault caught: `--host 192.0.2.1` (an address this machine does not have) answered
    "--port: 192.0.2.1:8000 cannot be bound ...; another server may be on it", sending the user
    to change a port that was never the problem."""
    import kvpipe.generation as generation
    monkeypatch.setattr(generation, "load", lambda *a, **k: pytest.fail("the model loaded before the host was checked"))
    rc = main(["serve", "--model", str(tiny_config), "--random-weights", "--device", "cpu",
               "--host", "192.0.2.1", "--port", "8000"])   # TEST-NET-1: no machine's own address
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvpipe: error: --host: 192.0.2.1 "), err


def test_a_capped_cache_budget_is_a_warning_in_binary_units(capsys, monkeypatch, tmp_path):
    """Fault caught: "kvpipe: --cache-mem capped to the 25275969536 bytes free in /dev/shm", a raw
    byte count where every other printed size is binary (GiB), and no `warning:`."""
    import argparse

    import kvpipe.serve.cache_store as store
    from kvpipe.serve.cli import _cache
    monkeypatch.setattr(store, "free_bytes", lambda path: 3 << 30)
    args = argparse.Namespace(cache_dir=str(tmp_path), kv_dir=None)
    cache = _cache(args, {"cache_mem": 1 << 40, "cache_disk": 0})
    err = capsys.readouterr().err
    assert cache.budget["host"] == 3 << 30
    assert err.startswith("kvpipe: warning: --cache-mem capped to the 3.0 GiB free in "), err
