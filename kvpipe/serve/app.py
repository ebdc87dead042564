"""The HTTP routes of `kvpipe serve` (FastAPI): the OpenAI chat and completion endpoints,
streamed as server-sent events or answered whole, `/v1/models`, `/health` and `/metrics`. Every
failure is OpenAI error JSON with its status, never a traceback. `--api-key` guards the `/v1`
routes only. A request's life: bearer key checked in constant time, body read under the size
limit, fields checked (protocol.py), prompt
tokenized and admitted by the planner (admission.py), queued on the engine (engine.py); while it
waits or streams, a client that goes away cancels it."""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from . import responses
from .access import AccessLog, Completion
from .admission import Refused
from .engine import Engine, Job
from .metrics import CONTENT_TYPE, Metrics
from .protocol import ApiError, check_model, parse_body, parse_query

POLL_S = 0.25   # how often a waiting request checks that its client is still there


class Disconnected(Exception):
    """The client went away before its answer began."""


@dataclass
class Server:
    """What the routes share: the served model's name and tokenizer, the engine and its parts."""

    name: str
    tokenizer: object
    admission: object
    engine: Engine
    metrics: Metrics
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    access_log: bool = True   # one line per request on stderr (access.py)
    created: int = field(default_factory=lambda: int(time.time()))   # /v1/models' `created`: when it started


UNMATCHED = "unmatched"   # the name of /v1's catch-all route


def _endpoint(request: Request) -> str:
    """The /metrics label of a request: its route's template (`/v1/models/{model:path}`), or
    `unmatched`; never the raw path, which any client could make a new series of each time."""
    route = request.scope.get("route")
    return "unmatched" if getattr(route, "name", None) == UNMATCHED else getattr(route, "path", None) or "unmatched"


def create_app(s: Server) -> FastAPI:
    app = FastAPI(title="kvpipe", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(s))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        s.metrics.request(_endpoint(request), e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):   # unknown route, wrong method
        return await api_error(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        return await api_error(request, ApiError(500, f"internal error: {type(e).__name__}"))

    # open with --api-key too: a load balancer's probe and a Prometheus scraper carry no key
    @app.get("/health")
    async def health():
        return {"status": "stopping" if s.engine.stopping else "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(s.metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(_v1(s))
    if s.access_log:
        app.add_middleware(AccessLog)
    return app


def _v1(s: Server) -> APIRouter:
    """The OpenAI routes, every one behind the API key (checked before the body is read)."""
    def key(request: Request) -> None:
        _auth(s, request)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model(s)]}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        check_model(model, s.name)
        return _model(s)

    @v1.post("/chat/completions")
    async def chat(request: Request):
        return await _complete(s, request, "chat")

    @v1.post("/completions")
    async def completions(request: Request):
        return await _complete(s, request, "completion")

    known = {r.path for r in v1.routes}

    # last: any other /v1 path passes the key first, so without it nothing says which paths exist
    # (401, as vLLM); with it, 404, or 405 for a known path asked with another method
    @v1.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], name=UNMATCHED)
    async def unmatched(request: Request, rest: str):
        if any(r.path_regex.match(request.url.path) for r in v1.routes if r.path in known):
            raise ApiError(405, f"{request.method} {request.url.path}: Method Not Allowed")
        raise ApiError(404, f"{request.method} {request.url.path}: Not Found")

    return v1


def _model(s: Server) -> dict:
    return {"id": s.name, "object": "model", "created": s.created, "owned_by": "kvpipe"}


def _lifespan(s: Server):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def life(app):
        s.engine.start()
        yield
        await asyncio.to_thread(s.engine.stop)   # in-flight work cancelled, its KV files removed
    return life


def _auth(s: Server, request: Request) -> None:
    if s.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), s.api_key.encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


async def _body(s: Server, request: Request) -> bytes:
    """The body, refused with 413 past the limit (by its Content-Length, or as it arrives)."""
    size = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body exceeds {s.max_body_bytes} bytes", code="body_too_large")
    if size is not None and size.isdigit() and int(size) > s.max_body_bytes:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > s.max_body_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _complete(s: Server, request: Request, kind: str):
    q = parse_query(parse_body(await _body(s, request)), kind, s.name)
    ids = await asyncio.to_thread(responses.prompt_ids, s.tokenizer, q)
    room = s.admission.room(len(ids))
    if not q.max_tokens_given and room is not None:   # as vLLM: a default never refuses a prompt that fits
        q = replace(q, max_tokens=max(1, min(q.max_tokens, room)))
    try:
        await asyncio.to_thread(s.admission.check, len(ids), q.max_tokens)
    except Refused as e:   # the prompt itself too long, or with max_tokens more
        prompt = "messages" if kind == "chat" else "prompt"
        raise ApiError(400, str(e), param=prompt if e.by_prompt else "max_tokens",
                       code="context_length_exceeded") from None
    job = Job(q, ids, asyncio.get_running_loop())
    s.engine.submit(job)
    try:
        first = await _next(job, request)
    except Disconnected:
        return JSONResponse({}, status_code=499)
    if first[0] == "error":
        raise first[1]
    if not q.stream:
        parts = [first]
        while parts[-1][0] == "text":
            parts.append(await job.events.get())
        if parts[-1][0] == "error":
            raise parts[-1][1]
        s.metrics.request(_endpoint(request), 200)
        request.state.completion = _completion(len(ids), parts[-1][1])
        return JSONResponse(responses.whole(s.name, q, len(ids), parts[-1][1]))
    s.metrics.request(_endpoint(request), 200)
    return StreamingResponse(_events(s, request, q, job, len(ids), first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _next(job: Job, request: Request):
    """The job's next event; the job cancelled if its client leaves meanwhile."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise Disconnected from None


def _completion(prompt_tokens: int, res) -> Completion:
    return Completion(prompt_tokens, len(res.tokens), res.timings.get("ttft_s") if res.tokens else None)


async def _events(s: Server, request: Request, q, job: Job, prompt_tokens: int, first):
    """The SSE stream: role, text deltas, the finish, usage if asked, `data: [DONE]`. A stream
    that fails (the server stopping, the run failing) ends with the error event and no finish
    and no [DONE], so a client sees a cut answer as an error (the openai client raises APIError)."""
    stream = responses.Stream(s.name, q, prompt_tokens)
    event, ended = first, False
    try:
        for chunk in stream.start():
            yield _sse(chunk)
        while True:
            kind, payload = event
            if kind == "text":
                yield _sse(stream.delta(payload))
            elif kind == "error":
                ended = True
                yield _sse(payload.body())
                return
            else:
                request.state.completion = _completion(prompt_tokens, payload)
                for chunk in stream.end(payload):
                    yield _sse(chunk)
                break
            event = await job.events.get()
        ended = True
        yield "data: [DONE]\n\n"
    finally:   # the client went away (the task is cancelled) or the stream ended: stop the generation
        if not ended:
            request.state.gone = True   # the access line says so: its status (200) was sent at the start
        job.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
