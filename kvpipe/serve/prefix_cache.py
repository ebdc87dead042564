"""The kept prompt prefixes of `kvpipe serve` beside its live conversation: an LRU of entries in
two tiers, host RAM then disk, each under its byte budget (`--cache-mem`, `--cache-disk`). A new
entry goes to host RAM when it fits the budget there, else to disk; room is made first, least
recently used entry first: a host entry spills to disk when the disk budget can hold it, else it
is dropped, and a disk entry is dropped. Entries are sized by the bytes their store reports.

`best(tokens)` is the entry sharing the longest common prefix of whole tokens with a request (at
least one); `take(entry)` hands it over to the caller, who continues from it (the entry's KV then
lives in the conversation, and comes back as a new entry when the conversation leaves it).

The KV itself is kept by a `Store` (cache_store.py: KV directories of executor/kv/saved.py);
this module decides only what is kept where, and is tested against a fake store too."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

from kvpipe.conversation import common_prefix

TIERS = ("host", "disk")


class Store(Protocol):
    """Where kept KV lives. `new(tier)` a fresh empty handle in `tier`; `nbytes(handle)` the bytes
    it holds; `move(handle, tier)` the same KV in another tier (the old handle gone); `drop(handle)`
    frees it."""

    def new(self, tier: str) -> object: ...
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
    """LRU of kept prefixes over two byte budgets; `stats()` the figures /metrics shows."""

    def __init__(self, store: Store, mem_bytes: int, disk_bytes: int) -> None:
        for flag, v in (("cache-mem", mem_bytes), ("cache-disk", disk_bytes)):
            if v < 0:
                raise ValueError(f"{flag}: a budget must not be negative, got {v}")
        self.store, self.budget = store, {"host": mem_bytes, "disk": disk_bytes}
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()   # least recently used first
        self.hits = self.misses = self.evictions = self.spills = self.failures = self.cached_tokens = 0

    @property
    def enabled(self) -> bool:
        return any(self.budget.values())

    def used(self, tier: str) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.tier == tier)

    def best(self, tokens) -> tuple[Entry | None, int]:
        """The entry sharing the longest common prefix with `tokens` (ties: the most recent)."""
        best, n = None, 0
        for e in reversed(self.entries.values()):
            k = common_prefix(e.tokens, tokens)
            if k > n:
                best, n = e, k
        return best, n

    def take(self, e: Entry) -> Entry:
        """Hand `e` over (out of the index; its handle the caller's to load, then drop)."""
        del self.entries[e.tokens]
        return e

    def hit(self, n: int) -> None:
        self.hits += 1
        self.cached_tokens += n

    def miss(self) -> None:
        self.misses += 1

    def failed(self) -> None:
        """An entry that could not be loaded (a checksum, a missing file) was dropped."""
        self.failures += 1

    def keep(self, tokens, write: Callable[[object], None], predicted_bytes: int) -> Entry | None:
        """Keep the KV of `tokens` (most recently used), written by `write(handle)`, about
        `predicted_bytes` (room is made for it first); None where no budget can hold it. An entry
        whose tokens start `tokens` is replaced (this one holds it); where an entry already holds
        `tokens`, nothing is written."""
        tokens = tuple(tokens)
        for e in list(self.entries.values()):
            if e.tokens[:len(tokens)] == tokens:
                self.entries.move_to_end(e.tokens)
                return e
            if tokens[:len(e.tokens)] == e.tokens:
                self._drop(e)
        tier = next((t for t in TIERS if 0 < predicted_bytes <= self.budget[t]), None)
        if tier is None:
            return None
        self._room(tier, predicted_bytes)
        handle = self.store.new(tier)
        try:
            write(handle)
        except BaseException:
            self.store.drop(handle)
            raise
        self.entries[tokens] = Entry(tokens, handle, self.store.nbytes(handle), tier)
        self._room(tier, 0)     # the real size, should it exceed the prediction
        return self.entries.get(tokens)

    def _room(self, tier: str, extra: int) -> None:
        """Least recently used entries of `tier` out until `extra` more bytes fit its budget."""
        while self.used(tier) + extra > self.budget[tier]:
            victim = next((e for e in self.entries.values() if e.tier == tier), None)
            if victim is None:
                return
            if tier == "host" and 0 < victim.nbytes <= self.budget["disk"]:
                self._room("disk", victim.nbytes)
                victim.handle, victim.tier = self.store.move(victim.handle, "disk"), "disk"
                self.spills += 1
            else:
                self._drop(victim)
                self.evictions += 1

    def _drop(self, e: Entry) -> None:
        del self.entries[e.tokens]
        self.store.drop(e.handle)

    def clear(self) -> None:
        """Drop everything (the server stops: no kept KV outlives it)."""
        for e in list(self.entries.values()):
            self._drop(e)

    def stats(self) -> dict:
        return {"hits_total": self.hits, "misses_total": self.misses, "evictions_total": self.evictions,
                "spills_total": self.spills, "load_failures_total": self.failures,
                "cached_tokens_total": self.cached_tokens,
                **{f"{t}_bytes": self.used(t) for t in TIERS},
                **{f"{t}_entries": sum(e.tier == t for e in self.entries.values()) for t in TIERS},
                **{f"{t}_budget_bytes": self.budget[t] for t in TIERS}}
