"""`kvpipe chat`: an interactive multi-turn session in the terminal on a kept conversation
(kvpipe/conversation.py): the plan is decided once for --max-context tokens and the conversation's
KV stays where it placed it, so each turn prefills only its new tokens. readline edits the input
line (on a terminal); `/reset`, `/save DIR` (a KV directory, as `generate --save-kv` writes), `/exit`;
Ctrl-C stops the current answer (the turn is dropped, the session goes on), Ctrl-D exits. Read
from a pipe, each line is a turn (no prompt shown); --json prints one result object per turn."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvpipe.pipeline.units import fmt_seconds

from . import cli, generate_cli, generation as gen

HELP = ("/reset forgets the conversation, /save DIR writes its KV, /exit (or Ctrl-D) leaves, /help shows this; "
        "Ctrl-C stops an answer")
SAMPLING = ("max_new_tokens", "stop", "ignore_eos", "temperature", "top_k", "top_p", "min_p",
            "repetition_penalty", "seed")


def add_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("chat", help="talk with a model in the terminal; each turn prefills only its new tokens",
                       formatter_class=cli._Help, epilog=HELP + ". " + cli.UNITS,
                       description="An interactive multi-turn conversation with the model's chat template. The "
                                   "conversation's KV cache stays where the plan placed it between turns.")
    c.add_argument("--model", help="local HF directory, a .gguf file, or a preset / config.json with --random-weights")
    c.add_argument("--system", help="the system turn of the chat template")
    c.add_argument("--load-kv", metavar="DIR", help="start from a saved KV directory (its conversation goes on)")
    c.add_argument("--max-new-tokens", type=int, default=gen.DEFAULT_MAX_NEW_TOKENS, help="at most this many tokens per answer")
    c.add_argument("--stop", action="append", default=[], metavar="STRING", help="end an answer at this text; repeatable")
    c.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence tokens")
    generate_cli.add_sampling_flags(c)
    c.add_argument("--hw", help="hardware profile of the prediction (default: this GPU's bundled profile, else rtx4090)")
    generate_cli.add_kept_flags(c)
    cli.add_plan_flags(c, outputs=("json",))
    cli.add_run_flags(c)
    return c


def _lines(tty: bool):
    """The input lines: readline's prompt on a terminal, plain lines from a pipe; ends at EOF."""
    if tty:
        try:
            import readline  # noqa: F401  (imported for its line editing and history under input())
        except ImportError:
            pass
    while True:
        try:
            line = input("> ") if tty else sys.stdin.readline()
        except EOFError:   # Ctrl-D: end the prompt's line so the shell's prompt starts on its own
            if tty:
                print(file=sys.stderr)
            return
        except KeyboardInterrupt:     # Ctrl-C at the prompt: a fresh line, not the end
            print(file=sys.stderr)
            continue
        if not tty and not line:
            return
        yield line.rstrip("\n")


def _turn_line(n: int, res) -> str:
    t = res.timings
    rate = f"{t['decode_tokens_per_s']:,.1f} tok/s" if t.get("decode_tokens_per_s") else "-"
    return (f"kvpipe: turn {n}: {t['prefill_tokens']} new tokens prefilled ({t['reused_tokens']} kept), "
            f"TTFT {fmt_seconds(t['ttft_s'])}; {len(res.tokens)} generated at {rate} ({res.finish_reason})")


def _command(conv, line: str) -> bool:
    """Run a /command; False when the session ends."""
    word, _, arg = line.partition(" ")
    if word == "/exit":
        return False
    if word == "/reset":
        conv.reset()
        print("kvpipe: the conversation is reset", file=sys.stderr)
    elif word == "/save":
        _save(conv, arg.strip())
    else:
        known = word == "/help"
        print(f"kvpipe: {'' if known else f'unknown command {word}; '}{HELP}", file=sys.stderr)
    return True


