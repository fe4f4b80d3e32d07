"""`ligertune bench step --memory-cap`: each variant at its best setting under each memory cap.

    report = run_memory_caps(recipe, StepBenchConfig(), [12, 24, 40])   # GiB of peak allocated memory

The peers (HF and HF + Liger, with peft for LoRA recipes; for a preference recipe TRL's DPOTrainer
and TRL + Liger, in pairs/s) run with gradient checkpointing off and on; under a cap each gets the
faster of the two that fits. ligertune runs its own policy,
`gradient_checkpointing: auto` with `memory_budget_gib` set to the cap, once per cap: the plan the
trainer would make under that budget (`bench.step`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ligertune.bench.results import CapChoice, CapReport, StepRow
from ligertune.bench.step import LIGERTUNE, StepBenchConfig, compare, new_report, step_bench_for, tokenizer_vocab
from ligertune.errors import UserError
from ligertune.recipe import Recipe


def run_memory_caps(
    recipe: Recipe,
    config: StepBenchConfig,
    caps: list[float],
    *,
    recipe_name: str = "",
    log: Callable[[str], None] = lambda _: None,
) -> CapReport:
    """Every variant's rows (synthetic only), and per cap each variant's fastest setting that fits."""
    if not caps or any(c <= 0 for c in caps):
        raise UserError(f"--memory-cap: give one or more positive GiB figures, got {caps}")
    bench = step_bench_for(recipe, config)
    config = dataclasses.replace(config, chat=False)
    device, report = new_report(recipe, config, recipe_name, log)
    vocab_size = tokenizer_vocab(recipe)
    for checkpointing in (False, True) if config.peers else ():
        variant = with_checkpointing(recipe, checkpointing, None)
        bench(variant, config, device, vocab_size, report, log).run(ligertune=False)
    planned: dict[float, StepRow] = {}
    for cap in caps:
        variant = with_checkpointing(recipe, "auto", cap)
        bench(variant, config, device, vocab_size, report, log).run(peers=False)
        planned[cap] = report.rows[-1]  # ligertune's, measured or failed
    compare(report)
    choices = cap_choices([r for r in report.rows if r.name != LIGERTUNE], planned, caps)
    return CapReport(report, list(caps), choices)


def cap_choices(peer_rows: list[StepRow], planned: dict[float, StepRow], caps: list[float]) -> list[CapChoice]:
    """Per cap: ligertune's row planned for that cap, and each peer's fastest row whose peak fits
    (a row without a peak, on the CPU, fits any cap). ligertune's row is shown even over its cap."""
    choices = []
    for cap in caps:
        candidates = {LIGERTUNE: [planned[cap]] if cap in planned else []}
        for row in peer_rows:
            candidates.setdefault(row.name, []).append(row)
        ours = None
        for name, rows in candidates.items():
            measured = [r for r in rows if r.status == "ok" and r.tokens_per_s]
            fitting = [r for r in measured if r.peak_mem_gib is None or r.peak_mem_gib <= cap]
            best = max(fitting, key=lambda r: r.tokens_per_s, default=None)
            if best is None and name == LIGERTUNE and measured:
                best = measured[0]
            choice = CapChoice(cap, name, best.checkpointing if best else None, best.tokens_per_s if best else None,
                               best.peak_mem_gib if best else None, fits=any(best is r for r in fitting),
                               pairs_per_s=best.pairs_per_s if best else None)
            if name == LIGERTUNE:
                ours = choice if choice.fits else None
            elif ours is not None and choice.fits:
                choice.vs_ligertune = ours.tokens_per_s / choice.tokens_per_s
            choices.append(choice)
    return choices


def with_checkpointing(recipe: Recipe, checkpointing: bool | str, budget_gib: float | None) -> Recipe:
    """The recipe with `train.gradient_checkpointing` and `train.memory_budget_gib` replaced."""
    train = dataclasses.replace(recipe.train, gradient_checkpointing=checkpointing,
                                memory_budget_gib=budget_gib)
    return dataclasses.replace(recipe, train=train)
