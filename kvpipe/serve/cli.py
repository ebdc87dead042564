"""`kvpipe serve`: the command line that starts the server. The plan, budget and run flags are
`kvpipe generate`'s; the model is loaded and the plan decided once, at start, for the server's
context (`--max-context`), on the one conversation every request runs on (engine.py); fastapi and uvicorn (the `serve` extra) are
imported only when the server starts, so `kvpipe plan` never needs them."""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import tempfile

from kvpipe.generate_cli import token_count
from kvpipe.pipeline.units import fmt_bytes

API_KEY_ENV = "KVPIPE_API_KEY"
PLANNED_NEW_TOKENS = 256      # the decode length the server's plan is decided for
DEFAULT_MAX_BODY = "8MB"       # a 128K-token document is about 0.5 MB of text: room for 10x
DEFAULT_CACHE_MEM = "4GiB"     # a 32K-token document of an 8B model (128 KiB of KV a token)
DEFAULT_CACHE_DISK = "0"       # disk is written only when asked
# flags of serve's own; the rest (plan knobs, budgets, run flags) go to the Conversation
OWN = ("model", "max_context", "host", "port", "api_key", "served_model_name", "max_queue", "max_body", "cache_mem",
       "cache_disk", "cache_dir", "command", "log_level", "access_log")


def add_parser(sub) -> argparse.ArgumentParser:
    from kvpipe import cli
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streamed)",
                       formatter_class=cli._Help, epilog=cli.UNITS,
                       description="Serves POST /v1/chat/completions and /v1/completions (streamed as "
                                   "server-sent events or whole), GET /v1/models, /health and /metrics. "
                                   "Requests run one at a time on the device, admitted by the planner; "
                                   "needs the serve extra: pip install 'kvpipe[serve]'.")
    s.add_argument("--model", help="local HF directory, a .gguf file, or a preset / config.json with "
                                   "--random-weights (its directory holding a tokenizer)")
    s.add_argument("--max-context", type=token_count, metavar="TOKENS",
                   help="the server's context: a request's prompt plus max_tokens at most this (default: the "
                        "model's positions, at most 32768, and what the budgets hold); the plan is decided for it")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api-key", help="require Authorization: Bearer KEY on the /v1 routes; /health and /metrics "
                                     f"stay open, for probes and scrapers (default: ${API_KEY_ENV} if set)")
    s.add_argument("--served-model-name", help="the model's id in requests (default: the --model file or folder name)")
    s.add_argument("--max-queue", type=int, default=16, help="admitted requests that may wait; more get 429")
    s.add_argument("--max-body", default=DEFAULT_MAX_BODY, help="largest request body; larger ones get 413")
    s.add_argument("--cache-mem", default=DEFAULT_CACHE_MEM, metavar="SIZE",
                   help="host RAM budget of the prefix cache: kept prompt prefixes beside the live conversation, "
                        "in a folder on /dev/shm (0: none; at most the free space there)")
    s.add_argument("--cache-disk", default=DEFAULT_CACHE_DISK, metavar="SIZE",
                   help="disk budget of the prefix cache: entries that host RAM evicts spill there (0: none)")
    s.add_argument("--cache-dir", metavar="DIR",
                   help="where the disk tier of the prefix cache lives (default: --kv-dir, else the temp dir)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    s.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no line per request on stderr (method, path, status, seconds, tokens, TTFT)")
    s.add_argument("--seed", type=int, default=0, help="seed of random weights (each request has its own sampling seed)")
    s.add_argument("--hw", help="hardware profile of the prediction (default: this GPU's bundled profile, else rtx4090)")
    cli.add_plan_flags(s, outputs=())
    cli.add_run_flags(s)
    return s


def _checked(args: argparse.Namespace) -> dict:
    """The flags checked, one line naming the flag for each fault."""
    from kvpipe.pipeline.units import parse_bytes
    if args.model is None:
        raise ValueError("model: give --model: a model directory, a .gguf file, or a preset / config.json "
                         "with --random-weights")
    if not 0 < args.port < 65536:
        raise ValueError(f"port: expected 1 to 65535, got {args.port}")
    if args.max_context is not None and args.max_context < 2:
        raise ValueError(f"max-context: expected a token count of at least 2, got {args.max_context}")
    if args.max_queue < 1:
        raise ValueError(f"max-queue: must be at least 1, got {args.max_queue}")
    _bindable(args.host, args.port)
    sizes = {f: parse_bytes(getattr(args, f), f.replace("_", "-")) for f in ("max_body", "cache_mem", "cache_disk")}
    for flag in ("cache_mem", "cache_disk"):
        if sizes[flag] < 0:
            raise ValueError(f"{flag.replace('_', '-')}: a budget must not be negative, got {getattr(args, flag)!r}")
    return sizes


