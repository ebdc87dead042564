"""kvpipe/serve/prefix_cache.py's bookkeeping against a recording fake store (the real store is
the saved-KV mechanism of `kvpipe generate`, wired separately): longest proper-prefix match, LRU
order, host RAM to disk to dropped under the two budgets, and the figures /metrics shows."""
from __future__ import annotations

import pytest

from kvpipe.serve.prefix_cache import PrefixCache

BYTES_PER_TOKEN = 10


class FakeStore:
    """Records what is kept where; a handle is (tier, tokens)."""

    def __init__(self) -> None:
        self.live: set = set()
        self.log: list = []

    def save(self, tokens):
        h = ("host", tokens)
        self.live.add(h)
        self.log.append(("save", len(tokens)))
        return h

    def nbytes(self, h) -> int:
        return len(h[1]) * BYTES_PER_TOKEN

    def move(self, h, tier):
        self.live.remove(h)
        new = (tier, h[1])
        self.live.add(new)
        self.log.append(("move", len(h[1]), tier))
        return new

    def drop(self, h) -> None:
        self.live.remove(h)
        self.log.append(("drop", len(h[1])))


def doc(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_longest_proper_prefix_wins():
    # Fault caught: a shorter prefix chosen over a longer one, a kept prompt that is not a prefix
    # matched, or the whole prompt matched (nothing left to prefill for the first logits).
    c = PrefixCache(FakeStore(), 10_000, 0)
    c.keep(doc(10))
    c.keep(doc(30))
    c.keep(doc(50, start=1))                      # same length band, different tokens
    assert c.lookup(doc(40))[1] == 30
    assert c.lookup(doc(30))[1] == 10             # equal to a kept prompt: the next shorter one
    assert c.lookup(doc(5)) == (None, 0)
    assert c.lookup((0, 1, 2, 99) + doc(20, 4))[1] == 0
    s = c.stats()
    assert s["hits_total"] == 2 and s["misses_total"] == 2 and s["cached_tokens_total"] == 40


def test_lru_moves_to_disk_then_drops_under_the_budgets():
    # Fault caught: the most recently used entry evicted instead of the least, host RAM over its
    # budget, entries dropped while disk has room, or a store handle leaked (kept but not listed).
    store = FakeStore()
    c = PrefixCache(store, mem_bytes=250, disk_bytes=250)   # 25 tokens in each tier
    a, b = doc(10), doc(12, start=100)
    c.keep(a)
    c.keep(b)
    assert c.used("host") == 220 and c.used("disk") == 0
    c.lookup(a + (7,))                           # a is now the most recent
    d = doc(11, start=200)
    c.keep(d)                                    # host 330 > 250: the oldest (b) goes to disk
    assert c.entries[b].tier == "disk" and c.entries[a].tier == "host" and c.entries[d].tier == "host"
    e, f = doc(13, start=300), doc(9, start=400)
    c.keep(e)                                    # a to disk; disk 240
    c.keep(f)                                    # d to disk; disk 350 > 250: b dropped
    assert b not in c.entries and c.used("host") <= 250 and c.used("disk") <= 250
    assert {(e_.tier, e_.tokens) for e_ in c.entries.values()} == store.live
    assert c.stats()["evictions_total"] == 1 and c.stats()["entries"] == 4


@pytest.mark.parametrize("mem, disk, kept", [(50, 0, None), (0, 200, "disk"), (500, 0, "host")])
def test_an_entry_goes_where_it_fits_or_nowhere(mem, disk, kept):
    # Fault caught: an entry larger than every budget kept (over budget), or one that fits only on
    # disk dropped instead of moved there.
    store = FakeStore()
    c = PrefixCache(store, mem, disk)
    e = c.keep(doc(20))
    assert (None if e is None else e.tier) == kept and len(store.live) == (kept is not None)
    c.clear()
    assert not store.live and c.stats()["entries"] == 0
