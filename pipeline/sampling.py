"""How each next token is chosen from the logits: greedy (temperature 0), or sampled after the
repetition penalty, temperature, top-k, top-p and min-p filters (in that order, as Hugging Face
applies them). A sampled run draws from a seeded counter-based noise, so a seed repeats a run
exactly whatever the placement of the KV cache."""
from __future__ import annotations

from dataclasses import dataclass, fields

FILTERS = ("top_k", "top_p", "min_p")   # they act on a sampled token only


@dataclass(frozen=True)
class Sampling:
    """`temperature` 0 is greedy (argmax); `top_k` 0, `top_p` 1 and `min_p` 0 are off;
    `repetition_penalty` 1 is off (it applies to greedy decoding too, as in HF); `seed` keys the
    sampling noise (any integer)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            want = int if f.type in (int, "int") else float
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
                raise ValueError(f"{f.name.replace('_', '-')}: expected {'an integer' if want is int else 'a number'}, got {v!r}")
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError(f"{f.name.replace('_', '-')}: must be finite, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top-k: must be >= 0 (0 is off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p: must be in (0, 1] (1 is off), got {self.top_p!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p: must be in [0, 1) (0 is off), got {self.min_p!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition-penalty: must be > 0 (1 is off), got {self.repetition_penalty!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy" + (f", repetition penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1 else "")
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        parts += [f"repetition penalty {self.repetition_penalty:g}"] if self.repetition_penalty != 1 else []
        return f"sampled ({', '.join(parts)}, seed {self.seed})"

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def choose(cls, given: dict, config: dict) -> "Sampling":
        """The sampling of a run: each field as given (None: not given), else as the model's
        generation_config sets it where it samples (`do_sample` true), else off. A config that
        does not sample gives greedy decoding unless a temperature is given, or a top-k, top-p or
        min-p filter, which samples at temperature 1 (OpenAI's default, and vLLM's): a filter is
        asked for sampling, never dropped in silence."""
        base = {}
        if config.get("do_sample"):
            base = {k: config[k] for k in ("temperature", "top_k", "top_p", "min_p") if config.get(k) is not None}
            base.setdefault("temperature", 1.0)
        if config.get("repetition_penalty") is not None:
            base["repetition_penalty"] = config["repetition_penalty"]
        given = {k: v for k, v in given.items() if v is not None}
        if "temperature" not in given and any(k in given for k in FILTERS):
            base.setdefault("temperature", 1.0)
        return cls(**{**base, **given})
