"""Measures what the trainer's loop adds to its step: the tokens/s `ligertune train` reports on bench
step's synthetic shapes, against bench step's `ligertune` row, which times the same `train_step`
(a GPU).

Findings: docs/PERF.md, "The trainer and bench step run one step".

    python3 scripts/probes/loop.py [RECIPE] [--steps N]   # (recipes/bench/llama-3.2-1b.yaml, 24)

Both run every pack as one `max_seq_len`-token sequence of random tokens. The trainer's figure is the
median of the steps' reported tokens/s after the first three (its planner, warm-up and allocator
settle there); bench step's is its median step over `--steps` timed steps after 2 warm-up steps.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from ligertune.bench.step import LIGERTUNE, StepBenchConfig, run_step_bench
from ligertune.data.chat import TokenizedExample
from ligertune.data.packing import packs_of_one
from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop
from ligertune.training.state import PackStream

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench" / "llama-3.2-1b.yaml"
SETTLING_STEPS = 3


def main(path: Path, steps: int) -> None:
    bench = run_step_bench(load_recipe(path), StepBenchConfig(steps=steps, warmup=2, chat=False, peers=False))
    benched = next(row for row in bench.rows if row.name == LIGERTUNE)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(path, [f"output.dir={tmp}/run", f"train.max_steps={steps + SETTLING_STEPS}",
                                    "train.log_every=1", "train.eval_every=null", "train.eval_at_start=false",
                                    "train.save_every=null", "data.eval_path=null"])
        run = setup(recipe, Console(quiet=True))
        try:
            seq_len, batch = recipe.data.max_seq_len, recipe.train.micro_batch_size
            rows = torch.randint(0, bench.model["vocab_size"], (8 * batch, seq_len),
                                 generator=torch.Generator().manual_seed(0))
            run.stream = PackStream(packs_of_one([TokenizedExample(ids, ids) for ids in rows.tolist()]),
                                    recipe.train.seed)
            train_loop(run)
        finally:
            cleanup(run)
        rates = [r["tokens_per_s"] for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl") if "loss" in r]
    trained = statistics.median(rates[SETTLING_STEPS:])
    print(f"{bench.device}, {bench.dtype}, {path.name}, checkpointing: {benched.checkpointing}")
    print(f"{'':22} {'tokens/s':>10}")
    print(f"{'bench step (ligertune)':22} {benched.tokens_per_s:10,.0f}")
    print(f"{'train (reported)':22} {trained:10,.0f}")
    print(f"train / bench: {trained / benched.tokens_per_s:.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = 24
    if "--steps" in args:
        i = args.index("--steps")
        steps = int(args[i + 1])
        del args[i : i + 2]
    main(Path(args[0]) if args else RECIPE, steps)
