"""The kept prompt prefixes of `kvpipe serve`: a request whose prompt extends a prompt seen before
continues from that prompt's KV instead of prefilling it again. Entries live in host RAM, then on
disk, each tier under its byte budget (`--cache-mem`, `--cache-disk`): the least recently used
entry of host RAM moves to disk when host RAM is over budget, and the least recently used entry
on disk is dropped when disk is. A lookup takes the longest kept prompt that is a proper prefix of
the request's tokens (at least one token is left to prefill, so the first new logits come from a
real forward step).

The KV itself is kept by a `Store` (the saved-KV mechanism of `kvpipe generate`); this module
decides only what is kept where, and is tested against a fake store."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

TIERS = ("host", "disk")


class Store(Protocol):
    """Where kept KV lives. `save(tokens)` keeps the KV of prompt `tokens` in host RAM and returns
    its handle; `nbytes(handle)`; `move(handle, "disk")` returns the handle of the same KV on
    disk; `drop(handle)` frees it. Continuing from a handle is the generation's business
    (`load(handle)` there), not this cache's."""

    def save(self, tokens: tuple[int, ...]) -> object: ...
    def nbytes(self, handle: object) -> int: ...
    def move(self, handle: object, tier: str) -> object: ...
    def drop(self, handle: object) -> None: ...


@dataclass
class Entry:
    tokens: tuple[int, ...]
    handle: object
    nbytes: int
    tier: str       # "host" or "disk"


class PrefixCache:
    """LRU of kept prefixes over two byte budgets. `lookup(tokens)` -> (Entry or None, cached
    tokens); `keep(tokens)` saves a prompt's KV through the store and evicts what the budgets
    cannot hold; `stats()` the figures /metrics shows."""

    def __init__(self, store: Store, mem_bytes: int, disk_bytes: int) -> None:
        if mem_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"cache-mem: budgets must not be negative, got {mem_bytes}, {disk_bytes}")
        self.store, self.budget = store, {"host": mem_bytes, "disk": disk_bytes}
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()   # oldest first
        self.hits = self.misses = self.evictions = self.moves = self.cached_tokens = 0

    def used(self, tier: str) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.tier == tier)

    def lookup(self, tokens: tuple[int, ...] | list[int]) -> tuple[Entry | None, int]:
        tokens = tuple(tokens)
        best = None
        for e in self.entries.values():
            n = len(e.tokens)
            if n < len(tokens) and (best is None or n > len(best.tokens)) and tokens[:n] == e.tokens:
                best = e
        if best is None:
            self.misses += 1
            return None, 0
        self.entries.move_to_end(best.tokens)
        self.hits += 1
        self.cached_tokens += len(best.tokens)
        return best, len(best.tokens)

    def keep(self, tokens: tuple[int, ...] | list[int]) -> Entry | None:
        """Keep the KV of prompt `tokens` (most recently used); None where no budget can hold it."""
        tokens = tuple(tokens)
        if tokens in self.entries:
            self.entries.move_to_end(tokens)
            return self.entries[tokens]
        handle = self.store.save(tokens)
        e = Entry(tokens, handle, self.store.nbytes(handle), "host")
        if e.nbytes > max(self.budget.values()):
            self.store.drop(handle)
            return None
        self.entries[tokens] = e
        self._fit()
        return self.entries.get(tokens)

    def _fit(self) -> None:
        """Oldest host entries to disk while host RAM is over budget, oldest disk entries dropped
        while disk is (an entry that fits neither is dropped)."""
        for e in list(self.entries.values()):
            if self.used("host") <= self.budget["host"]:
                break
            if e.tier == "host":
                if e.nbytes <= self.budget["disk"]:
                    e.handle, e.tier = self.store.move(e.handle, "disk"), "disk"
                    self.moves += 1
                else:
                    self._evict(e)
        for e in list(self.entries.values()):
            if self.used("disk") <= self.budget["disk"]:
                break
            if e.tier == "disk":
                self._evict(e)

    def _evict(self, e: Entry) -> None:
        self.store.drop(e.handle)
        del self.entries[e.tokens]
        self.evictions += 1

    def clear(self) -> None:
        """Drop everything (the server stops: no kept KV outlives it)."""
        for e in list(self.entries.values()):
            self.store.drop(e.handle)
        self.entries.clear()

    def stats(self) -> dict:
        return {"entries": len(self.entries), "host_bytes": self.used("host"), "disk_bytes": self.used("disk"),
                "hits_total": self.hits, "misses_total": self.misses, "evictions_total": self.evictions,
                "cached_tokens_total": self.cached_tokens}
