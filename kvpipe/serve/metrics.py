"""The server's counters, gauges and histograms, written in the Prometheus text exposition format
(version 0.0.4) by hand: a few dozen lines instead of a dependency. Updated from the event loop
and the engine's worker thread, hence the lock."""
from __future__ import annotations

import threading
from collections import defaultdict

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 600)
DECODE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TIERS = ("gpu", "host", "disk")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum}", f"{name}_count {self.n}"]


class Metrics:
    """What /metrics shows. `requests[(endpoint, status)]`; tokens; TTFT and decode time per
    token; the KV bytes per tier of the running generation (its prompt and max_tokens) or, between
    requests, of the tokens kept home; queue depth; cancels; prompt tokens reused (prefix hits)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = self.completion_tokens = self.cancelled = 0
        self.cached_tokens = self.prefix_hits = self.kept_tokens = 0
        self.ttft, self.decode = Histogram(TTFT_BUCKETS_S), Histogram(DECODE_BUCKETS_S)
        self.kv = dict.fromkeys(TIERS, 0)
        self.queue_depth = self.running = 0
        self.cache: dict[str, float] = {}      # prefix cache figures (prefix_cache.PrefixCache.stats)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def started(self, kv: dict) -> None:
        with self.lock:
            self.running, self.kv = 1, dict(kv)

    def finished(self, prompt: int, completion: int, ttft_s: float | None, per_token_s: float | None,
                 cancelled: bool, cached: int = 0, kept: int = 0, kv: dict | None = None) -> None:
        """`cached` prompt tokens it reused; `kept` tokens and `kv` bytes per tier home after it."""
        with self.lock:
            self.running, self.kv = 0, dict(kv or dict.fromkeys(TIERS, 0))
            self.cached_tokens += cached
            self.prefix_hits += int(cached > 0)
            self.kept_tokens = kept
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.cancelled += int(cancelled)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if per_token_s is not None:
                self.decode.observe(per_token_s)

    def cache_stats(self, stats: dict) -> None:
        with self.lock:
            self.cache = dict(stats)

    def render(self) -> str:
        with self.lock:
            m = ["# HELP kvpipe_requests_total HTTP requests answered, by endpoint and status",
                 "# TYPE kvpipe_requests_total counter"]
            m += [f'kvpipe_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())]
            m += _one("prompt_tokens_total", "counter", "prompt tokens of finished generations", self.prompt_tokens)
            m += _one("completion_tokens_total", "counter", "generated tokens", self.completion_tokens)
            m += _one("cached_prompt_tokens_total", "counter", "prompt tokens whose KV was kept from an earlier "
                      "request (not prefilled again)", self.cached_tokens)
            m += _one("prefix_hits_total", "counter", "requests that reused kept prompt tokens", self.prefix_hits)
            m += _one("kept_tokens", "gauge", "tokens whose KV is kept home between requests", self.kept_tokens)
            m += _one("cancelled_total", "counter", "generations stopped because the client went away", self.cancelled)
            m += ["# HELP kvpipe_ttft_seconds time to first token (the prefill, measured by the engine)",
                  "# TYPE kvpipe_ttft_seconds histogram", *self.ttft.lines("kvpipe_ttft_seconds"),
                  "# HELP kvpipe_decode_seconds_per_token decode time per generated token",
                  "# TYPE kvpipe_decode_seconds_per_token histogram",
                  *self.decode.lines("kvpipe_decode_seconds_per_token"),
                  "# HELP kvpipe_kv_bytes KV bytes per tier of the running generation, else of the kept tokens",
                  "# TYPE kvpipe_kv_bytes gauge"]
            m += [f'kvpipe_kv_bytes{{tier="{t}"}} {self.kv[t]}' for t in TIERS]
            m += _one("queue_depth", "gauge", "admitted requests waiting for the engine", self.queue_depth)
            m += _one("running", "gauge", "generations on the engine (0 or 1)", self.running)
            m += _cache(self.cache)
        return "\n".join(m) + "\n"


CACHE_COUNTERS = {"hits_total": "requests continued from a kept entry of the prefix cache",
                  "misses_total": "requests for which no kept entry shared more than the tokens home",
                  "evictions_total": "entries dropped to keep the budgets",
                  "spills_total": "entries moved from host RAM to disk to keep the host budget",
                  "load_failures_total": "entries dropped because they could not be loaded (checksum, file)",
                  "cached_tokens_total": "prompt tokens loaded from kept entries"}
CACHE_GAUGES = {"bytes": "bytes of the kept entries, per tier", "entries": "kept entries, per tier",
                "budget_bytes": "the budget of the kept entries, per tier (--cache-mem, --cache-disk)"}


def _cache(stats: dict) -> list[str]:
    """The prefix cache's figures (prefix_cache.PrefixCache.stats); none without a cache."""
    if not stats:
        return []
    m = []
    for k, help_ in CACHE_COUNTERS.items():
        m += _one(f"prefix_cache_{k}", "counter", f"prefix cache: {help_}", stats[k])
    for k, help_ in CACHE_GAUGES.items():
        m += [f"# HELP kvpipe_prefix_cache_{k} prefix cache: {help_}", f"# TYPE kvpipe_prefix_cache_{k} gauge"]
        m += [f'kvpipe_prefix_cache_{k}{{tier="{t}"}} {stats[f"{t}_{k}"]}' for t in ("host", "disk")]
    return m


def _one(name: str, kind: str, help_: str, value) -> list[str]:
    return [f"# HELP kvpipe_{name} {help_}", f"# TYPE kvpipe_{name} {kind}", f"kvpipe_{name} {value}"]
