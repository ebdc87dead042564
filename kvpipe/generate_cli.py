"""`kvpipe generate`: the command line over `kvpipe.generate`. The completion is streamed to stdout
as it is generated; timings, where the KV lived and the plan go to stderr; `--json` prints the
result object instead. The plan, budget and LOSSY flags are `kvpipe run`'s (cli.add_plan_flags,
cli.add_run_flags)."""
from __future__ import annotations

import argparse
import json
import signal
import sys

from kvpipe.pipeline.units import fmt_bytes, fmt_seconds, parse_tokens

from . import cli, generation as gen
from .stopping import StopBetweenTokens

EPILOG = ("Greedy by default (or as the model's generation_config.json samples: do_sample); any "
          "--temperature above 0 samples, seeded by --seed, and the same seed gives the same text "
          "whatever the plan. " + cli.UNITS)


# the flags that are generate's own keyword arguments (the rest are kvpipe.run's options)
OWN = ("model", "prompt", "prompt_file", "prompt_format", "chat", "system", "max_new_tokens", "stop",
       "ignore_eos", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "save_kv", "load_kv",
       "max_context")


def add_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser("generate", help="generate text from a prompt with a real checkpoint (streams to stdout)",
                       formatter_class=cli._Help, epilog=EPILOG,
                       description="Tokenizes the prompt (the model's chat template applied by default), "
                                   "prefills it with the plan's placement of the KV cache, and decodes "
                                   "until an end-of-sequence token, a --stop string or --max-new-tokens.")
    g.add_argument("--model",
                   help="local HF directory (safetensors), a .gguf file (converted once into "
                        "~/.cache/kvpipe or $KVPIPE_CACHE_DIR; needs kvpipe[gguf]), or a preset / "
                        "config.json with --random-weights")
    g.add_argument("--prompt", help="the prompt text (else --prompt-file, else standard input)")
    g.add_argument("--prompt-file", help="a file holding the prompt")
    g.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                   help="text, or whitespace-separated token ids taken as they are (no chat template)")
    g.add_argument("--no-chat", dest="chat", action="store_false",
                   help="tokenize the prompt as plain text, without the tokenizer's chat template")
    g.add_argument("--system", help="the system turn of the chat template")
    g.add_argument("--max-new-tokens", type=int, default=gen.DEFAULT_MAX_NEW_TOKENS,
                   help="at most this many generated tokens")
    g.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end the generation where this text appears (not included in the output); repeatable")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-sequence tokens (benchmarks)")
    add_sampling_flags(g)
    add_kept_flags(g)
    g.add_argument("--save-kv", metavar="DIR",
                   help="write the prompt's KV (every tier) and a manifest to DIR, for a later --load-kv")
    g.add_argument("--load-kv", metavar="DIR",
                   help="continue from a saved KV: the prompt is a new turn after the saved conversation, "
                        "and only its tokens are prefilled")
    g.add_argument("--hw", help="hardware profile of the prediction (default: this GPU's bundled profile, else rtx4090)")
    cli.add_plan_flags(g)
    cli.add_run_flags(g)
    return g


def add_sampling_flags(g) -> None:
    """The sampling flags `generate` and `chat` share."""
    g.add_argument("--temperature", type=float, help="0 is greedy (default: greedy, or the generation config's)")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0: off)")
    g.add_argument("--top-p", type=float, help="sample within the smallest set of tokens of probability p (1: off)")
    g.add_argument("--min-p", type=float, help="drop tokens below this fraction of the likeliest one's probability")
    g.add_argument("--repetition-penalty", type=float, help="HF's repetition penalty over prompt and output (1: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling (and of random weights)")


def add_kept_flags(g) -> None:
    """The capacity of a kept conversation (generate --save-kv/--load-kv, chat)."""
    g.add_argument("--max-context", type=token_count, metavar="TOKENS",
                   help="tokens the prompt and the answer may take (a kept KV is planned for them); "
                        "default: generate prompt + --max-new-tokens, chat the model's positions, at most 32K")


def token_count(text: str) -> int:
    """`16K` as --context reads it (argparse names the flag; the message drops parse_tokens' field)."""
    try:
        return parse_tokens(text, "tokens")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("tokens: ")) from None


def _options(args: argparse.Namespace) -> dict:
    """The parsed flags as generate's keyword arguments (its own and kvpipe.run's options)."""
    kw = {k: v for k, v in vars(args).items() if k in OWN or k in gen.RUN_OPTIONS}
    kw["stop"] = tuple(kw.get("stop") or ())
    return kw


