"""The house matches its description: docs/DESIGN.md names every subpackage there is and no
subpackage that is gone, and the library, docs/ and the README carry no project history (rounds of
work, issue numbers, commits, investigation tags, prose dates). CHANGELOG.md holds the history;
benchmarks/, experiments/ and tests/ are outside the rule."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvpipe", "pipeline", "sim", "executor", "hw_profiles", "analysis")
TEXT_SUFFIXES = {".py", ".toml", ".md", ".txt", ".cfg", ".json"}

# A subpackage path as DESIGN.md writes it: `executor/engine/`, `sim/`, or the folder of a file.
NAMED_DIR = re.compile(r"(?<![\w./-])((?:%s)/(?:[a-z_0-9]+/)*)" % "|".join(PACKAGES))

HISTORY = {
    "a round of work": re.compile(
        r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)"
        r"|this|last|next|previous|earlier|one) session\b", re.I),
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a commit": re.compile(r"\bcommit [0-9a-f]{7}", re.I),
    "an investigation tag": re.compile(r"\w-s\d{1,2}[a-z]?\b|simcal", re.I),
    # Results are named <machine>-<date>-<benchmark>: a date joined to a name by a hyphen is not prose.
    "a prose date": re.compile(r"(?<![\w-])20\d\d-\d\d-\d\d(?![\w-])"),
}


def subpackages():
    """Every folder with an __init__.py under the installed roots, as `root/sub/`."""
    found = set()
    for root in PACKAGES:
        for init in (ROOT / root).rglob("__init__.py"):
            found.add(init.parent.relative_to(ROOT).as_posix() + "/")
    return found


def named_in_design():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    return {m.group(1) for m in NAMED_DIR.finditer(text)}


def test_design_names_exist():
    # Fault caught: DESIGN.md describing a folder that was moved or removed.
    gone = sorted(d for d in named_in_design() if not (ROOT / d / "__init__.py").is_file())
    assert not gone, f"docs/DESIGN.md names folders that are not subpackages: {gone}"


def test_every_subpackage_in_design():
    # Fault caught: a subpackage added (or moved) without its row in DESIGN.md.
    missing = sorted(subpackages() - named_in_design())
    assert not missing, f"subpackages docs/DESIGN.md does not name: {missing}"


def checked_files():
    for root in PACKAGES:
        for p in sorted((ROOT / root).rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts:
                yield p
    yield from sorted((ROOT / "docs").rglob("*.md"))
    yield ROOT / "README.md"


def history_hits(text):
    """(what, the matched text) for every history mention in one file's text."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pat in HISTORY.items():
            hits += [(n, what, m.group(0)) for m in pat.finditer(line)]
    return hits


def test_history_patterns_bite():
    # Fault caught: a pattern that matches nothing (the grep below would then pass forever).
    for line in ("found in the tenth session", "see issue 8", "after commit 5438e89",
                 "sim_check-s7.json", "h200-2026-12-01-sim_check-s7.json", "calibrate-simcal3",
                 "measured on 2026-11-30", "(2026-11-30)"):
        assert history_hits(line), line
    for line in ("executor/engine/session.py", "a session of decode steps",
                 "benchmarks/results/h200-2026-11-30-decode.json", "cpu-2026-12-01-lossy-error.json"):
        assert not history_hits(line), line


def test_no_history_in_library_docs_readme():
    # Fault caught: a comment, docstring, profile or doc line citing a round of work, an issue,
    # a commit, an investigation tag or a date (history belongs in CHANGELOG.md).
    bad = [f"{p.relative_to(ROOT)}:{n}: {what}: {hit!r}"
           for p in checked_files() for n, what, hit in history_hits(p.read_text(errors="replace"))]
    assert not bad, "history in the library or its docs:\n" + "\n".join(bad)


RESULT_FILE = re.compile(r"\b[a-z0-9]+-20\d\d-\d\d-\d\d-[\w.-]*?\.(?:json|png)(?:\.gz)?\b")


def test_cited_result_files_exist():
    # Fault caught: docs or the README citing a result file that was renamed or removed.
    kept = {p.name for d in ("benchmarks/results", "experiments/results") for p in (ROOT / d).glob("*")}
    docs = list((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    missing = sorted({f"{p.relative_to(ROOT)}: {m.group(0)}" for p in docs
                      for m in RESULT_FILE.finditer(p.read_text()) if m.group(0) not in kept})
    assert not missing, f"result files cited but not kept: {missing}"


def test_readme_flags_exist():
    # Fault caught: the README's reference tables naming a flag the CLI no longer has.
    import argparse

    from kvpipe.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    known = {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", text)) - {"--index-url", "--no-deps"}   # pip's
    assert named and not sorted(named - known), sorted(named - known)
