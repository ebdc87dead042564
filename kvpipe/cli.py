"""The `kvpipe` command line, a thin argparse layer over `kvpipe.api`: `plan` predicts a workload
on any hardware profile without a GPU; `run` executes it on this machine (torch is imported only
there). Each flag is the field of the same name of the options the API takes (kvpipe/options.py:
`--decode-tokens` is `decode_tokens`), and `--json` prints `result.to_json()`.

Exit codes, one rule for plan, run and generate: 0 done; 2 bad input (one line on stderr naming
the flag); 3 valid input, but nothing fits the budgets (`plan`'s "fits: NO", a planner that finds
no plan, weights over --gpu-mem, a CUDA out-of-memory during a run); 130 interrupted (Ctrl-C);
141 broken pipe; 143 stopped by SIGTERM."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys

from kvpipe import __version__, api, text
from kvpipe.options import DEFAULT_DECODE_TOKENS, DEFAULT_HW, DEFAULT_MODEL, DEFAULT_PLAN_CONTEXT, PlanOptions, RunOptions
from kvpipe.pipeline.plan import Method
from kvpipe.pipeline.replay import FLAGS as REPLAY_FLAGS
from kvpipe.pipeline.report import NoPlanFits
from kvpipe.stopping import import_torch, interrupted

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3
EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE, as a C tool killed by it: `kvpipe plan --json | head`

UNITS = ("units: token counts take binary K/M (128K = 131072, 1M = 1048576); sizes are decimal with "
         "KB/MB/GB/TB (24GB = 24e9 bytes) or binary with KiB/MiB/GiB/TiB (24GiB = 24 * 2^30); sizes "
         "print in GiB. Exit codes: 0 done; 2 bad input (one line naming the flag); 3 valid input but "
         "nothing fits the budgets (fits: NO, no plan fits, weights over --gpu-mem, CUDA out of memory); "
         "130 interrupted (Ctrl-C); 141 broken pipe; 143 stopped by SIGTERM. "
         "Design notes: docs/DESIGN.md in the repository.")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        if message.endswith("expected one argument"):   # argparse reads `--gpu-mem -1GB` as two flags
            message += " (a value starting with '-' is written --flag=VALUE)"
        # argparse says "argument --flag: ..."; the line names the flag once, after one prefix
        message = re.sub(r"^argument \{[^}]*\}: ", "command: ", message)
        raise SystemExit(_fail(re.sub(r"^argument ([^:]+): ", r"\1: ", message)))


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` where a default means something (not for None or off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, [], ()) or isinstance(action.default, bool) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"kvpipe: error: {message}", file=sys.stderr)
    return code


def flag_named(message: str, flags: set[str]) -> str:
    """The API's `decode_tokens: ...` (or `decode-tokens: ...`) as the CLI's `--decode-tokens: ...`
    where that is a flag of the command (other leading words are left as they are)."""
    m = re.match(r"([a-z][a-z0-9_-]*):", message)
    flag = m and "--" + m.group(1).replace("_", "-")
    return flag + message[m.end() - 1:] if flag in flags else message


def _command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    return sub.choices.get(command, parser) if sub is not None and command else parser


def _flags(parser: argparse.ArgumentParser, command: str | None) -> set[str]:
    """The long flags of `command`'s parser (every flag a user can type there)."""
    return {o for a in _command_parser(parser, command)._actions for o in a.option_strings if o.startswith("--")}


def _switches(parser: argparse.ArgumentParser, command: str | None) -> set[str]:
    """The long flags of `command` that take no value (`plan --max-context`, `--json`)."""
    return {o for a in _command_parser(parser, command)._actions if a.nargs == 0
            for o in a.option_strings if o.startswith("--")}


def stray_value_line(argv: list[str], extras: list[str], switches: set[str]) -> str | None:
    """One line naming the switch a stray value follows (`plan --max-context 128K`: generate's
    --max-context takes TOKENS, plan's finds the largest context), else None."""
    value = next((a for a in extras if not a.startswith("-")), None)
    at = argv.index(value) if value is not None and value in argv else -1
    flag = argv[at - 1].split("=", 1)[0] if at > 0 else None
    if flag not in switches:
        return None
    hint = " (it finds the largest context that fits; --context gives one)" if flag == "--max-context" else ""
    return f"{flag}: takes no value here, got {value!r}{hint}"


def unknown_line(extras: list[str], flags: set[str], command: str | None) -> str:
    """One line for arguments no flag of `command` takes, naming the first and the closest flag."""
    where = f" of {command}" if command else ""
    flag = next((a.split("=", 1)[0] for a in extras if a.startswith("-")), None)
    if flag is None:
        return f"command: unexpected argument {extras[0]!r} ({command or 'the command'} takes flags only)"
    close = difflib.get_close_matches(flag, sorted(flags), n=1, cutoff=0.8)   # a typo or another tool's name
    return f"{flag}: not an option{where}" + (f" (did you mean {close[0]}?)" if close else "; --help lists them")