def summary(res: gen.GenerateResult) -> list[str]:
    """The stderr lines after the text: timings, where the KV lived, the plan."""
    t, u, kv = res.timings, res.to_json()["usage"], res.kv_placement
    rate = lambda v: f"{v:,.1f} tok/s" if v else "-"   # noqa: E731
    decode = "replayed (CUDA graph)" if res.decode_replayed else "eager (stage by stage)"
    where = res.run.device
    lines = [f"kvpipe: {u['prompt_tokens']} prompt + {u['completion_tokens']} generated tokens "
             f"(finish: {res.finish_reason}; {res.sampling.describe()}; "
             f"{'chat template applied' if res.chat_template else 'prompt as given, no chat template'})",
             f"kvpipe: TTFT {fmt_seconds(t['ttft_s'])} (prefill {rate(t['prefill_tokens_per_s'])}), "
             f"decode {rate(t['decode_tokens_per_s'])}, {decode}",
             f"kvpipe: KV (layer, head) units: {kv['gpu']} on {where}, {kv['host']} in host RAM, {kv['disk']} on disk",
             f"kvpipe: plan: {res.plan.describe()}"]
    if t.get("reused_tokens"):
        lines.append(f"kvpipe: kept KV: {t['reused_tokens']} tokens were home, {t['prefill_tokens']} new tokens prefilled")
    if t.get("kv_load"):
        ld = t["kv_load"]
        lines.append(f"kvpipe: KV loaded: {fmt_bytes(ld['bytes'])} in {fmt_seconds(ld['seconds'])}, "
                     f"{'the prefill behind it' if ld['path'] == 'overlapped' else 'then the prefill'} "
                     f"(it waited {fmt_seconds(t['kv_load_held_s'])} to start)")
    if res.plan.lossy is not None:
        lines.append(f"kvpipe: LOSSY: {res.plan.lossy.describe(res.run.workload.context)}")
    return lines


def saved_line(res: gen.GenerateResult) -> list[str]:
    """Where --save-kv wrote the prompt's KV, and what it replaced there."""
    s = res.saved_kv
    if s is None:
        return []
    note = f", {s['note']}" if s["note"] else ""
    return [f"kvpipe: saved {s['tokens']} tokens' KV to {s['directory']}{note} (continue with --load-kv {s['directory']})"]


def cmd_generate(args: argparse.Namespace) -> int:
    stdin = None if args.prompt is not None or args.prompt_file is not None or sys.stdin.isatty() else sys.stdin
    stream = None
    if not args.json:
        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()
    with StopBetweenTokens(armed=_announce if args.json else None) as stop:
        try:
            res = gen.generate(stdin=stdin, stream=stream, interrupt=stop.asked, **_options(args))
        except KeyboardInterrupt as e:   # the prefill or a second signal: no result to print
            if args.save_kv is None:
                raise
            raise type(e)(_nothing_saved(e, args.save_kv, stop)) from None
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        if res.text is None or not res.text.endswith("\n"):
            print()
        for line in summary(res) + saved_line(res):
            print(line, file=sys.stderr)
    cli._print_files(args)
    return 0 if stop.signum is None else _stopped(res, stop.signum)


def _announce() -> None:
    """--json streams nothing: say when Ctrl-C starts keeping the answer."""
    print("kvpipe: prompt prefilled; generating (Ctrl-C now stops the answer and prints what was made)",
          file=sys.stderr, flush=True)


def _nothing_saved(e: KeyboardInterrupt, directory, stop: StopBetweenTokens) -> str:
    """The one line of an interrupt that left --save-kv's directory as it was."""
    when = "again, after the answer was stopped" if stop.signum is not None else "before the prompt's KV was complete"
    return f"{str(e) or 'interrupted'} {when}: nothing saved to {directory} (what was there stays)"


def _stopped(res: gen.GenerateResult, signum: int) -> int:
    """The line and exit code (the shell's 128 + signal) of an answer a signal stopped."""
    name = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    what = f"the answer was stopped after {len(res.tokens)} tokens" if res.finish_reason == "interrupted" \
        else f"the answer had ended ({res.finish_reason})"
    kept = f"; the prompt's KV is saved in {res.saved_kv['directory']}" if res.saved_kv else ""
    print(f"kvpipe: {name}: {what}{kept}", file=sys.stderr)
    return 128 + signum
