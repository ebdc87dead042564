"""kvpipe/serve/prefix_cache.py's bookkeeping against a recording fake store (the real store,
KV directories, is tested through the server in test_serve_cache.py): the longest common prefix
wins, LRU order, host RAM to disk to dropped under the two budgets, covered entries replaced, and
the figures /metrics shows."""
from __future__ import annotations

import pytest

from kvpipe.serve.prefix_cache import PrefixCache

BYTES_PER_TOKEN = 10


class FakeStore:
    """Records what is kept where; a handle is [tier, bytes written]."""

    def __init__(self) -> None:
        self.live: list = []
        self.log: list = []

    def new(self, tier):
        h = [tier, 0]
        self.live.append(h)
        return h

    def nbytes(self, h) -> int:
        return h[1]

    def move(self, h, tier):
        self.live.remove(h)
        new = [tier, h[1]]
        self.live.append(new)
        self.log.append(("move", h[1], tier))
        return new

    def drop(self, h) -> None:
        self.live.remove(h)
        self.log.append(("drop", h[1]))


def doc(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def keep(c: PrefixCache, tokens, predicted: int | None = None):
    def write(h):
        h[1] = len(tokens) * BYTES_PER_TOKEN
    return c.keep(tokens, write, predicted or len(tokens) * BYTES_PER_TOKEN)


def test_longest_common_prefix_wins():
    # Fault caught: a shorter shared prefix chosen over a longer one (the first match taken), an
    # entry sharing nothing matched, a match that counts past the first differing token, or a tie
    # given to the older entry.
    c = PrefixCache(FakeStore(), 10_000, 0)
    keep(c, doc(10))
    keep(c, doc(30, start=100))
    keep(c, doc(50, start=1))
    keep(c, (0, 1, 2, 50, 51))                         # newer, shares less with doc(20) than doc(10)
    assert c.best(doc(20))[1] == 10
    assert c.best(doc(40, start=100))[1] == 30
    assert c.best(doc(8) + (99, 9))[1] == 8           # shares 8 tokens, then differs (token 9 again)
    assert c.best(doc(5, start=1000)) == (None, 0)
    e, n = c.best(doc(20, start=1))
    assert n == 20 and e.tokens == doc(50, start=1)
    c.take(e)
    c.hit(n)
    assert len(c.entries) == 3 and c.stats()["hits_total"] == 1 and c.stats()["cached_tokens_total"] == 20
    keep(c, doc(30, start=100) + (500,))               # replaces doc(30, 100), which it extends
    keep(c, doc(30, start=100) + (600,))
    assert c.best(doc(30, start=100) + (700,))[0].tokens[-1] == 600   # a tie: the most recent wins


def test_lru_spills_to_disk_then_drops_under_the_budgets():
    # Fault caught: the most recently used entry evicted instead of the least, host RAM over its
    # budget, an entry dropped while disk has room, or a store handle leaked (kept but not listed).
    store = FakeStore()
    c = PrefixCache(store, mem_bytes=250, disk_bytes=250)   # 25 tokens in each tier
    a, b = doc(10), doc(12, start=100)
    keep(c, a)
    keep(c, b)
    assert c.used("host") == 220 and c.used("disk") == 0
    c.entries.move_to_end(a)                     # a is now the most recent
    d = doc(11, start=200)
    keep(c, d)                                   # host 330 > 250: the oldest (b) goes to disk
    assert c.entries[b].tier == "disk" and c.entries[a].tier == "host" and c.entries[d].tier == "host"
    e, f = doc(13, start=300), doc(9, start=400)
    keep(c, e)                                   # a to disk; disk 220
    keep(c, f)                                   # d to disk: disk 330 > 250, b (oldest) dropped
    assert b not in c.entries and c.used("host") <= 250 and c.used("disk") <= 250
    assert sorted(map(tuple, store.live)) == sorted((x.tier, x.nbytes) for x in c.entries.values())
    s = c.stats()
    assert s["evictions_total"] == 1 and s["spills_total"] == 3 and s["host_entries"] + s["disk_entries"] == 4


def test_room_is_made_for_the_prediction_and_too_large_is_not_kept():
    # Fault caught: room made only after writing (the tier above its budget while it writes), or
    # an entry larger than both budgets written anyway.
    store = FakeStore()
    c = PrefixCache(store, mem_bytes=300, disk_bytes=0)
    keep(c, doc(10))
    keep(c, doc(10, start=50), predicted=250)    # 100 + 250 > 300: the first is dropped before
    assert list(c.entries) == [doc(10, start=50)] and c.evictions == 1
    assert keep(c, doc(40, start=900)) is None and len(store.live) == 1


def test_a_covered_entry_is_replaced_and_a_held_one_not_written_again():
    # Fault caught: an entry kept twice (its prefix's bytes counted twice), or an entry whose
    # tokens the new one extends left behind.
    store = FakeStore()
    c = PrefixCache(store, 10_000, 0)
    keep(c, doc(10))
    keep(c, doc(20))                             # extends the first: it replaces it
    assert list(c.entries) == [doc(20)] and len(store.live) == 1
    assert keep(c, doc(15)).tokens == doc(20) and len(store.live) == 1


def test_clear_drops_everything_and_budgets_are_checked():
    # Fault caught: entries (their files) left after clear(), or a negative budget accepted.
    store = FakeStore()
    c = PrefixCache(store, 100, 100)
    keep(c, doc(5))
    keep(c, doc(5, start=9))
    c.clear()
    assert not store.live and not c.entries
    with pytest.raises(ValueError, match="cache-disk"):
        PrefixCache(store, 1, -1)
