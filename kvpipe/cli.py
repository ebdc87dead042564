"""The `kvpipe` command line: `plan` predicts a workload on any hardware profile without a GPU;
`run` executes it on this machine (torch is imported only there). Bad input is one line on
stderr and exit code 2."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvpipe.pipeline.model import ModelSpec, load_model
from kvpipe.pipeline.plan import Method, Plan
from kvpipe.pipeline.report import budget_problems, fmt_s, format_report
from kvpipe.pipeline.units import fmt_bytes, fmt_tokens, parse_bytes, parse_tokens
from kvpipe.pipeline.workload import Workload

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise SystemExit(_fail(f"{self.prog}: {message}"))


def _fail(message: str) -> int:
    print(f"kvpipe: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-8b", help="preset name, config.json or model directory")
    p.add_argument("--hw", default="rtx4090", help="hardware profile name or path to a TOML file")
    p.add_argument("--context", default="1M", help="prompt tokens: 1M, 128K, 131072")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps after the prompt")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gpu-mem", help="GPU budget (default: the profile's), e.g. 24GB or 24GiB")
    p.add_argument("--host-mem", help="pinned host RAM budget (default: the profile's)")
    p.add_argument("--disk-mem", help="disk budget for KV (default: the profile's)")
    p.add_argument("--method", default="headwise", choices=[m.value for m in Method])
    p.add_argument("--group", default="auto", help="KV heads per group (or auto)")
    p.add_argument("--chunk", default="auto", help="prefill chunk in tokens (or auto)")
    p.add_argument("--resident", default="auto", help="(layer, KV head) units kept on the GPU: all, none, N, max (as many as fit) or auto")
    p.add_argument("--plan", help="a plan.json (as printed under 'plan' by --json) instead of the knobs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE.json", help="write the Chrome/Perfetto trace")
    p.add_argument("--plot", metavar="FILE.png", help="draw the timeline")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kvpipe", description="Long-context inference with the KV cache split by head "
                                           "across GPU, pinned host RAM and disk.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("plan", help="predict latency and memory on a hardware profile (no GPU needed)")
    _common(p)
    p.add_argument("--compare", action="store_true", help="all four methods side by side")
    p.add_argument("--full-sim", action="store_true", help="simulate every decode step (no shortcut)")
    r = sub.add_parser("run", help="execute on this machine's GPU (or CPU) and print measured next to predicted")
    _common(r)
    r.set_defaults(hw=None, context="32K", decode_tokens=16)
    r.add_argument("--random-weights", action="store_true",
                   help="random weights with the model's shapes (presets and config.json have no weights)")
    r.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: the model's")
    r.add_argument("--seed", type=int, default=0, help="seed of the random prompt and weights")
    r.add_argument("--prompt-file", help="whitespace-separated token ids, or text with a model tokenizer")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--no-warmup", action="store_true",
                   help="time the first run in the process (CUDA: by default one prefill chunk and one "
                        "decode step run first, untimed, as HF baselines warm up)")
    c = sub.add_parser("calibrate", help="measure this machine (CUDA) and write a hardware profile TOML")
    c.add_argument("--out", metavar="FILE.toml", default="calibrated.toml", help="where to write the profile")
    c.add_argument("--quick", action="store_true", help="fewer and smaller measurements (under 2 minutes)")
    c.add_argument("--name", default="calibrated", help="the profile's name")
    c.add_argument("--base", default="h200", help="profile that supplies the datasheet peaks (not measurable)")
    c.add_argument("--kv-dir", help="directory whose disk is measured (default: the system temp dir)")
    return ap


def cmd_calibrate(args) -> int:
    """Measure this machine and write a profile; torch is imported here only."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.calibration import to_toml
    if not args.out.endswith(".toml"):
        raise ValueError(f"out: expected a .toml path, got {args.out!r}")
    base = load_profile(args.base)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ValueError("calibrate: needs torch with CUDA: pip install -e '.[run]'") from None
    from kvpipe.executor.calibrate import calibrate
    cal = calibrate(base, args.name, args.kv_dir, args.quick, progress=lambda s: print(s, file=sys.stderr))
    with open(args.out, "w") as f:
        f.write(to_toml(cal))
    print(f"profile: {args.out} ({cal.source})")
    return 0


