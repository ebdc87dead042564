"""The access log of `kvpipe serve`: one line per request on the `kvpipe` logger when its answer
has ended (a stream included), with the client, method, path, status and seconds, and for a
completion its prompt and generated tokens and its time to first token."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """What a completion route tells the access line (on `request.state.completion`)."""

    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None   # None: no token came


class AccessLog:
    """ASGI middleware: logs each HTTP request once its response is sent (or has failed)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.monotonic(), []

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:   # a route that raised past every handler is answered 500 by the server's outer layer
            log.info(line(scope, status[0] if status else 500, time.monotonic() - t0))


def line(scope, status: int, total_s: float) -> str:
    client = scope.get("client")
    who = client[0] if client else "-"
    said = f'{who} "{scope["method"]} {scope["path"]}" {status} in {total_s:.3f} s'
    state = scope.get("state", {})
    if state.get("gone"):   # a stream whose client left: its 200 went out before the answer ended
        said += " (client gone, answer stopped)"
    done = state.get("completion")
    if done is None:
        return said
    ttft = "no token" if done.ttft_s is None else f"TTFT {done.ttft_s:.3f} s"
    return f"{said}: {done.prompt_tokens} prompt + {done.generated_tokens} generated tokens, {ttft}"
