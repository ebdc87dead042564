"""The OpenAI request bodies `kvpipe serve` accepts, checked field by field into a `Query`, and
its errors as OpenAI error JSON (`error.message`, `error.type`, `error.param`, `error.code`).
A field this server does not implement is refused naming it, never ignored: a client that asks
for `n: 3`, tools or logprobs learns at once that it will not get them. A bad value or a wrong
JSON type is 400 (code `invalid_type` for the latter) and a model not served here 404, as the
OpenAI API and vLLM answer them. `user` (an end-user id for the provider's abuse tracking, sent
by the openai client's `user=` and LangChain) is checked as a string and ignored, as vLLM does."""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field

from kvpipe.generation import DEFAULT_MAX_NEW_TOKENS

MAX_STOPS = 4            # as OpenAI: at most four stop strings
ROLES = ("system", "user", "assistant")
# fields that may appear only with a value that means "off" (they change nothing then)
_NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False, None, 0),
            "top_logprobs": (None, 0), "echo": (False,), "suffix": (None,), "best_of": (None, 1)}
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "user")
FIELDS = {"chat": frozenset(_COMMON + ("messages", "max_completion_tokens")),
          "completion": frozenset(_COMMON + ("prompt",))}


class ApiError(Exception):
    """An HTTP error answered as OpenAI error JSON."""

    TYPES = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        default = "invalid_request_error" if 400 <= self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, default),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Query:
    """One checked request. `messages` (chat) or `prompt` (completion: text, or token ids)."""

    kind: str                                  # "chat" or "completion"
    model: str
    messages: tuple[dict, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_tokens_given: bool = False             # False: the default, cut to the room the prompt leaves
    sampling: dict = field(default_factory=dict)   # generate()'s temperature/top_p/top_k/min_p/repetition_penalty
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _type_error(name: str, want: str, value) -> ApiError:
    return ApiError(400, f"{name}: expected {want}, got {type(value).__name__} {json.dumps(value)[:40]}",
                    param=name, code="invalid_type")


def _int(body: dict, name: str, lo: int | None = None, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if lo is not None and v < lo:
        raise ApiError(400, f"{name}: must be at least {lo}, got {v}", param=name, code="invalid_value")
    return v


def _float(body: dict, name: str, lo: float, hi: float, low_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    if not math.isfinite(v) or v > hi or v < lo or (low_open and v == lo):
        span = f"{'(' if low_open else '['}{lo}, {hi}]"
        raise ApiError(400, f"{name}: must be in {span}, got {v}", param=name, code="invalid_value")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _type_error(name, "true or false", v)
    return v


def _fields(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in FIELDS[kind]:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is not None and any(value == v and type(value) is type(v) for v in neutral):
            continue
        if name == "n":
            raise ApiError(400, f"n: only n = 1 is supported, got {json.dumps(value)}", param="n",
                           code="unsupported_value")
        what = "is not supported by kvpipe serve" if neutral is None else f"is supported only as {json.dumps(neutral[0])}"
        raise ApiError(400, f"{name}: {what}", param=name, code="unsupported_field")


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of strings", v)
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings, got {json.dumps(v)[:60]}",
                       param="stop", code="invalid_value")
    return tuple(stops)


def _content(i: int, content) -> str:
    """A message's text: a string, or OpenAI's list of text parts."""
    name = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{name}: only text parts are supported", param=name, code="unsupported_value")
        return "".join(p["text"] for p in content)
    raise _type_error(name, "a string or a list of text parts", content)


def _messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "messages: required", param="messages", code="missing_field")
    if not isinstance(msgs, list):
        raise _type_error("messages", "a list of messages", msgs)
    if not msgs:
        raise ApiError(400, "messages: must not be empty", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise ApiError(400, f"messages[{i}].{extra[0]}: is not supported by kvpipe serve",
                           param=f"messages[{i}].{extra[0]}", code="unsupported_field")
        if m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role: expected one of {', '.join(ROLES)}, got "
                                f"{json.dumps(m.get('role'))}", param=f"messages[{i}].role", code="invalid_value")
        out.append({"role": m["role"], "content": _content(i, m.get("content"))})
    if not any(m["content"].strip() for m in out):
        raise ApiError(400, "messages: every message is empty", param="messages", code="invalid_value")
    return tuple(out)


def _prompt(body: dict) -> str | tuple[int, ...]:
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "prompt: required", param="prompt", code="missing_field")
    if isinstance(p, list) and p and all(type(t) is int for t in p):   # JSON ints (not bools): no subclass
        return tuple(p)
    if isinstance(p, list):
        raise ApiError(400, "prompt: one prompt per request (a string or a list of token ids)", param="prompt",
                       code="unsupported_value")
    if not isinstance(p, str):
        raise _type_error("prompt", "a string or a list of token ids", p)
    if not p.strip():
        raise ApiError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
    return p


def check_model(model: str, served: str) -> None:
    """404 for a model this server does not serve (OpenAI's and vLLM's status for it)."""
    if model != served:
        raise ApiError(404, f"model: {model!r} is not served here (GET /v1/models: {served!r})", param="model",
                       code="model_not_found")


def parse_query(body: dict, kind: str, served: str) -> Query:
    """The checked request of endpoint `kind` (chat, completion); `served` the model's name."""
    _fields(body, kind)
    model = body.get("model")
    if model is None:
        raise ApiError(400, "model: required", param="model", code="missing_field")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    check_model(model, served)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _type_error("user", "a string", body["user"])
    which = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, which, lo=1, default=DEFAULT_MAX_NEW_TOKENS)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise _type_error("stream_options", "an object with include_usage only", opts)
    stream = _bool(body, "stream")
    if opts is not None and not stream:
        raise ApiError(400, "stream_options: only with stream true", param="stream_options", code="invalid_value")
    sampling = {"temperature": _float(body, "temperature", 0, 2), "top_p": _float(body, "top_p", 0, 1, low_open=True),
                "top_k": _int(body, "top_k", lo=0), "min_p": _float(body, "min_p", 0, 1),
                "repetition_penalty": _float(body, "repetition_penalty", 0, 10, low_open=True)}
    return Query(kind, model, _messages(body) if kind == "chat" else (),
                 _prompt(body) if kind == "completion" else None, max_tokens, body.get(which) is not None, sampling,
                 _seed(body), _stops(body), stream,
                 _bool(opts or {}, "include_usage") if opts else False, _bool(body, "ignore_eos"))


def _seed(body: dict) -> int:
    """The request's seed, or a fresh random one: a sampled request without a seed varies from one
    call to the next, as OpenAI's and vLLM's do (a chat UI's "regenerate")."""
    seed = _int(body, "seed", default=None)
    return secrets.randbits(63) if seed is None else seed