def oom_line(message: str) -> str:
    """One line for a CUDA out-of-memory during a run: what was asked, what the allocator held
    reserved but unused (fragmentation), and the two ways out. The plan's memory model said it fit,
    so this is a miss of the prediction, reported with exit code 3 (does not fit)."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", message)
    frag = re.search(r"([\d.]+ [KMGT]?i?B) is reserved by PyTorch but unallocated", message)
    parts = ["--gpu-mem: CUDA out of memory during the run"]
    if asked:
        parts.append(f"asking {asked.group(1)}")
    if frag:
        parts.append(f"{frag.group(1)} reserved but unallocated (fragmentation)")
    return ("; ".join(parts) + "; try a smaller --chunk, a larger --gpu-mem, or "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def add_workload_flags(p: argparse.ArgumentParser, *, context: str | None, hw: str | None) -> None:
    """The flags `plan` and `run` share: model, hardware, workload, budgets and plan knobs. A new
    shared flag goes here, with a field of the same name in kvpipe/options.py `Options`."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name (any case), config.json or model directory")
    p.add_argument("--hw", default=hw, help="hardware profile name (any case) or path to a TOML file"
                   + ("" if hw else " (default: this GPU's bundled profile, else rtx4090)"))
    p.add_argument("--context", default=context, help="prompt tokens per sequence: 1M, 128K, 131072"
                   + ("" if context else " (default: the prompt file's length, else 32K)"))
    p.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS,
                   help="decode steps after the prompt (each one generated token)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together, each with the full context")
    p.add_argument("--gpus", type=int, help="GPUs of one host: KV heads split across them (tensor parallel), "
                   "optionally layers in stages; budgets per GPU, host RAM shared (default: one)")
    p.add_argument("--tp", type=int, help="pin the tensor-parallel ranks (a divisor of --gpus; default: searched)")
    p.add_argument("--pp", type=int, help="pin the pipeline stages by layers (a divisor of --gpus; default: searched)")
    add_plan_flags(p)


