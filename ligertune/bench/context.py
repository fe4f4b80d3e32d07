"""`ligertune bench step --max-context LIMIT`: the longest single conversation the recipe's step
trains on this device, and its speed there.

    report = run_max_context(recipe, StepBenchConfig(steps=1, warmup=0), limit=524_288)

A probe of L tokens is ligertune's synthetic row (`StepBench`, no peers) with one conversation of L
tokens a step: the recipe with `data.max_seq_len = L`, `micro_batch_size = 1` and `grad_accum_steps
= 1`, under the recipe's own memory policy (with `gradient_checkpointing: auto`, the plan the
trainer would make for L, its two planning steps run first). A probe *trains* when its steps run
to the end; it does not when they run out of memory. Any other failure ends the search: it says
nothing of memory.

L starts at `data.max_seq_len` and doubles while it trains (the last probe at LIMIT itself), then
halves the gap between the longest that trained and the shortest that did not, in multiples of
`STRIDE` tokens, until the gap is at most a sixteenth of the longest (or one stride). Each probe's
row stays in the report (`layout` "context"): tokens/s, peak memory and the plan, with its predicted
peak beside the measured one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ligertune.bench.preference import check_pair_options
from ligertune.bench.results import StepReport, StepRow
from ligertune.bench.step import StepBench, StepBenchConfig, compare, new_report, tokenizer_vocab
from ligertune.errors import UserError
from ligertune.recipe import Recipe

STRIDE = 64
"""Probe lengths are multiples of this many tokens (below the start, which is the recipe's)."""
OUT_OF_MEMORY = "out of memory"


def run_max_context(recipe: Recipe, config: StepBenchConfig, limit: int, *, recipe_name: str = "",
                    log: Callable[[str], None] = lambda _: None,
                    on_probe: Callable[[StepReport], None] = lambda _: None) -> StepReport:
    """Probe the recipe's step at longer and longer single conversations (module docstring); the
    report's `context` holds the limit, the longest length that trained and its tokens/s.
    `on_probe(report)` after each probe, with the probes so far (`context` None until the end)."""
    if recipe.objective.name != "sft":
        raise UserError(f"--max-context: probes supervised fine-tuning steps; the recipe's objective is "
                        f"{recipe.objective.name}")
    check_pair_options(recipe, config)  # none of them here
    start = recipe.data.max_seq_len
    if limit < start:
        raise UserError(f"--max-context {limit}: below data.max_seq_len={start}, where the search starts")
    config = dataclasses.replace(config, chat=False, peers=False)
    one = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, micro_batch_size=1, grad_accum_steps=1))
    device, report = new_report(one, config, recipe_name, log)
    vocab_size = tokenizer_vocab(recipe)
    rows: dict[int, StepRow] = {}

    def trains(tokens: int) -> bool:
        log(f"context: {tokens:,} tokens")
        variant = dataclasses.replace(one, data=dataclasses.replace(one.data, max_seq_len=tokens))
        StepBench(variant, config, device, vocab_size, report, log).run(peers=False)
        row = report.rows[-1]
        row.layout, row.tokens = "context", tokens  # a failed row has no count of its own
        rows[tokens] = row
        log(f"context: {tokens:,} tokens {probe_outcome(row)}")
        on_probe(report)
        if row.status == "ok":
            return True
        if row.detail == OUT_OF_MEMORY:
            return False
        raise ProbeFailed(f"--max-context: the step of {tokens} tokens failed: {row.detail}")

    try:
        longest = longest_that_fits(trains, start, limit)
    except ProbeFailed as err:
        report.note = "; ".join(filter(None, [report.note, str(err)]))
        longest = None
    compare(report)
    best = rows.get(longest) if longest is not None else None
    report.context = {"limit": limit, "longest": longest, "tokens_per_s": best.tokens_per_s if best else None,
                      "peak_mem_gib": best.peak_mem_gib if best else None}
    return report


def probe_outcome(row: StepRow) -> str:
    """One probe's result as the search's log says it, as it goes: a search cut short still
    leaves what each probe did."""
    if row.status != "ok":
        return f"did not train: {row.detail}"
    peak = f", peak {row.peak_mem_gib:.1f} GiB" if row.peak_mem_gib is not None else ""
    return f"trained: {row.tokens_per_s:,.0f} tokens/s{peak} ({row.checkpointing})"


class ProbeFailed(Exception):
    """A probe failed for another reason than memory: the search cannot go on."""


def longest_that_fits(fits: Callable[[int], bool], start: int, limit: int) -> int | None:
    """The longest length in [STRIDE, limit] for which `fits` holds, to within a sixteenth (or
    one stride), assuming that whatever fits, anything shorter does: doubling from `start` (the last
    try at `limit`), then bisection. None when even the shortest tried does not fit."""
    good, bad = 0, None
    tokens = start
    while True:
        if fits(tokens):
            good = tokens
            if tokens >= limit:
                return good
            tokens = min(2 * tokens, limit)
        else:
            bad = tokens
            break
    while True:
        gap = bad - good
        if gap <= max(good // 16, STRIDE):
            return good or None
        middle = (good + bad) // 2 // STRIDE * STRIDE
        if middle <= good:
            return good or None
        if fits(middle):
            good = middle
        else:
            bad = middle
