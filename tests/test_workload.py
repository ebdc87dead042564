"""pipeline/workload.py and the CLI's workload flags: bad values raise a ValueError
naming the field (never an assert, which `python -O` drops); `kvpipe plan` turns it into one
line on stderr and exit code 2."""
import pytest

from kvpipe.cli import main
from kvpipe.pipeline.workload import Workload


@pytest.mark.parametrize("kw, field", [
    (dict(context=0), "context"), (dict(context=-3), "context"), (dict(context=True), "context"),
    (dict(context=8.0), "context"), (dict(decode_tokens=-1), "decode_tokens"),
    (dict(decode_tokens=1.5), "decode_tokens"), (dict(decode_tokens=False), "decode_tokens"),
    (dict(batch=0), "batch"), (dict(batch=-2), "batch"), (dict(batch=True), "batch"),
    (dict(batch="2"), "batch"),
])
def test_workload_refuses_bad_values(kw, field):
    """Fault caught: a Workload that accepts batch 0, negative decode tokens, a bool or a float
    (`--batch 0` would build an empty graph and report zero memory)."""
    args = dict(context=8, decode_tokens=2, batch=1) | kw
    with pytest.raises(ValueError, match=f"^{field}:"):
        Workload(**args)


def test_workload_parse():
    """Fault caught: Workload.parse bypassing the checks, or misreading a K suffix."""
    assert Workload.parse("2K", 3, 2) == Workload(2048, 3, 2)
    with pytest.raises(ValueError, match="^batch:"):
        Workload.parse("2K", 3, 0)


@pytest.mark.parametrize("args, field", [
    (["--batch", "0"], "batch"),
    (["--batch", "-2"], "batch"),
    (["--decode-tokens", "-1"], "--decode-tokens"),
])
def test_plan_refuses_bad_workload(capsys, args, field):
    """Fault caught: `kvpipe plan --batch 0` (or a negative decode count) planning an empty
    workload, or failing with a traceback instead of naming the flag. (Budgets: test_cli.py.)"""
    assert main(["plan", "--context", "4K", *args]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0], err