def add_plan_flags(p: argparse.ArgumentParser, outputs: tuple[str, ...] = ("json", "trace", "plot")) -> None:
    """Budgets, plan knobs and the `outputs` the command writes (`plan`, `run` and `generate` all
    three; `chat` --json; `serve` none, its output is HTTP): a command lists no flag it refuses."""
    p.add_argument("--gpu-mem", help="GPU memory budget, e.g. 24GB or 24GiB (default: the profile's)")
    p.add_argument("--host-mem", help="pinned host RAM budget (default: the profile's)")
    p.add_argument("--disk-mem", help="disk budget for KV (default: the profile's)")
    p.add_argument("--method", type=str.lower, choices=[m.value for m in Method],
                   help="schedule (default: headwise, or the --plan file's)")
    p.add_argument("--group", default="auto", help="KV heads per streamed group, or auto")
    p.add_argument("--chunk", default="auto", help="prefill chunk in tokens, or auto")
    p.add_argument("--resident", default="auto",
                   help="(layer, KV head) units kept on the GPU: all, none, N, max (as many as fit) or auto")
    p.add_argument("--disk", default="auto",
                   help="offloaded (layer, KV head) units on disk: N, none, or auto (what host RAM cannot hold)")
    p.add_argument("--kv-dir", help="directory of the disk tier's file; its free space is the disk budget "
                                     "(run default: the system temp dir)")
    p.add_argument("--codec", action="append", default=[], metavar="LINK=NAME",
                   help="codec on a link (h2d, d2h, disk), NAME auto to let the simulator decide; "
                        "repeatable; `kvpipe codecs` lists them")
    p.add_argument("--plan", metavar="PLAN.json", help="a plan.json (written by plan --out); replaces the search and --group/--chunk/--resident")
    p.add_argument("--objective", default="total", choices=["total", "ttft", "decode"],
                   help="what the planner minimises: total time, time to first token or decode time per token")
    p.add_argument("--quantile", default="p90", choices=["p50", "p90"],
                   help="the run it is minimised on: p90 a slow run of the host's issue speed, where the "
                        "profile knows its spread, so a plan fast only on a good run is not picked; p50 a median run")
    p.add_argument("--fuse", type=str.lower, choices=["auto", "on", "off"],
                   help="fused decode: the elementwise work of replayed decode steps compiled by torch.compile "
                        "(auto: where it runs, CUDA + Triton; on: refused where it cannot; off: HF's modules). "
                        "Default: KVPIPE_FUSE if set, else auto")
    p.add_argument("--replay", type=str.lower, choices=REPLAY_FLAGS, default="auto",
                   help="decode steps as CUDA-graph replays (on) or issued stage by stage (off); auto: the planner "
                        "scores both where decode can be replayed (bf16/fp16, batch 1, no disk units, quantised KV without --sparse "
                        "or h2d codec) and the plan says which; run executes the plan's choice, else replays on CUDA")
    if "json" in outputs:
        p.add_argument("--json", action="store_true", help="print one JSON object")
    if "trace" in outputs:
        p.add_argument("--trace", metavar="FILE.json", help="write the Chrome/Perfetto trace")
    if "plot" in outputs:
        p.add_argument("--plot", metavar="FILE.png", help="draw the timeline (needs kvpipe[plot]); .png, .pdf, .svg ...")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kvpipe", description="Long-context inference with the KV cache split by head "
                                           "across GPU, pinned host RAM and disk.", epilog=UNITS)
    ap.add_argument("--version", action="version", version=f"kvpipe {__version__}")
    sub = ap.add_subparsers(dest="command", parser_class=_Parser, metavar="{plan,run,generate,chat,serve,calibrate,codecs}")
    p = sub.add_parser("plan", help="predict latency and memory on a hardware profile (no GPU needed)",
                       formatter_class=_Help, epilog=UNITS)
    add_workload_flags(p, context=DEFAULT_PLAN_CONTEXT, hw=DEFAULT_HW)
    p.add_argument("--compare", action="store_true", help="all four methods side by side")
    p.add_argument("--full-sim", action="store_true", help="simulate every prefill chunk and decode step (no shortcut)")
    p.add_argument("--lossy", choices=["int8", "int4"], help="LOSSY opt-in: quantise the offloaded KV")
    p.add_argument("--sparse", type=float, metavar="F",
                   help="LOSSY opt-in: each decode step fetches a fraction F of the offloaded tokens")
    p.add_argument("--max-error", type=float, metavar="REL",
                   help="LOSSY only within this budget: attention-output relative error; the planner may pick "
                        "int8/int4, a sparse fraction or both where its measured error is within it "
                        "(without it: never lossy)")
    p.add_argument("--out", metavar="PLAN.json", help="write the chosen plan for `kvpipe run --plan`")
    p.add_argument("--max-context", action="store_true", help="the largest context that fits, with its plan")
    r = sub.add_parser("run", help="execute on this machine's GPU (or CPU) and print measured next to predicted",
                       formatter_class=_Help, epilog=UNITS,
                       description="Unless PYTORCH_CUDA_ALLOC_CONF is set, run sets it to "
                                   f"{api.ALLOC_CONF} before CUDA starts (fewer fragmentation OOMs).")
    add_workload_flags(r, context=None, hw=None)
    add_run_flags(r)
    r.add_argument("--seed", type=int, default=0, help="seed of the random prompt and weights")
    r.add_argument("--prompt-file", help="whitespace-separated token ids, or text with a model tokenizer")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    from kvpipe.generate_cli import add_parser
    add_parser(sub)
    from kvpipe.chat_cli import add_parser as add_chat
    add_chat(sub)
    from kvpipe.serve.cli import add_parser as add_serve
    add_serve(sub)
    sub.add_parser("codecs", help="list the codecs: lossless or lossy, where each runs, which links")
    c = sub.add_parser("calibrate", help="measure this machine (CUDA) and write a hardware profile TOML",
                       formatter_class=_Help)
    c.add_argument("--out", metavar="FILE.toml", default="calibrated.toml", help="where to write the profile")
    c.add_argument("--quick", action="store_true", help="fewer and smaller measurements (under 2 minutes)")
    c.add_argument("--name", default="calibrated", help="the profile's name")
    c.add_argument("--base", default="h200", help="profile that supplies the datasheet peaks (not measurable)")
    c.add_argument("--kv-dir", help="directory whose disk is measured (default: the system temp dir)")
    return ap


def add_run_flags(r: argparse.ArgumentParser) -> None:
    """What executes on this machine: weights, device, dtype, LOSSY opt-ins, warm-up (`run`, `generate`)."""
    r.add_argument("--random-weights", action="store_true",
                   help="random weights with the model's shapes (presets and config.json have no weights)")
    r.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    r.add_argument("--dtype", type=str.lower, choices=["bf16", "fp16", "fp32"], help="default: the model's")
    r.add_argument("--lossy", choices=["int8", "int4"],
                   help="LOSSY opt-in: store, move and read back the offloaded KV quantised")
    r.add_argument("--sparse", type=float, metavar="F", help="LOSSY opt-in: each decode step fetches a fraction F of the offloaded tokens, chosen "
                   "by a key sketch on the GPU (with --lossy: whole quantised blocks; not with disk units yet)")
    r.add_argument("--max-error", type=float, metavar="REL",
                   help="LOSSY only within this budget: attention-output relative error; the planner may pick "
                        "int8/int4, a sparse fraction or both where its measured error is within it "
                        "(without it: never lossy)")
    r.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first run in the process (CUDA: by default one prefill chunk and one "
                        "decode step run first, untimed, as HF baselines warm up)")