def _save(conv, directory: str) -> None:
    """`/save DIR`; a refused or failed save is one line and the conversation goes on."""
    if not directory:
        print("kvpipe: /save needs a directory: /save DIR", file=sys.stderr)
    elif not conv.tokens:   # nothing home yet (a fresh or /reset conversation)
        print("kvpipe: nothing to save yet: the conversation is empty", file=sys.stderr)
    else:
        from kvpipe.executor.kv import saved
        try:
            previous = saved.check_target(directory, "/save")
            man = conv.save(directory)
        except ValueError as e:   # not a folder a save may write: one line, the session goes on
            print(f"kvpipe: /save {directory}: {str(e).splitlines()[0].removeprefix('/save: ').removeprefix('save-kv: ')}", file=sys.stderr)
            return
        except OSError as e:   # a save refused by the file system must not end the session
            print(f"kvpipe: /save {directory}: {e.strerror or e}", file=sys.stderr)
            return
        note = saved.replaced_note(previous)
        print(f"kvpipe: saved {man['tokens_saved']} tokens' KV to {directory}{', ' + note if note else ''}",
              file=sys.stderr)


def _check_sampling(turn: dict) -> None:
    """A bad sampling flag is one line before the model loads, not a refusal of every turn."""
    from kvpipe.pipeline.sampling import Sampling
    names = {f.name for f in dataclasses.fields(Sampling)}
    Sampling(**{k: v for k, v in turn.items() if k in names and v is not None})


def cmd_chat(args: argparse.Namespace) -> int:
    from .conversation import Conversation
    kw = {k: v for k, v in vars(args).items() if k in gen.RUN_OPTIONS}
    turn = {k: getattr(args, k) for k in SAMPLING}
    turn["stop"] = tuple(turn["stop"] or ())
    gen._max_new(turn["max_new_tokens"])
    _check_sampling(turn)
    tty = sys.stdin.isatty()
    from .kept import refuse_inexact
    refuse_inexact(kw, "chat")
    if args.load_kv:   # not a KV directory: said before the model loads
        from kvpipe.executor.kv import saved
        saved.read_manifest(args.load_kv)
    from kvpipe.executor.layers.loader import progress_bars
    with progress_bars(sys.stderr.isatty()):   # transformers' loading bar on a terminal only
        conv = Conversation(args.model, max_context=args.max_context, system=args.system, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, **kw)
    with conv:
        if args.load_kv:
            man = conv.load(args.load_kv)
            print(f"kvpipe: continuing {args.load_kv}: {man['tokens_saved']} tokens' KV loaded", file=sys.stderr)
        if not conv.chat:
            raise ValueError("model: kvpipe chat needs a tokenizer with a chat template")
        if not args.load_kv:
            _check_room(conv)
        print(f"kvpipe: chat, up to {conv.capacity} tokens; plan: {conv.engine.plan.describe()}", file=sys.stderr)
        if tty:
            print("kvpipe: /help lists the commands; Ctrl-C stops an answer, Ctrl-D leaves", file=sys.stderr)
        refused = 0   # piped turns refused: the exit code says so
        for line in _lines(tty):
            if not line.strip():
                continue
            try:
                if line.startswith("/"):
                    if not _command(conv, line.strip()):
                        break
                    continue
                res = conv.say(line, stream=None if args.json else _write, **turn)
            except KeyboardInterrupt:
                print("\nkvpipe: answer stopped (the turn is dropped; the conversation goes on)", file=sys.stderr)
                continue
            except ValueError as e:
                print(f"kvpipe: {str(e).splitlines()[0]}", file=sys.stderr)
                refused += 1
                continue
            if args.json:
                print(json.dumps(res.to_json()), flush=True)
            else:
                print(flush=True)
                print(_turn_line(conv.turns, res), file=sys.stderr)
    return 2 if refused and not tty else 0


def _check_room(conv) -> None:
    """A capacity that cannot hold the template's turns and one short message is refused at start,
    not at every turn."""
    floor = len(conv.render(conv.messages + [{"role": "user", "content": "hi"}])) + 1
    if conv.capacity < floor:
        raise ValueError(f"max-context: {conv.capacity} tokens cannot hold a first turn: the chat template's "
                         f"turns around a short message take {floor - 1} (give at least {floor}, and room for "
                         "the answers)")


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()
