"""Token choice for generation: the engine asks `Decoding.pick` for each next token on the device
(greedy or sampled, pipeline/sampling.py), hands each token to the host as it is made
(`produced`), and asks before each decode step whether the generation has already finished
(`halted`: at an end-of-sequence token or a stop string, decided by the caller's `take`). Without a
Decoding the engine decodes greedily, as `kvpipe run` does.

Sampling is the Gumbel-max trick over a counter-based noise: the noise of token i, row b, vocab
entry v is a fixed hash of (seed, i, b, v) computed by tensor ops, so a sampled run repeats itself
bit for bit whatever the placement, and the same ops run eagerly or inside a CUDA graph (no host
generator state to advance). Tokens reach the host through pinned memory and CUDA events: the host
waits for a token only `LAG` steps after it was made, so the GPU never idles on the host's check;
at most `LAG` decode steps run past the end and are discarded."""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvpipe.pipeline.sampling import Sampling
from kvpipe.pipeline.stage import Phase, Stage

LAG = 2                       # decode steps the host may issue before it must know a token
_M32 = 0xFFFFFFFF
ARGMAX_PIECES = 256           # row pieces of the two-pass argmax: one per thread block of the first pass
ARGMAX_SPLIT_AT = 8192        # vocabularies below this keep torch's one pass
_MIX = 0x45D9F3B              # < 2^31: products of 32-bit values stay inside int64 (no overflow)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for logits [B, V], the same index: torch's one-row argmax is one thread block
    (27 us of a replayed step for a 128K vocabulary on the H200), so 256 row pieces' maxima come
    first, then their argmax. Both passes keep the first maximal index (torch documents it), so
    ties and NaN resolve as argmax's do."""
    B, V = x.shape
    if V < ARGMAX_SPLIT_AT:
        return x.argmax(-1)
    pad = -V % ARGMAX_PIECES
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    best, where = x.view(B, ARGMAX_PIECES, -1).max(-1)
    piece = best.argmax(-1, keepdim=True)
    return (piece * ((V + pad) // ARGMAX_PIECES) + where.gather(-1, piece)).squeeze(-1)


def token_row(ids) -> torch.Tensor:
    """[1, n] int64 on the CPU of n token ids (ints): through numpy, 2 ms for a 128K-token prompt
    where torch.tensor of the list takes 40 (host time before every request's first token)."""
    return torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=len(ids))).view(1, -1)


def _keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys of any integer seed (a stable hash, not Python's salted one)."""
    d = hashlib.sha256(str(int(seed)).encode()).digest()
    return int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * _MIX) & _M32
    h = h ^ (h >> 16)
    h = (h * _MIX) & _M32
    return h ^ (h >> 16)


def gumbel(counter: torch.Tensor, keys: tuple[int, int]) -> torch.Tensor:
    """Standard Gumbel noise, fp32, one value per non-negative int64 counter."""
    h = _mix((counter & _M32) ^ keys[0])
    h = _mix(h ^ (counter >> 32) ^ keys[1])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))   # (0, 1), 24 bits
    return -torch.log(-torch.log(u))


