"""The OpenAI response objects: `chat.completion` and `text_completion` whole, their streamed
chunks, `usage` (with `prompt_tokens_details.cached_tokens`), ids and `created` as the API has
them; and the prompt's token ids as `kvpipe generate` makes them (the chat template through the
tokenizer, or the plain text)."""
from __future__ import annotations

import time
import uuid

from .protocol import ApiError, Query


def prompt_ids(tok, q: Query) -> list[int]:
    """Token ids of the request: for chat, the messages through the tokenizer's chat template with
    the assistant's turn opened (what `kvpipe generate` does for one user turn); for completions,
    the text tokenized plainly (`--no-chat`) or the ids as given."""
    vocab = len(tok)
    if q.kind == "chat":
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "messages: the model's tokenizer has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        ids = tok.apply_chat_template(list(q.messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    if isinstance(q.prompt, tuple):
        bad = [] if 0 <= min(q.prompt) and max(q.prompt) < vocab else [i for i in q.prompt if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})",
                           param="prompt", code="invalid_value")
        return list(q.prompt)
    ids = tok(q.prompt)["input_ids"]
    if not ids:
        raise ApiError(400, "prompt: tokenizes to no tokens", param="prompt", code="invalid_value")
    return list(ids)


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _cached(res) -> int:
    """Prompt tokens whose KV was kept from an earlier request (not prefilled again)."""
    return int(res.timings.get("reused_tokens", 0))


def _head(q: Query, name: str, chunk: bool = False) -> dict:
    prefix, obj = ("chatcmpl", "chat.completion") if q.kind == "chat" else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj + (".chunk" if chunk and q.kind == "chat" else ""),
            "created": int(time.time()), "model": name, "system_fingerprint": None}


def _finish(res) -> str:
    return res.finish_reason if res.finish_reason in ("stop", "length") else "stop"


def whole(name: str, q: Query, prompt_tokens: int, res) -> dict:
    """The non-streamed answer of GenerateResult `res`."""
    out = _head(q, name)
    text = res.text or ""
    if q.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": _finish(res)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(res)}
    return {**out, "choices": [choice], "usage": usage(prompt_tokens, len(res.tokens), _cached(res))}


class Stream:
    """The chunks of one streamed answer, all under one id and `created`."""

    def __init__(self, name: str, q: Query, prompt_tokens: int) -> None:
        self.q, self.prompt_tokens = q, prompt_tokens
        self.head = _head(q, name, chunk=True)
        if q.include_usage:
            self.head["usage"] = None   # as OpenAI: every chunk has usage null but the last

    def _chunk(self, choice: dict | None) -> dict:
        return {**self.head, "choices": [] if choice is None else [{"index": 0, "logprobs": None, **choice}]}

    def _piece(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.q.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            return self._chunk({"delta": delta, "finish_reason": finish})
        return self._chunk({"text": text or "", "finish_reason": finish})

    def start(self) -> list[dict]:
        """Chat's first chunk carries the role; a completion has none, so it starts with its text."""
        return [self._piece("", None, role=True)] if self.q.kind == "chat" else []

    def delta(self, text: str) -> dict:
        return self._piece(text, None)

    def end(self, res) -> list[dict]:
        last = [self._piece(None, _finish(res))]
        if self.q.include_usage:
            u = self._chunk(None)
            u["usage"] = usage(self.prompt_tokens, len(res.tokens), _cached(res))
            last.append(u)
        return last