def _print_files(args) -> None:
    if args.trace:
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev)", file=sys.stderr)
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr)


def cmd_calibrate(args) -> int:
    """Measure this machine and write a profile; torch is imported here only."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.calibration import to_toml
    if not args.out.endswith(".toml"):
        raise ValueError(f"out: expected a .toml path, got {args.out!r}")
    from kvpipe.inputs import output_path
    output_path(args.out.removesuffix(".toml") + ".json", "out")   # the folder, before minutes of measuring
    try:
        base = load_profile(args.base)
    except ValueError as e:
        raise ValueError(f"base: {e}") from None
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ValueError("calibrate: needs torch with CUDA: pip install -e '.[run]'") from None
    from kvpipe.executor.calibrate.machine import calibrate
    cal = calibrate(base, args.name, args.kv_dir, args.quick, progress=lambda s: print(s, file=sys.stderr))
    with open(args.out, "w") as f:
        f.write(to_toml(cal))
    record = args.out[:-len(".toml")] + ".json"   # the measurements behind the fits (points, extras)
    with open(record, "w") as f:
        json.dump({"source": cal.source, "values": cal.values, "notes": cal.notes, "extra": cal.extra}, f, indent=1, default=str)
    print(f"profile: {args.out} ({cal.source}); measurements: {record}")
    return 0


def cmd_codecs(args) -> int:
    from kvpipe.pipeline.codecs import describe
    for line in describe():
        print(line)
    return 0


def cmd_plan(args) -> int:
    from kvpipe import buyers
    if buyers.wants_table(args):   # several --hw or --host-mem: the buyer's table
        return buyers.cmd_table(args)
    if args.max_context and buyers.context_given(args):   # refused, not dropped
        raise ValueError(f"context: not with --max-context, which finds the longest context that fits "
                         f"(drop --context {args.context})")
    res = api.plan(PlanOptions.from_args(args))
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        text.print_plan(res)
        for line in res.multi.describe() if res.multi else ():
            print(line)
        if args.compare:
            text.print_compare(res)
    _print_files(args)
    return 0 if res.fits else EXIT_DOES_NOT_FIT


def cmd_run(args) -> int:
    if args.json:   # one JSON object, and no bars around it (ours or transformers')
        args.progress = False
    res = api.run(RunOptions.from_args(args))
    if res is None:   # a torchrun rank other than 0: rank 0 prints
        return 0
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    elif hasattr(res, "lines"):   # --gpus N
        print("\n".join(res.lines()))
    else:
        text.print_run(res)
    _print_files(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if extras:
        argv = sys.argv[1:] if argv is None else list(argv)
        return _fail(stray_value_line(argv, extras, _switches(parser, args.command))
                     or unknown_line(extras, _flags(parser, args.command), args.command))
    if args.command is None:          # bare `kvpipe`: what it can do
        parser.print_help()
        return 0
    with text.stderr_log():   # what the library reports and warns, one line each
        return _dispatch(parser, args)


def _dispatch(parser, args) -> int:
    """Runs the command; its errors as one line and the exit code."""
    try:
        if args.command not in ("plan", "codecs"):   # the others import torch: first here, Ctrl-C held
            import_torch()
        from kvpipe.chat_cli import cmd_chat
        from kvpipe.generate_cli import cmd_generate
        from kvpipe.serve.cli import cmd_serve
        return {"plan": cmd_plan, "run": cmd_run, "calibrate": cmd_calibrate,
                "codecs": cmd_codecs, "generate": cmd_generate, "chat": cmd_chat,
                "serve": cmd_serve}[args.command](args)
    except BrokenPipeError:   # the reader went away (`| head`): stop quietly, and keep Python's
        # exit-time flush of stdout from failing again (the Python docs' recipe for SIGPIPE)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ValueError as e:   # valid input that no plan fits is exit 3, bad input exit 2
        line = flag_named(str(e).splitlines()[0], _flags(parser, args.command)) if str(e) else type(e).__name__
        return _fail(line, EXIT_DOES_NOT_FIT if isinstance(e, NoPlanFits) else EXIT_BAD_INPUT)
    except OSError as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except RuntimeError as e:
        if type(e).__name__ != "OutOfMemoryError":   # torch's CUDA OOM (torch is not imported by plan)
            raise
        print(f"kvpipe: error: {oom_line(str(e))}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except KeyboardInterrupt as e:   # Ctrl-C; SIGTERM during a run comes as Terminated (exit_code 143)
        return interrupted(e)