def _budgets(args, hw) -> dict[str, int]:
    return {"gpu": parse_bytes(args.gpu_mem, "gpu-mem") if args.gpu_mem else hw.gpu_mem_bytes,
            "host": parse_bytes(args.host_mem, "host-mem") if args.host_mem else hw.host_mem_bytes,
            "disk": parse_bytes(args.disk_mem, "disk-mem") if args.disk_mem else hw.disk_bytes}


def _knob(text: str, parse) -> int | None:
    """None for `auto` (the rule decides), else the parsed value."""
    return None if text == "auto" else parse(text)


def _positive_int(field: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{field}: expected a positive integer or auto, got {text!r}") from None
        if value <= 0:
            raise ValueError(f"{field}: must be positive, got {value}")
        return value
    return parse


def resolve_plan(args, model: ModelSpec, work: Workload, budgets: dict[str, int], method: Method) -> Plan:
    """The rule's plan for `method`, with the user's knobs (or plan file) applied."""
    from kvpipe.pipeline.rules import default_plan, max_resident, spill_to_disk
    if args.plan:
        try:
            with open(args.plan) as f:
                return Plan.from_json(json.load(f))
        except OSError as e:
            raise ValueError(f"plan: cannot read {args.plan!r} ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"plan: {args.plan!r} is not valid JSON ({e.msg})") from None
    plan = default_plan(method, model, work, budgets)
    group = _knob(args.group, _positive_int("group"))
    chunk = _knob(args.chunk, lambda t: parse_tokens(t, "chunk"))
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk: must be positive, got {chunk}")
    named = {"auto": None, "max": "max", "all": model.units, "none": 0, "0": 0}
    resident = named[args.resident] if args.resident in named else _positive_int("resident")(args.resident)
    if group is None and chunk is None and resident is None:
        return plan
    pre, dec = plan.prefill, plan.decode
    if group is not None:
        pre, dec = replace(pre, group=group), replace(dec, group=group)
    if chunk is not None:
        pre = replace(pre, chunk=chunk)
    plan = plan.with_(prefill=pre, decode=dec, resident=plan.resident if resident in (None, "max") else resident,
                      source="user knobs over " + plan.source)
    if resident == "max":
        plan = max_resident(model, work, plan, budgets["gpu"])
    return spill_to_disk(model, work, plan, budgets["host"]) if plan.resident < model.units else plan.with_(disk=0)


def _setup(args):
    from kvpipe.hw_profiles import load_profile
    model = load_model(args.model)
    hw = load_profile(args.hw)
    work = Workload.parse(args.context, args.decode_tokens, args.batch)
    budgets = _budgets(args, hw)
    for pool, value in budgets.items():
        if value <= 0:
            raise ValueError(f"{pool}-mem: must be positive, got {value}")
    _check_weights(model, budgets)
    return model, hw, work, budgets


def _check_weights(model: ModelSpec, budgets: dict[str, int]) -> None:
    if model.weight_bytes > budgets["gpu"]:
        raise ValueError(f"gpu-mem: {fmt_bytes(budgets['gpu'])} cannot hold the weights of {model.name} "
                         f"({fmt_bytes(model.weight_bytes)})")


def _predict(model, work, plan, hw, budgets, full=False) -> dict:
    from kvpipe.sim.simulate import simulate
    from kvpipe.pipeline.memory import breakdown
    plan.check(model, work)
    problems = budget_problems(breakdown(model, work, plan), budgets)
    pred = simulate(model, work, plan, hw, full=full)
    return {"plan": plan, "fits": not problems, "problems": problems, "prediction": pred}


def _json_head(model, hw, work) -> dict:
    return {"model": {"name": model.name, "family": model.family, "layers": model.layers,
                      "kv_heads": model.kv_heads, "q_heads": model.q_heads, "head_dim": model.head_dim,
                      "dtype": model.dtype, "weight_bytes": model.weight_bytes,
                      "kv_bytes_per_token": model.kv_bytes_per_token},
            "hardware": {"name": hw.name, "description": hw.description},
            "workload": {"context": work.context, "decode_tokens": work.decode_tokens, "batch": work.batch}}


def _print_workload_plan(work: Workload, plan: Plan) -> None:
    print(f"workload: {fmt_tokens(work.context)} prompt tokens, {work.decode_tokens} decode steps, batch {work.batch}")
    print(f"plan: {plan.describe()}")
    print(f"      from {plan.source}")


def _print_plan(model, hw, work, budgets, res) -> None:
    plan, rep = res["plan"], res["prediction"].report
    print(f"kvpipe plan: {model.name} on {hw.name} — {hw.description}")
    _print_workload_plan(work, plan)
    budget = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in budgets.items())
    if res["fits"]:
        print(f"fits: yes   (budgets: {budget})")
    else:
        print(f"fits: NO — {'; '.join(res['problems'])}")
    for line in format_report(rep):
        print(line)
    for note in rep.notes:
        print(f"  note: {note}")


def _print_compare(work, results: dict[str, dict], maxctx: dict[str, int]) -> None:
    names = list(results)
    rows = [("fits", lambda r: "yes" if r["fits"] else "NO"),
            ("prefill", lambda r: fmt_s(r["prediction"].report.timing.prefill_s)),
            ("time to first token", lambda r: fmt_s(r["prediction"].report.timing.ttft_s)),
            ("decode per token", lambda r: fmt_s(r["prediction"].report.timing.decode_s_per_token)),
            ("total", lambda r: fmt_s(r["prediction"].report.timing.total_s)),
            ("peak gpu", lambda r: fmt_bytes(r["prediction"].report.peak_bytes["gpu"])),
            ("peak host", lambda r: fmt_bytes(r["prediction"].report.peak_bytes["host"])),
            ("peak disk", lambda r: fmt_bytes(r["prediction"].report.peak_bytes["disk"])),
            ("critical lane", lambda r: r["prediction"].report.critical_lane)]
    print(f"  {'':22}" + "".join(f"{n:>14}" for n in names))
    for label, get in rows:
        print(f"  {label:22}" + "".join(f"{get(results[n]):>14}" for n in names))
    print(f"  {'max context':22}" + "".join(f"{fmt_tokens(maxctx[n]):>14}" for n in names))
    for n in names:
        if not results[n]["fits"]:
            print(f"  {n} does not fit at {fmt_tokens(work.context)}: {'; '.join(results[n]['problems'])}")


def cmd_plan(args) -> int:
    model, hw, work, budgets = _setup(args)
    chosen = Method(args.method)
    methods = list(Method) if args.compare else [chosen]
    results = {}
    for m in methods:
        plan = resolve_plan(args, model, work, budgets, m) if m is chosen else \
            resolve_plan(argparse.Namespace(plan=None, group="auto", chunk="auto", resident="auto"),
                         model, work, budgets, m)
        results[m.value] = _predict(model, work, plan, hw, budgets, full=args.full_sim)
    main = results[chosen.value]
    maxctx = {}
    if args.compare:
        from kvpipe.pipeline.rules import max_context
        maxctx = {m.value: max_context(m, model, work.decode_tokens, work.batch, budgets) for m in methods}
    if args.json:
        out = _json_head(model, hw, work)
        out.update(plan=main["plan"].to_json(), fits=main["fits"], problems=main["problems"],
                   predicted=main["prediction"].report.to_json(), budgets_bytes=budgets)
        if args.compare:
            out["methods"] = {n: {"fits": r["fits"], "problems": r["problems"], "plan": r["plan"].to_json(),
                                  "predicted": r["prediction"].report.to_json(), "max_context": maxctx[n]}
                              for n, r in results.items()}
        print(json.dumps(out, indent=2))
    else:
        _print_plan(model, hw, work, budgets, main)
        if args.compare:
            print(f"\ncompare at {fmt_tokens(work.context)} (each method's rule plan; max context under the budgets):")
            _print_compare(work, results, maxctx)
    trace = main["prediction"].trace
    if args.trace:
        from kvpipe.pipeline.trace import write_chrome
        write_chrome(args.trace, trace)
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev)", file=sys.stderr)
    if args.plot:
        from kvpipe.analysis.timeline import plot_timeline
        plot_timeline(args.plot, trace, title=f"{model.name} on {hw.name}, {fmt_tokens(work.context)}")
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    """Execute the plan for real; torch and transformers are imported here only."""
    from kvpipe.hw_profiles import load_profile

    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.report import Report, timing_from_trace
    from kvpipe.pipeline.trace import write_chrome
    try:
        import torch  # noqa: F401
        from kvpipe.executor import session
    except ImportError as e:
        raise ValueError(f"run: needs torch and transformers ({e.name} missing): pip install -e '.[run]'") from None
    from kvpipe.executor.attention import kernel_label
    device = session.resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(args.model, args.dtype)
    attention = kernel_label(device, session.TORCH_DTYPES[model.dtype])  # validates KVPIPE_ATTN
    work = Workload.parse(args.context, args.decode_tokens, args.batch)
    hw_name = args.hw or session.guess_profile(device) or "rtx4090"
    hw = load_profile(hw_name)
    budgets = {"gpu": parse_bytes(args.gpu_mem, "gpu-mem") if args.gpu_mem else session.device_budget(device),
               "host": parse_bytes(args.host_mem, "host-mem") if args.host_mem else session.host_ram_bytes(),
               "disk": 0}  # the executor has no disk tier yet
    _check_weights(model, budgets)
    plan = resolve_plan(args, model, work, budgets, Method(args.method))
    predicted = _predict(model, work, plan, hw, budgets)
    if predicted["problems"]:   # refused before anything is allocated
        raise ValueError(f"budget: the plan does not fit: {'; '.join(predicted['problems'])}")
    pred = predicted["prediction"]
    graph = build(model, work, plan)
    hf = session.load_hf_model(args.model, args.random_weights, device, session.TORCH_DTYPES[model.dtype], args.seed)
    ids = session.prompt_ids(args.prompt_file, args.model, work.batch, work.context, model.vocab, args.seed)
    measured = session.run_graph(graph, hf, ids, device, budgets["gpu"], progress=not args.no_progress,
                                 warmup=not args.no_warmup)
    res = measured.result
    real = res.trace
    mrep = Report(timing_from_trace(real), real.lane_busy_s(),
                  {"gpu": res.peak_gpu_bytes, "host": res.host_pinned_bytes, "disk": 0},
                  {}, (real.note,))
    tokens = res.tokens.cpu().tolist()
    if args.json:
        out = _json_head(model, hw, work)
        m = mrep.to_json()
        m.pop("gpu_breakdown_bytes")
        out.update(plan=plan.to_json(), fits=True, predicted=pred.report.to_json(), measured=m,
                   tokens=tokens, output_digest=measured.digest, device=str(device), attention=attention,
                   budgets_bytes=budgets)
        print(json.dumps(out, indent=2))
    else:
        print(f"kvpipe run: {model.name} on {device} ({'random weights' if args.random_weights else args.model}); "
              f"attention kernel {attention}; predicted on profile {hw.name}")
        _print_workload_plan(work, plan)
        for line in format_report(pred.report, mrep):
            print(line)
        print(f"  measured critical lane: {mrep.critical_lane}; {real.note}")
        print(f"tokens: {tokens[0][:16]}{' ...' if len(tokens[0]) > 16 else ''}")
        print(f"output digest: {measured.digest}")
    if args.trace:
        write_chrome(args.trace, pred.trace, real)
        print(f"trace: {args.trace} (sim and real as two processes)", file=sys.stderr)
    if args.plot:
        from kvpipe.analysis.timeline import plot_timeline
        plot_timeline(args.plot, pred.trace, real, title=f"{model.name} {fmt_tokens(work.context)} on {device}")
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return {"plan": cmd_plan, "run": cmd_run, "calibrate": cmd_calibrate}[args.command](args)
    except (ValueError, OSError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        print("kvpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