class Sampler:
    """Chooses token `i` of each row from its logits [B, V] fp32, on the device; also keeps a
    checksum of every step's logits (`sums` [N, B, 2] int64: equal sums, equal bits, in practice)."""

    def __init__(self, sampling: Sampling, prompt: torch.Tensor, vocab: int, n_tokens: int) -> None:
        B, device = prompt.shape[0], prompt.device                       # prompt [B, ctx] long
        self.s, self.keys = sampling, _keys(sampling.seed)
        self.index = torch.arange(n_tokens, device=device)               # i -> a device index
        self.sums = torch.zeros(n_tokens, B, 2, dtype=torch.int64, device=device)
        self.coef = torch.arange(vocab, dtype=torch.int64, device=device) * 2 + 1   # odd: no bit is lost
        self.counter = (torch.arange(B, device=device).view(B, 1) * vocab
                        + torch.arange(vocab, device=device))            # [B, V]
        self.stride = B * vocab
        self.seen = None                                                 # [B, V] bool: in prompt or output
        if sampling.repetition_penalty != 1:
            self.seen = torch.zeros(B, vocab, dtype=torch.bool, device=device)
            self.seen.scatter_(1, prompt, True)

    def __call__(self, logits: torch.Tensor, i: int | torch.Tensor) -> torch.Tensor:
        """Token ids [B] long; `i` the token's index in the output (a host int, or a one-element
        device tensor inside a replayed step)."""
        i = self.index[i:i + 1] if isinstance(i, int) else i.reshape(1)
        B = logits.shape[0]
        self.sums.index_copy_(0, i, self._checksum(logits).view(1, B, 2))
        x = logits
        if self.seen is not None:
            p = self.s.repetition_penalty
            x = torch.where(self.seen, torch.where(x > 0, x / p, x * p), x)
        if self.s.greedy:
            ids = argmax_rows(x)
        else:
            x = self._filter(x / self.s.temperature)
            ids = argmax_rows(x + gumbel(self.counter + i * self.stride, self.keys))
        if self.seen is not None:
            self.seen.scatter_(1, ids.view(B, 1), True)
        return ids

    def _checksum(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, 2] int64: the logits' bits as 16-bit halves, each weighted by an odd coefficient per
        vocab entry and summed (within int64 for any vocabulary under 2^26)."""
        bits = logits.view(torch.int32).to(torch.int64) & _M32            # [B, V] in [0, 2^32)
        return torch.stack([((bits & 0xFFFF) * self.coef).sum(-1), ((bits >> 16) * self.coef).sum(-1)], -1)

    def _filter(self, x: torch.Tensor) -> torch.Tensor:
        """top-k, then top-p (the smallest set of tokens whose probability reaches p), then
        min-p (tokens below min_p times the likeliest one's probability), each as -inf."""
        s, V = self.s, x.shape[-1]
        if 0 < s.top_k < V:
            kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if s.top_p < 1:
            p, order = torch.softmax(x, -1).sort(-1, descending=True)
            drop = (p.cumsum(-1) - p) >= s.top_p                          # mass before it already reaches p
            x = x.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
        if s.min_p > 0:
            p = torch.softmax(x, -1)
            x = x.masked_fill(p < s.min_p * p.amax(-1, keepdim=True), float("-inf"))
        return x


class Decoding:
    """The engine's token seam for one generation of `n_tokens` tokens at most (batch 1).
    `take(i, token) -> bool` is called on the host for each token in order, always on the thread
    that runs the generation; True: the generation ends with token i (decode steps from i on are
    not needed)."""

    def __init__(self, sampling: Sampling, prompt_ids: list[int], vocab: int, n_tokens: int,
                 device: torch.device, take: Callable[[int, int], bool], lag: int = LAG) -> None:
        self.device, self.cuda = torch.device(device), torch.device(device).type == "cuda"
        prompt = token_row(prompt_ids).to(self.device)
        self.sampler = Sampler(sampling, prompt, vocab, n_tokens)
        self.take, self.lag = take, lag
        self.host = torch.empty(n_tokens, dtype=torch.long, pin_memory=self.cuda)
        self.events: list[torch.cuda.Event | None] = [None] * n_tokens
        self.made = 0          # tokens copied (or being copied) to `host`
        self.seen = 0          # tokens handed to `take`
        self.stop_at: int | None = None   # the first decode step not needed
        # halted() may be asked from several threads: one drain at a time hands each token over once
        self.lock = threading.Lock()

    def pick(self, logits: torch.Tensor, i: int | torch.Tensor) -> torch.Tensor:
        return self.sampler(logits, i)

    def produced(self, tokens: torch.Tensor, i: int) -> None:
        """Token i was written to tokens[:, i] on the current stream: bring it to the host."""
        if self.cuda:
            self.host[i:i + 1].copy_(tokens[0, i:i + 1], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.events[i] = ev
        else:
            self.host[i] = tokens[0, i]
        self.made = i + 1

    def halted(self, step: int, wait: bool, drain: bool = True) -> bool:
        """Whether decode step `step` is past the end. `wait`: this step's issue may wait for the
        token `LAG` steps back (the compute lane's embed; never inside a graph capture). `drain`
        False: only what is already known (a lane's worker thread)."""
        if self.stop_at is None and drain:
            self._drain(step - self.lag if wait else -1, block=wait)
        return self.stop_at is not None and step >= self.stop_at

    def gate(self, issue: Callable[[Stage], None]) -> Callable[[Stage], None]:
        """`issue` for the lane actors, with the stages of decode steps past the end skipped.
        Called on the thread that runs the lanes; the host lanes' stages pass the gate on worker
        threads, which hand no token over: `take` (its stream, a Ctrl-C handler) stays on this one."""
        owner = threading.get_ident()

        def gated(s: Stage) -> None:
            if s.phase is Phase.DECODE and self.halted(s.step, s.tag == "embed", threading.get_ident() == owner):
                return
            issue(s)
        return gated

    def finish(self) -> int:
        """After the run: every token made handed over; returns how many the output keeps."""
        self._drain(self.made)
        return self.made if self.stop_at is None else self.stop_at + 1

    def _drain(self, until: int, block: bool = True) -> None:
        """Hand over the tokens that have reached the host, waiting for those up to `until`
        (`block` False: nothing when another thread is already handing them over)."""
        if not self.lock.acquire(blocking=block):
            return
        try:
            self._drain_locked(until)
        finally:
            self.lock.release()

    def _drain_locked(self, until: int) -> None:
        while self.stop_at is None and self.seen < self.made:
            ev = self.events[self.seen]
            if ev is not None and not ev.query():
                if self.seen > until:
                    return
                ev.synchronize()
            if self.take(self.seen, int(self.host[self.seen])):
                self.stop_at = self.seen
            self.seen += 1

    def digest(self, n: int) -> str:
        """sha256 of the first n tokens and their steps' logits checksums."""
        h = hashlib.sha256()
        h.update(self.host[:n].numpy().tobytes())
        h.update(self.sampler.sums[:n].cpu().numpy().tobytes())
        return h.hexdigest()
