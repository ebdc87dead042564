"""Packaging: the install exposes one top-level module, `kvpipe`, so generic names (pipeline, sim,
executor, analysis, hw_profiles) never collide with a user's own packages."""
import subprocess
import sys
from importlib import metadata

LAYERS = ("pipeline", "sim", "executor", "analysis", "hw_profiles")


def test_install_exposes_only_kvpipe(tmp_path):
    # Fault caught: a layer folder installed as a top-level package (the old `packages = [...]`).
    code = ("import importlib.util, sys\n"
            f"layers = {LAYERS!r}\n"
            "leaked = [n for n in layers if importlib.util.find_spec(n) is not None]\n"
            "assert not leaked, leaked\n"
            "import kvpipe.pipeline.builder, kvpipe.sim.simulate, kvpipe.hw_profiles, kvpipe.analysis\n"
            "print('ok')\n")
    # run from an empty directory so the checkout itself is not on sys.path
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_console_script_points_into_the_namespace():
    # Fault caught: the entry point left at `kvpipe.cli:main`, outside the guard of the start's Ctrl-C.
    (ep,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "kvpipe"]
    assert ep.value == "kvpipe.__main__:main"


def test_python_dash_m_kvpipe(tmp_path):
    # Fault caught: no kvpipe/__main__.py, or one that does not return main()'s exit code.
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--context", "8K", "--decode-tokens", "1",
                        "--gpu-mem", "1GB"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 3 and "Traceback" not in r.stderr


def test_vocabulary_layer_imports_nothing_above_it():
    # Fault caught: pipeline/ importing sim, executor, analysis or the application layer upward.
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "pipeline"
    bad = [f"{p.name}: {ln.strip()}" for p in root.glob("*.py") for ln in p.read_text().splitlines()
           if ln.strip().startswith(("from kvpipe.", "import kvpipe"))
           and not ln.strip().startswith(("from kvpipe.pipeline", "import kvpipe.pipeline"))]
    assert not bad, bad


def test_every_layer_subpackage_is_listed_for_a_regular_install():
    # Fault caught: a new subpackage (e.g. executor/codecs/) that the editable install finds by
    # path but a regular `pip install .` leaves out (ModuleNotFoundError on the GPU machine).
    import tomllib
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(cfg["packages"]), cfg["package-dir"]
    for name, folder in dirs.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            pkg = ".".join([name, *rel.parts]) if rel.parts else name
            assert pkg in listed, f"{pkg} ({init.parent}) is missing from [tool.setuptools] packages"
