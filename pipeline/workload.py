"""What the user asks for: prompt length, decode steps and batch size."""
from __future__ import annotations

from dataclasses import dataclass

from .units import parse_tokens


@dataclass(frozen=True)
class Workload:
    """`context` prompt tokens per sequence, then `decode_tokens` one-token decode steps.

    The first generated token comes from the prefill's logits; each decode step consumes the
    last generated token, writes its K/V and produces the next one.
    """

    context: int
    decode_tokens: int = 32
    batch: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.context) or self.context <= 0:
            raise ValueError(f"context: must be a positive token count, got {self.context!r}")
        if not _is_int(self.decode_tokens) or self.decode_tokens < 0:
            raise ValueError(f"decode_tokens: must be an integer >= 0, got {self.decode_tokens!r}")
        if not _is_int(self.batch) or self.batch <= 0:
            raise ValueError(f"batch: must be a positive integer, got {self.batch!r}")

    @classmethod
    def parse(cls, context: str | int, decode_tokens: int = 32, batch: int = 1) -> "Workload":
        return cls(parse_tokens(context, "context"), int(decode_tokens), int(batch))

    @property
    def kv_capacity(self) -> int:
        """Tokens of KV held per sequence by the end: the prompt plus every decode step."""
        return self.context + self.decode_tokens


def _is_int(v: object) -> bool:
    """An int that is not a bool (True would otherwise count as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)