def _bindable(host: str, port: int) -> None:
    """Bind (host, port) as uvicorn will (SO_REUSEADDR) and let go: a port in use is one line
    naming --port before the model loads, not uvicorn's error after it."""
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r} ({e.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:   # the address is not this machine's: --host, not --port
                raise ValueError(f"host: {host} is not an address of this machine ({e.strerror}); "
                                 "127.0.0.1 is this machine only, 0.0.0.0 every interface") from None
            raise ValueError(f"port: {host}:{port} cannot be bound ({e.strerror}); "
                             "another server may be on it") from None


def build(args: argparse.Namespace):
    """(the FastAPI app, its Server state) for the parsed flags: checkpoint, tokenizer, budgets,
    and the conversation, its model loaded and its plan decided for the server's context."""
    from kvpipe import generation
    from kvpipe.conversation import Conversation
    from .admission import Admission, Budgets
    from .app import Server, create_app
    from .engine import Engine
    from .metrics import Metrics
    sizes = _checked(args)
    options = {k: v for k, v in vars(args).items() if k in generation.RUN_OPTIONS and k not in OWN}
    if not os.path.exists(str(args.model)):
        raise ValueError(f"model: no file or folder {str(args.model)!r} (serve needs a tokenizer beside the model)")
    ck, spec, tok = generation.load(args.model, args.dtype, args.random_weights)
    if tok is None:
        raise ValueError("model: kvpipe serve needs a tokenizer beside the model (tokenizer.json)")
    budgets = Budgets.of(ck.model, {**options, "seed": args.seed})
    capacity = args.max_context or _default_context(spec, Admission(budgets))
    from kvpipe.executor.layers.loader import progress_bars
    try:
        with progress_bars(sys.stderr.isatty()):   # transformers' loading bar on a terminal only, not in a log
            conv = Conversation(args.model, loaded=(ck, spec, tok), max_context=capacity, chat=False,
                                seed=args.seed, max_new_tokens=PLANNED_NEW_TOKENS, **options)
    except ValueError as e:
        if args.max_context is not None or str(e).startswith("model:"):   # the model's own fault names --model
            raise
        raise ValueError(f"max-context: the default context of {capacity} tokens does not fit ({str(e).splitlines()[0]}); "
                         "give a smaller --max-context") from None
    metrics = Metrics()
    name = args.served_model_name or os.path.basename(os.path.normpath(str(args.model)))
    engine = Engine(conv, Admission(budgets, conv.capacity), metrics, args.max_queue, _cache(args, sizes))
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    server = Server(name, tok, engine.admission, engine, metrics, key, sizes["max_body"], args.access_log)
    return create_app(server), server


def _cache(args, sizes: dict):
    """The prefix cache of the flags: host RAM capped to the RAM file system's free space."""
    from .cache_store import DirStore, free_bytes, ram_parent
    from .prefix_cache import PrefixCache
    ram = ram_parent()
    mem = min(sizes["cache_mem"], free_bytes(ram))
    if mem < sizes["cache_mem"]:
        print(f"kvpipe: warning: --cache-mem capped to the {fmt_bytes(mem)} free in {ram}", file=sys.stderr)
    disk = args.cache_dir or args.kv_dir or tempfile.gettempdir()
    return PrefixCache(DirStore({"host": ram, "disk": str(disk)}), mem, sizes["cache_disk"])


def _default_context(spec, admission) -> int:
    """The model's positions, at most DEFAULT_MAX_CONTEXT, and no more than the budgets hold."""
    from kvpipe.conversation import DEFAULT_MAX_CONTEXT
    fit = admission.largest(PLANNED_NEW_TOKENS) + PLANNED_NEW_TOKENS
    return max(2, min(spec.max_positions or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT, fit))


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise ValueError(f"serve: needs fastapi and uvicorn ({e.name} missing): pip install 'kvpipe[serve]'") from None
    app, server = build(args)
    try:
        _serve(args, app, server)
    finally:   # whatever ended it (a port in use, ...), the conversation's KV files are removed
        server.engine.close()
    return 0


def _serve(args, app, server) -> None:
    import uvicorn
    print(f"kvpipe: serving {server.name!r} on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if server.api_key else ''}", file=sys.stderr, flush=True)
    print(f"kvpipe: plan: {server.engine.conv.engine.plan.describe()}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=30)
    from kvpipe.executor.engine.interrupts import Terminated
    graceful = _graceful(config, server.engine)
    graceful.run()
    # uvicorn raises the signal again after its shutdown, but asyncio's SIGINT handler, which it
    # then calls, only cancels a task that may end without seeing it (the process would exit 0)
    if graceful.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt("interrupted")
    if graceful.stopped_by == signal.SIGTERM:
        raise Terminated("terminated (SIGTERM)")


def _graceful(config, engine):
    """uvicorn's server, whose SIGINT/SIGTERM handler also cancels the engine's work at once, so
    open streams end and the in-flight run frees its KV before uvicorn waits on connections."""
    import uvicorn

    class Graceful(uvicorn.Server):
        stopped_by = None   # the signal that stopped it

        def handle_exit(self, sig, frame):
            self.stopped_by = self.stopped_by or sig
            engine.cancel_all()
            super().handle_exit(sig, frame)
    return Graceful(config)
