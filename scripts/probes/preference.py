"""Measures where a preference step's time goes: the reference pass, forward, backward, and the rest of
the trainer's step (clipping, optimizer, schedule), on `bench step`'s synthetic pairs (a GPU).

Findings: docs/PERF.md, "Preference training" (2026-11-25) and the sixteenth run (2026-11-29).

    python3 scripts/probes/preference.py [RECIPE] [--pairs N] [--prompt-len N] [--answer-len N]
                                         [--length-spread F] [--seed N] [--set KEY=VALUE ...]
    # (recipes/bench/llama-3.2-1b-dpo.yaml, 2830, 1190)

The run, pairs and micro-batches are `bench step`'s `ligertune` row's (`bench.preference`). After two
warm-up steps, each phase runs `REPEATS` times, the device synchronized around it, median shown:

    reference       `compute_reference_logps` over the step's packs (what `train` runs once); beside
                    it, the same forwards with the packs collated ahead, and one forward of all of
                    them (what the pass could cost)
    forward         `forward_backward(run, batches, backward=False)`: the forward with autograd on
    forward+back    `forward_backward(run, batches, backward=True)`, the gradients then dropped
    step            `train_step(run, batches)`: the above, clipping, the update, the schedule

backward = forward+back - forward; optimizer and the rest = step - forward+back. Then one step and one
reference pass under the profiler: device time by kernel kind (`scripts/probes/step.py`'s kinds), and
the time the device sat idle between kernels (the longest gaps named by the kernels around them).
With `--peers`, the same for one timed step of TRL's trainer and of TRL + Liger's, as `bench step`
runs them (which attention kernels they take, and how long their device waits).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import ProfileSummary, kind_of, profile_kinds, profile_summary  # the SFT step probe's

from ligertune.bench.preference import PreferenceStepBench, pair_shape
from ligertune.bench.step import StepBenchConfig, new_report, tokenizer_vocab
from ligertune.data import collate_preferences
from ligertune.devices import synchronize
from ligertune.recipe import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench" / "llama-3.2-1b-dpo.yaml"
REPEATS = 5


def timed(fn, device) -> float:
    times = []
    for _ in range(REPEATS):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(args: argparse.Namespace) -> None:
    from ligertune.objectives.reference import compute_reference_logps
    from ligertune.training.build import build_run
    from ligertune.training.step import forward_backward, train_step

    recipe = load_recipe(args.recipe, args.set)
    config = StepBenchConfig(pairs=args.pairs, prompt_len=args.prompt_len, answer_len=args.answer_len,
                             length_spread=args.length_spread, seed=args.seed, measure_matmul=False)
    device, report = new_report(recipe, config, str(args.recipe), print)
    bench = PreferenceStepBench(recipe, config, device, tokenizer_vocab(recipe), report, print)
    bench.shape = pair_shape(recipe, config)
    model = bench._model(kernels=True).module
    run = build_run(recipe, model, device=device, total_steps=100)
    packs = bench._packs()
    compute_reference_logps(run.engine, packs, device)
    size = recipe.train.micro_batch_size
    batches = [collate_preferences(packs[i : i + size]).to(device) for i in range(0, len(packs), size)]
    for _ in range(2):
        train_step(run, batches)
    copies = [dataclasses.replace(p, reference_logps=None) for p in packs]

    def forward_and_back() -> None:
        forward_backward(run, batches, backward=True)
        run.model.zero_grad(set_to_none=True)

    # The reference pass against what it could cost: its packs collated ahead, and one forward of the
    # micro-batch (all packs at once); eval mode and no gradient, as the pass runs.
    from ligertune.objectives.reference import score_answers

    alone = [collate_preferences([p]).to(device) for p in copies]
    together = collate_preferences(copies).to(device)

    def scored(group) -> None:
        run.engine.eval()
        with torch.no_grad():
            [score_answers(run.engine, b) for b in group]
        run.engine.train()

    for name, group in (("packs collated ahead", alone), ("the packs in one forward", [together])):
        print(f"reference, {name}: {timed(lambda group=group: scored(group), device):.1f} ms")
    phases = {
        "reference": timed(lambda: compute_reference_logps(run.engine, copies, device), device),
        "forward": timed(lambda: forward_backward(run, batches, backward=False), device),
        "forward+back": timed(forward_and_back, device),
        "step": timed(lambda: train_step(run, batches), device),
    }
    split = {
        "reference": phases["reference"],
        "forward": phases["forward"],
        "backward": phases["forward+back"] - phases["forward"],
        "optimizer and the rest": phases["step"] - phases["forward+back"],
    }
    total = phases["step"] + phases["reference"]
    print(f"{report.device}; {bench.shape.pairs} pairs of {bench.shape.tokens} tokens packed; "
          f"checkpointing: {recipe.train.gradient_checkpointing}")
    for name, ms in split.items():
        print(f"{name:24} {ms:8.1f} ms {100 * ms / total:5.1f}%")
    print(f"{'step + reference':24} {total:8.1f} ms  -> {bench.shape.pairs / total * 1e3:.2f} pairs/s")
    if device.type != "cuda":
        return
    for name, fn in (("one step", lambda: train_step(run, batches)),
                     ("the reference pass", lambda: compute_reference_logps(run.engine, copies, device))):
        show_profile(name, profile_kinds(fn))
    if args.peers:
        from ligertune.bench.peers import find_peer

        for liger in (False, True) if find_peer("liger").available else (False,):
            show_profile(f"one step of TRL's trainer{' + Liger' if liger else ''}", profile_trl(bench, liger))


SHOWN_KERNELS = {"attention": 4, "copy/elementwise": 6, "other": 3}
"""The costliest kernels shown of each of these kinds (where the time beside the GEMMs goes)."""


def show_profile(name: str, summary: ProfileSummary) -> None:
    kinds, kernels, gaps = summary
    busy = sum(kinds.values())
    print(f"{name} under the profiler: {busy:.1f} ms of device time; the device idle "
          f"{sum(ms for ms, _, _ in gaps):.1f} ms in {len(gaps)} gaps")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:20} {ms:8.1f} ms {100 * ms / busy:5.1f}%")
    for kind, shown in SHOWN_KERNELS.items():
        for kernel, ms, calls in [k for k in kernels if kind_of(k[0]) == kind][:shown]:
            print(f"  {kind:17} {ms:8.2f} ms {calls:5d}x  {kernel[:90]}")
    for ms, before, after in gaps[:4]:
        print(f"  idle {ms:6.2f} ms  {before[:50]}  ->  {after[:50]}")


def profile_trl(bench: PreferenceStepBench, liger: bool) -> ProfileSummary:
    """`profile_kinds`' results for the first timed step of `bench step`'s TRL row (+ Liger)."""
    from torch.profiler import ProfilerActivity, profile

    from ligertune.bench import preference as bench_preference

    summaries = []

    class ProfiledClock(bench_preference.StepClock):
        def on_step_begin(self, args, state, control, **kwargs):
            super().on_step_begin(args, state, control, **kwargs)
            if state.global_step == self.warmup:
                self.profiler = profile(activities=[ProfilerActivity.CUDA])
                self.profiler.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            super().on_step_end(args, state, control, **kwargs)  # the device synchronized
            if state.global_step == self.warmup + 1:
                self.profiler.__exit__(None, None, None)
                summaries.append(profile_summary(self.profiler))

    loss = bench_preference.TRL_LOSSES[bench.recipe.objective.name]
    original, bench_preference.StepClock = bench_preference.StepClock, ProfiledClock
    try:
        bench._trl("TRL", liger, loss)
    finally:
        bench_preference.StepClock = original
    return summaries[0]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", type=Path, default=RECIPE)
    parser.add_argument("--pairs", type=int, default=None, help="as bench step's (default: a pack a pair)")
    parser.add_argument("--prompt-len", type=int, default=2830)
    parser.add_argument("--answer-len", type=int, default=1190)
    parser.add_argument("--length-spread", type=float, default=None, help="as bench step's")
    parser.add_argument("--seed", type=int, default=0, help="as bench step's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--peers", action="store_true",
                        help="also profile a step of TRL's trainer and of TRL + Liger's (trl, liger-kernel)")
    main(parser.parse_args())
