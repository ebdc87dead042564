"""`kvpipe serve`'s prefix cache as a real process on loopback (a tiny random Llama, its KV on host
RAM and disk, prompts as token ids through /v1/completions): documents alternating with a budget
that holds them (hits after the first round) and one that holds one (spills to disk, evictions in
LRU order), every answer equal to a cold `kvpipe.generate`'s; the tiers' files never above their
budgets; a corrupt entry answered cold; SIGTERM removes every entry; bad budget flags exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import kvpipe
from serve_helpers import ServerProcess, metric, tiny_dir
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)

pytestmark = pytest.mark.usefixtures("single_thread")
NAME, NEW = "tiny", 8
PLAN = ["--random-weights", "--device", "cpu", "--resident", "none", "--disk", "2"]
DOCS = {k: [1000 * (i + 1) + t for t in range(200)] for i, k in enumerate("ABCDE")}
Q1, Q2, Q3 = [5, 6, 7], [8, 9, 10], [11, 12]
# an entry is ~68 KB of files (210 tokens x 4 units x 64 bytes, aligned, and its manifest); room
# is made for ~133 KB (cache_store.predicted_bytes) before one is written
HOLDS_ONE, HOLDS_THREE = 170_000, 400_000
DISK_HOLDS_TWO = 150_000     # a spilled entry moves at its real size


@pytest.fixture(scope="module")
def model(smollm2, tmp_path_factory):  # noqa: F811
    return tiny_dir(tmp_path_factory.mktemp("cache"), smollm2[2])


def start(model, root: Path, *flags: str) -> ServerProcess:
    kv = root / "kv"
    kv.mkdir(exist_ok=True)
    s = ServerProcess(["--model", str(model), *PLAN, "--kv-dir", str(kv), "--max-context", "1024", *flags])
    s.kv = kv
    return s


def ask(s: ServerProcess, ids: list[int]) -> dict:
    r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": NEW,
                                                     "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cold(model, ids: list[int]) -> str:
    return kvpipe.generate(str(model), " ".join(map(str, ids)), prompt_format="ids", random_weights=True,
                           device="cpu", resident="none", disk="2", max_new_tokens=NEW, ignore_eos=True).text


def answer(model, js: dict) -> str:
    return js["choices"][0]["text"]


def tier_bytes(s: ServerProcess, parent: Path, tier: str) -> int:
    return sum(f.stat().st_size for f in parent.glob(f"kvpipe-cache-{tier}-{s.proc.pid}-*/*/*"))


def metrics(s: ServerProcess) -> str:
    return httpx.get(s.url + "/metrics", timeout=10).text


def test_two_documents_alternating_hit_stay_exact_and_a_corrupt_entry_is_answered_cold(model, tmp_path):
    # Fault caught: the live conversation's KV not kept when another document comes (round 2
    # prefilled whole: cached_tokens 0), an entry loaded with the wrong tokens' KV (answers unlike
    # a cold run), the RAM tier above --cache-mem, a corrupt entry answered 500 or from its bad
    # bytes, or entries (files on /dev/shm) left after SIGTERM.
    s = start(model, tmp_path, "--cache-mem", str(HOLDS_THREE))
    try:
        got = {}
        for q in (Q1, Q2):
            for d in "AB":
                got[d, tuple(q)] = ask(s, DOCS[d] + q)
                assert tier_bytes(s, Path("/dev/shm"), "host") <= HOLDS_THREE
        for d in "AB":
            assert got[d, tuple(Q1)]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert got[d, tuple(Q2)]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(DOCS[d])
        m = metrics(s)
        assert metric(m, "kvpipe_prefix_cache_hits_total") == 2 and metric(m, "kvpipe_prefix_cache_evictions_total") == 0
        assert metric(m, 'kvpipe_prefix_cache_bytes{tier="host"}') == tier_bytes(s, Path("/dev/shm"), "host") > 0
        data = next(Path("/dev/shm").glob(f"kvpipe-cache-host-{s.proc.pid}-*/*/kv-*.bin"))
        with open(data, "r+b") as f:       # the kept entry (document A, then Q2) corrupted
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        bad = ask(s, DOCS["A"] + Q3)
        assert bad["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(metrics(s), "kvpipe_prefix_cache_load_failures_total") == 1 and not data.exists()
        for (d, q), js in got.items():
            assert answer(model, js) == cold(model, DOCS[d] + list(q)), (d, q)
        assert answer(model, bad) == cold(model, DOCS["A"] + Q3)
        assert s.stderr().count("prefix cache entry of") == 1 and "Traceback" not in s.stderr()
    finally:
        assert s.stop() in (-15, 143)
    assert not list(Path("/dev/shm").glob(f"kvpipe-cache-*-{s.proc.pid}-*"))


def test_one_entry_of_ram_alternates_two_documents_spills_and_evicts_the_least_recently_used(model, tmp_path):
    # Fault caught: the most recently used entry evicted (B's later request missing, A's hitting),
    # an entry of host RAM dropped while the disk budget has room, either tier's files above its
    # budget, an entry's files left after its eviction, or the disk tier left after SIGTERM.
    cache = tmp_path / "cache"
    s = start(model, tmp_path, "--cache-mem", str(HOLDS_ONE), "--cache-disk", str(DISK_HOLDS_TWO),
              "--cache-dir", str(cache))
    try:
        seen = {}
        for d, q in (("A", Q1), ("B", Q1), ("A", Q2), ("B", Q2), ("C", Q1), ("D", Q1), ("E", Q1)):
            seen[d, tuple(q)] = ask(s, DOCS[d] + q)
            assert tier_bytes(s, Path("/dev/shm"), "host") <= HOLDS_ONE and tier_bytes(s, cache, "disk") <= DISK_HOLDS_TWO
        # A and B alternate on one entry in RAM (the other is live); C, D and E each move the live
        # one to RAM and RAM's to disk (A, then B, then C), where A, the least recently used, is
        # evicted to make room for C
        assert [seen[d, tuple(Q2)]["usage"]["prompt_tokens_details"]["cached_tokens"] for d in "AB"] == [200, 200]
        m = metrics(s)
        assert metric(m, "kvpipe_prefix_cache_evictions_total") == 1 and metric(m, "kvpipe_prefix_cache_spills_total") == 3
        assert metric(m, 'kvpipe_prefix_cache_entries{tier="disk"}') == 2 == len(list(cache.glob("kvpipe-cache-disk-*/*")))
        b, a = ask(s, DOCS["B"] + Q3), ask(s, DOCS["A"] + Q3)
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == len(DOCS["B"])     # from disk
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0                  # evicted
        assert tier_bytes(s, Path("/dev/shm"), "host") <= HOLDS_ONE and tier_bytes(s, cache, "disk") <= DISK_HOLDS_TWO
        assert answer(model, b) == cold(model, DOCS["B"] + Q3) and answer(model, a) == cold(model, DOCS["A"] + Q3)
        assert answer(model, seen["A", tuple(Q2)]) == cold(model, DOCS["A"] + Q2)
    finally:
        assert s.stop() in (-15, 143)
    assert not list(cache.iterdir()) and not list(Path("/dev/shm").glob(f"kvpipe-cache-*-{s.proc.pid}-*"))
    assert not list(s.kv.iterdir())


@pytest.mark.parametrize("flag, value", [("--cache-mem", "abc"), ("--cache-disk", "-1GB"), ("--cache-mem", "12 parsecs")])
def test_a_bad_budget_exits_2_naming_the_flag(flag, value):
    # Fault caught: a budget that cannot be read (or a negative one) accepted, a traceback, or
    # an error that does not name the flag.
    r = subprocess.run([sys.executable, "-m", "kvpipe", "serve", "--model", "/nonexistent", f"{flag}={value}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_help_names_the_budgets_and_their_defaults():
    # Fault caught: the cache flags missing from `kvpipe serve --help`, or their defaults unsaid.
    r = subprocess.run([sys.executable, "-m", "kvpipe", "serve", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    mem, disk = text.split("--cache-mem SIZE ")[1], text.split("--cache-disk SIZE ")[1]
    assert "(default: 4GiB)" in mem[:300] and "(default: 0)" in disk[:150] and "--cache-dir DIR " in text
