"""Admission by the planner: a request runs only where the plan `kvpipe generate` would run for
its prompt and `max_tokens` fits the budgets. The decision is `sim/decide.py`'s, with the budgets,
profile and target that `kvpipe.run` computes for this machine; a refusal names the numbers and
the largest context that fits."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvpipe.pipeline.units import fmt_bytes, fmt_tokens
from kvpipe.pipeline.workload import Workload


class Refused(ValueError):
    """The request does not fit the budgets; the message says by how much and what would.
    `by_prompt`: the prompt alone does not fit (with one new token), not only with max_tokens."""

    def __init__(self, message: str, by_prompt: bool) -> None:
        super().__init__(message)
        self.by_prompt = by_prompt


@dataclass(frozen=True)
class Budgets:
    """Everything the decision needs besides the workload, fixed when the server starts."""

    spec: object        # pipeline.model.ModelSpec
    profile: object     # pipeline.hardware.HardwareProfile
    budgets: dict       # bytes per pool: gpu, host, disk
    request: object     # sim.decide.Request
    target: object      # sim.decide.Target

    @classmethod
    def of(cls, model: str, options: dict) -> "Budgets":
        """As kvpipe.run derives them for `model` (a run's --model) and the plan options."""
        from kvpipe import api
        from kvpipe.inputs import check_weights
        from kvpipe.options import RunOptions
        from kvpipe.pipeline.model import load_model
        from kvpipe.sim.decide import Target
        session = api._executor()
        opts = RunOptions(model=model, **options)
        dev = session.resolve_device(opts.device)
        spec = load_model(model, opts.dtype)
        profile, budgets = api.machine(opts, session, dev)
        check_weights(spec, budgets)
        return cls(spec, profile, budgets, opts.request(spec), Target(dev.type, session.h2d_codec_runs(dev)))


class Admission:
    """`check(prompt_tokens, max_tokens)` raises Refused where no plan fits: the prompt against
    decide.max_context for that many new tokens (cached per max_tokens, milliseconds). The run's
    own decision stays the final word. First, the prompt and max_tokens must fit the smaller of
    the model's positions and the server's `capacity` (the conversation planned for it)."""

    def __init__(self, b: Budgets, capacity: int | None = None) -> None:
        self.b, self.capacity = b, capacity   # capacity: the server's context (its conversation's)
        self.largest = lru_cache(maxsize=256)(self._largest)

    def _largest(self, max_tokens: int) -> int:
        from kvpipe.sim.decide import max_context
        try:
            return max_context(self.b.spec, Workload(1, max_tokens - 1, 1), self.b.budgets, self.b.request)
        except ValueError:
            return 0

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        limit, words = self._context()
        if limit is not None and prompt_tokens + max_tokens > limit:
            raise Refused(f"the prompt's {_tokens(prompt_tokens)} plus max_tokens {max_tokens} exceed the "
                          f"{words}", prompt_tokens >= limit)
        fit = self.largest(max_tokens)
        if prompt_tokens > fit:
            budgets = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.b.budgets.items())
            raise Refused(f"{prompt_tokens} prompt + {max_tokens} new tokens do not fit the budgets ({budgets}); "
                          f"the largest prompt that fits with max_tokens {max_tokens} is {_tokens(fit)} "
                          f"({fmt_tokens(fit)})", prompt_tokens > self.largest(1))

    def room(self, prompt_tokens: int) -> int | None:
        """New tokens the context leaves after a prompt; None where no context limit binds."""
        limit, _ = self._context()
        return None if limit is None else limit - prompt_tokens

    def _context(self) -> tuple[int | None, str]:
        """The binding context limit and its words: the model's positions or the server's
        --max-context, whichever is smaller (a request past either never runs)."""
        pos, cap = self.b.spec.max_positions, self.capacity
        if cap is not None and (pos is None or cap < pos):
            return cap, f"server's context of {cap} tokens (kvpipe serve --max-context)"
        return pos, f"model's context of {pos} tokens"


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def kv_bytes(spec, plan, tokens: int) -> dict:
    """KV bytes per tier of `plan` over `tokens` positions (batch 1)."""
    unit = tokens * spec.kv_unit_bytes_per_token
    return {"gpu": plan.resident * unit, "host": (spec.units - plan.resident - plan.disk) * unit,
            "disk": plan.disk * unit}
