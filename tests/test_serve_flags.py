"""`kvpipe serve`'s flags checked before the model loads: a port already in use and a --max-context
in the units the other commands take (16K). Run in process; nothing is served."""
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
