"""The tokens/s that `ligertune train` reports, against `bench step` on the same shapes (a GPU).

    python3 scripts/train_vs_bench.py [RECIPE] [--steps N]

Two data shapes go through the trainer's own loop (`setup` + `train_loop`, metrics every step;
the median of the steps after the first three) and through `bench step`:

- long:  every pack one conversation of `max_seq_len` tokens: the shapes of bench step's synthetic
         `ligertune` row, which times the same whole step (forward, backward, clipping, update);
- mixed: bench step's synthetic chat conversations (log-normal lengths), packed best-fit: the
         shapes of its `ligertune, packed chat` row. That row times forward and backward only, so
         the update (clipping + optimizer step, timed here on the same model) is added to it.

Prints one line per shape: train's figure, bench's, and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from ligertune.bench.step import (
    LIGERTUNE,
    PACKED,
    StepBenchConfig,
    run_step_bench,
    synthetic_conversations,
    whole_micro_batches,
)
from ligertune.data.chat import TokenizedExample
from ligertune.data.packing import packs_of_one
from ligertune.devices import synchronize
from ligertune.recipe import load_recipe
from ligertune.training.checkpoint import read_metrics
from ligertune.training.state import PackStream
from ligertune.training.trainer import cleanup, forward_backward, next_batches, setup, train_loop

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "bench" / "llama-3.2-1b.yaml"
WARMUP_STEPS = 3


def train_rate(recipe, packs, out: Path, steps: int) -> tuple[float, float]:
    """(median reported tokens/s, median ms of clipping + optimizer step) of a run over `packs`."""
    run = setup(recipe, Console(quiet=True))
    try:
        run.stream = PackStream(packs, recipe.train.seed)
        train_loop(run)
        rates = [r["tokens_per_s"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        forward_backward(run, next_batches(run), backward=True)
        update_ms = []
        for _ in range(5):
            synchronize(run.device)
            start = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(run.trainable, 1.0)
            run.optimizer.step()
            synchronize(run.device)
            update_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        cleanup(run)
    return statistics.median(rates[WARMUP_STEPS:]), statistics.median(update_ms)


def main(path: Path, steps: int) -> None:
    base = load_recipe(path)
    seq_len, batch = base.data.max_seq_len, base.train.micro_batch_size
    with tempfile.TemporaryDirectory() as tmp:
        def recipe_for(name: str):
            return load_recipe(path, [f"output.dir={Path(tmp) / name}", f"train.max_steps={steps}", "train.log_every=1",
                                      "train.eval_every=null", "train.eval_at_start=false", "train.save_every=null",
                                      "data.eval_path=null"])

        bench = run_step_bench(base, StepBenchConfig(steps=5, warmup=2, chat=True))
        vocab = bench.model["vocab_size"]
        rows = {row.name: row for row in bench.rows}

        gen = torch.Generator().manual_seed(0)
        long = [TokenizedExample(ids, ids) for ids in torch.randint(0, vocab, (8 * batch, seq_len), generator=gen).tolist()]
        long_rate, _ = train_rate(recipe_for("long"), packs_of_one(long), Path(tmp) / "long", steps)

        # bench step's chat rows: the conversations that fill 4 micro-batches, packed best-fit.
        _, packs = whole_micro_batches(synthetic_conversations(4 * batch * seq_len, seq_len, vocab, 0),
                                       seq_len, batch)
        mixed_rate, update_ms = train_rate(recipe_for("mixed"), packs, Path(tmp) / "mixed", steps)

    chat_row = rows[PACKED]
    micro_batches = len(packs) // batch
    chat_with_update = chat_row.tokens / ((chat_row.step_ms + micro_batches * update_ms) * 1e-3)
    print(f"{bench.device}, {bench.dtype}, {path.name}, {steps} train steps (median after {WARMUP_STEPS})")
    print(f"{'shape':8} {'train tok/s':>12} {'bench tok/s':>12} {'train/bench':>12}")
    for name, trained, benched in (("long", long_rate, rows[LIGERTUNE].tokens_per_s),
                                   ("mixed", mixed_rate, chat_with_update)):
        print(f"{name:8} {trained:12,.0f} {benched:12,.0f} {trained / benched:12.3f}")
    print(f"(mixed: bench's packed-chat row {chat_row.tokens_per_s:,.0f} tok/s forward + backward, "
          f"plus {update_ms:.1f} ms of clipping + optimizer step per micro-batch)")


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = 16
    if "--steps" in args:
        i = args.index("--steps")
        steps = int(args[i + 1])
        del args[i : i + 2]
    main(Path(args[0]) if args else RECIPE, steps)
