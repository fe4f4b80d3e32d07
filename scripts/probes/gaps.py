"""Measures where the trainer's loop leaves the GPU idle (a GPU).

Findings: docs/PERF.md, "Bench's chat rows and the trainer, again" (the device's idle gaps, and what
the prefetch of the next step's batches bought).

    python3 scripts/probes/gaps.py [RECIPE]   # (recipes/bench/llama-3.2-1b.yaml)

Runs `ligertune train`'s own step functions (`next_batches`, `train_step`, `log`) on the long shape
(every pack one `max_seq_len`-token conversation, as in bench step's synthetic row) and prints:

- the host's time per step in each function, and in the parts of making a step's batches;
- under the profiler, over 3 steps: the share of the wall clock the device spends in kernels, and
  the largest idle gaps with the kernels on either side.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from torch.profiler import ProfilerActivity, profile

from ligertune.data.batching import collate
from ligertune.data.chat import TokenizedExample
from ligertune.data.packing import packs_of_one
from ligertune.devices import synchronize
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, log, next_batches, setup, train_step
from ligertune.training.build import packs_per_step
from ligertune.training.state import PackStream

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench" / "llama-3.2-1b.yaml"


def median_ms(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(statistics.median(values) * 1e3, 2) for name, values in samples.items()}


def main(path: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(path, [f"output.dir={tmp}/run", "train.max_steps=100", "train.log_every=1",
                                    "train.eval_every=null", "train.eval_at_start=false",
                                    "train.save_every=null", "data.eval_path=null"])
        run = setup(recipe, Console(quiet=True))
        try:
            seq_len, batch = recipe.data.max_seq_len, recipe.train.micro_batch_size
            rows = torch.randint(0, len(run.tokenizer), (8 * batch, seq_len), generator=torch.Generator().manual_seed(0))
            run.stream = PackStream(packs_of_one([TokenizedExample(ids, ids) for ids in rows.tolist()]),
                                    recipe.train.seed)
            run.head.train()

            def step() -> tuple[float, ...]:
                t0 = time.perf_counter()
                batches = next_batches(run)
                t1 = time.perf_counter()
                stats = train_step(run, batches)
                t2 = time.perf_counter()
                log(run, stats)
                t3 = time.perf_counter()
                return t1 - t0, t2 - t1, t3 - t2

            for _ in range(4):
                step()
            phases: dict[str, list[float]] = {"next_batches": [], "train_step": [], "log": []}
            for _ in range(8):
                for name, seconds in zip(phases, step()):
                    phases[name].append(seconds)
            print("host ms per step:", median_ms(phases))

            parts: dict[str, list[float]] = {"take": [], "collate": [], "to device": []}
            for _ in range(8):
                synchronize(run.device)
                t0 = time.perf_counter()
                packs = run.stream.take(run.state, packs_per_step(recipe.train, 1))
                t1 = time.perf_counter()
                collated = collate(packs)
                t2 = time.perf_counter()
                collated.to(run.device)
                t3 = time.perf_counter()
                for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                    parts[name].append(seconds)
            print("making one step's batches, ms:", median_ms(parts))

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                synchronize(run.device)
            report_gaps(prof)
        finally:
            cleanup(run)


def report_gaps(prof) -> None:
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                     key=lambda e: e.time_range.start)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy, gaps, end, previous = 0, [], kernels[0].time_range.start, None
    for event in kernels:
        if event.time_range.start > end:
            gaps.append((event.time_range.start - end, previous.name if previous else "", event.name))
        busy += max(0, event.time_range.end - max(event.time_range.start, end))
        if event.time_range.end > end:
            end, previous = event.time_range.end, event
    print(f"3 steps: {span / 1e3:.1f} ms, kernels {busy / 1e3:.1f} ms ({busy / span:.1%} busy), "
          f"{sum(g[0] for g in gaps) / 1e3:.1f} ms idle in {len(gaps)} gaps; the largest:")
    for gap, before, after in sorted(gaps, reverse=True)[:10]:
        print(f"  {gap / 1e3:7.2f} ms  after {before[:48]!r}  before {after[:48]!r}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else RECIPE)
