"""`kvpipe run` gives torch's CUDA allocator expandable segments unless the user configured it
(PYTORCH_CUDA_ALLOC_CONF): with fixed segments, 32K-token chunks died of fragmentation on the H200."""
import os

from kvpipe import cli

ENV = "PYTORCH_CUDA_ALLOC_CONF"


def _run(tiny_config) -> int:
    return cli.main(["run", "--model", tiny_config, "--random-weights", "--context", "32", "--decode-tokens",
                     "1", "--device", "cpu", "--json", "--no-progress"])


def test_run_sets_expandable_segments_when_unset(tiny_config, monkeypatch, capsys):
    """Fault caught: `kvpipe run` leaving torch's default fixed segments in place (the
    fragmentation OOMs of the H200 runs, docs/PERFORMANCE.md)."""
    monkeypatch.delenv(ENV, raising=False)
    assert _run(tiny_config) == 0
    assert os.environ[ENV] == "expandable_segments:True"


def test_run_leaves_the_users_setting_alone(tiny_config, monkeypatch, capsys):
    """Fault caught: kvpipe overwriting (or appending to) an allocator setting the user chose."""
    monkeypatch.setenv(ENV, "max_split_size_mb:64")
    assert _run(tiny_config) == 0
    assert os.environ[ENV] == "max_split_size_mb:64"


def test_plan_does_not_touch_it(monkeypatch, capsys):
    """Fault caught: the variable set by `kvpipe plan`, which never starts CUDA (a torch-free
    command changing the environment of a process that embeds it)."""
    monkeypatch.delenv(ENV, raising=False)
    assert cli.main(["plan", "--context", "8K", "--decode-tokens", "1", "--method", "standard", "--json"]) in (0, 3)
    assert ENV not in os.environ
