"""What a sparse decode step selects by score, against what it takes unscored (the sink, the recent
window, the unsealed tail chunk; with quantisation the forced blocks and the exact tail), for a
LossySpec (pipeline/lossy.py): the effective fraction `--json` and the LOSSY line report, and the
refusal of a `--sparse` whose forced tokens fill its budget at the context (nothing would be
selected: a sink + recent window labelled a scored fraction). Torch-free."""
from __future__ import annotations

import math


def selection(spec, prefix: int) -> dict | None:
    """What one sparse step over a `prefix`-token cache selects, in tokens (None without
    `sparse`): `asked` ceil(sparse * prefix); `forced` the tokens every step takes unscored
    (sink, recent window, the unsealed tail chunk; with quantisation the forced blocks and the
    exact tail); `selected` the tokens chosen by score; `eligible` those that could be
    (prefix - forced); `effective_fraction` selected / eligible (None where nothing is
    eligible); `forced_fraction` forced / prefix."""
    if spec.sparse is None:
        return None
    if spec.blocks:
        g = spec.group
        nb, sb, _, sink, recent = spec.block_args(prefix)
        head = min(sink, nb)
        forced_b = head + nb - max(head, min(max(0, nb - recent), sb))
        forced, eligible = forced_b * g + prefix - nb * g, (nb - forced_b) * g
        selected = (spec.fetched_blocks(prefix) - forced_b) * g
    else:
        head = min(spec.sink, prefix)
        forced = head + prefix - max(head, min(max(0, prefix - spec.recent), prefix // spec.chunk * spec.chunk))
        eligible, selected = prefix - forced, spec.fetched_tokens(prefix) - forced
    return {"context": prefix, "asked_tokens": min(prefix, math.ceil(spec.sparse * prefix)),
            "forced_tokens": forced, "selected_tokens": selected, "eligible_tokens": eligible,
            "effective_fraction": selected / eligible if eligible else None,
            "forced_fraction": forced / prefix if prefix else None}


def selects(spec, prefix: int) -> bool:
    """Whether a step over `prefix` tokens picks any token by score (True without `sparse`):
    False where the forced tokens fill the budget, also where they are the whole context (nothing
    eligible: the step is exact attention under a LOSSY label)."""
    sel = selection(spec, prefix)
    return sel is None or sel["selected_tokens"] > 0


def min_selecting_context(spec, prefix: int) -> int | None:
    """The smallest context above `prefix` at which a step selects by score (None past 2^31):
    scanned up from just below where ceil(sparse * P) passes the forced tokens."""
    if spec.sparse is None:
        return None
    lo = max(prefix + 1, int((spec.sink + spec.recent - 2 * max(spec.chunk, spec.group)) / spec.sparse))
    for p in range(lo, 1 << 31):   # a few chunks past lo: the budget grows by `sparse` a token
        if selects(spec, p):
            return p
    return None


def check_selects(spec, context: int) -> None:
    """ValueError naming --sparse where a step at `context` tokens selects nothing by score:
    the forced tokens fill what was asked, so the run would be a sink + recent window while
    labelled a scored fraction. Refused rather than run exact: the user asked for a lossy run."""
    if selects(spec, context):
        return
    sel, least = selection(spec, context), min_selecting_context(spec, context)
    tail = ", forced blocks and the exact tail" if spec.blocks else ""
    forced = f"the forced tokens (sink {spec.sink}, recent window {spec.recent}{tail}: {sel['forced_tokens']})"
    why = (f"{forced} are the whole context" if sel["eligible_tokens"] == 0
           else f"{forced} fill the {sel['asked_tokens']}-token budget")
    raise ValueError(f"sparse: {spec.sparse:g} selects nothing at a {context}-token context: {why}; "
                     f"{spec.sparse:g} selects from a {least}-token context (or run exact, or a larger --sparse)")
