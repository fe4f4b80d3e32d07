"""Measures where a sharded training step's time goes: compute, communication hidden behind it,
communication left exposed, and the device idle (a GPU machine; runs on 2 gloo processes too).

Findings: docs/PERF.md, the scaling of the 1B full fine-tune (2026-11-27 and after).

    torchrun --nproc-per-node N scripts/probes/fsdp.py [RECIPE] [--set KEY=VALUE ...]
    # RECIPE: recipes/bench/llama-3.2-1b.yaml; N = 1 gives the one-process step to compare with

The run is `ligertune train`'s (`training.setup`: FSDP2 over N processes, or one process), with
`scripts/multi_gpu.py`'s settings (float32 weights stepped, `optim.master_weights=true`). After
`WARMUP` steps, each phase runs `REPEATS` times (`bench.timing.measure`: CUDA events on the GPU; the
step's collectives keep the processes together), median shown:

    forward         `forward_backward(run, batches, backward=False)`
    forward+back    `forward_backward(run, batches, backward=True)`, the gradients then dropped
    step            `train_step(run, batches)`: the above, clipping, the update, the schedule
    step, new data  `train_step(run, next_batches(run))`: the step over the data's next batches,
                    each repeat its own (their packs differ from the first's in conversations and
                    tokens: its distance to `step` is the data's, not the loop's)
    loop step       one step of `ligertune train`'s loop: the stop signals' check (a collective
                    read back on several processes), the next batches, the step, its metrics record
                    (`train.log_every` 1, as `scripts/multi_gpu.py` runs); its distance to `step,
                    new data` is what the loop adds around the step

Then `PROFILED` steps under the profiler on every process; rank 0 prints the medians of its
device's timeline over a step: kernels other than NCCL's (compute), NCCL's (communication), the part
of communication that runs while no compute kernel does (exposed), and the time no kernel runs
(idle), each as the union of the kernels' intervals between the step's first and last kernel. For
the median step, the exposed communication by collective (all-gather, reduce-scatter, all-reduce)
and the longest exposed and idle stretches, with their offsets from the step's first kernel: near 0
the first layer's gather, at the end the last reductions and the optimizer's wait.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from ligertune.bench.timing import measure
from ligertune.distributed import (
    all_reduce_sum,
    destroy_process_group,
    finished_together,
    topology_from_environment,
)
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, forward_backward, log, next_batches, setup, train_step
from ligertune.training.trainer import stop_requested

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench" / "llama-3.2-1b.yaml"
OUTPUT = Path(tempfile.gettempdir()) / "ligertune-fsdp-probe"  # the run writes its metrics there, and is replaced
SETTINGS = ("optim.master_weights=true", "train.log_every=1", "train.eval_every=null",
            "train.eval_at_start=false", "train.save_every=null", "train.max_steps=1000",
            f"output.dir={OUTPUT}", "output.overwrite=true")
WARMUP = 3
REPEATS = 5
PROFILED = 3
STRETCHES = 5


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the intersection of two unions of intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the union `a` outside the union `b`."""
    left, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > at:
                left.append((at, b[k][0]))
            at = max(at, b[k][1])
            k += 1
        if at < end:
            left.append((at, end))
    return left


def collective(name: str) -> str:
    """The kind of an NCCL kernel, from its name (`ncclDevKernel_AllGather_RING_LL`, ...)."""
    lowered = name.lower()
    return next((kind for kind in ("AllGather", "ReduceScatter", "AllReduce", "Broadcast")
                 if kind.lower() in lowered), "other")


def device_timeline(step) -> dict | None:
    """One `step()` on this process's GPU (None without CUDA): milliseconds of compute,
    communication, exposed communication (by collective) and idle, and the longest exposed and idle
    stretches with their offsets from the step's first kernel."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return None
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    comm = union([(e.time_range.start, e.time_range.end) for e in nccl])
    compute = union([(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()])
    first = min(e.time_range.start for e in kernels)
    span = max(e.time_range.end for e in kernels) - first
    busy = union(comm + compute)
    exposed_by_kind: dict[str, float] = {}
    stretches = []
    for e in nccl:
        for start, end in subtract([(e.time_range.start, e.time_range.end)], compute):
            kind = collective(e.name)
            exposed_by_kind[kind] = exposed_by_kind.get(kind, 0.0) + (end - start) / 1e3
            stretches.append(((end - start) / 1e3, (start - first) / 1e3, kind))
    gaps = [((end - start) / 1e3, (start - first) / 1e3) for start, end in subtract([(first, first + span)], busy)]
    return {
        "parts": {"span": span / 1e3, "compute": length(compute) / 1e3, "communication": length(comm) / 1e3,
                  "exposed": (length(comm) - overlap(comm, compute)) / 1e3, "idle": (span - length(busy)) / 1e3},
        "exposed_by_kind": exposed_by_kind,
        "exposed_stretches": sorted(stretches, reverse=True)[:STRETCHES],
        "idle_gaps": sorted(gaps, reverse=True)[:STRETCHES],
    }


def show_timelines(timelines: list[dict]) -> None:
    """The parts' medians over the profiled steps, then the median step's exposed communication by
    collective and its longest exposed and idle stretches."""
    print(f"\nrank 0's device over {len(timelines)} profiled steps (median)\n| part | ms |\n|---|---:|")
    for name in timelines[0]["parts"]:
        print(f"| {name} | {statistics.median(t['parts'][name] for t in timelines):.1f} |")
    middle = sorted(timelines, key=lambda t: t["parts"]["span"])[len(timelines) // 2]
    print(f"\nthe median step ({middle['parts']['span']:.1f} ms): exposed communication by collective")
    for kind, ms in sorted(middle["exposed_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<14} {ms:7.1f} ms")
    print("  longest exposed stretches (ms, at ms): "
          + ", ".join(f"{kind} {ms:.1f} at {at:.0f}" for ms, at, kind in middle["exposed_stretches"]))
    print("  longest idle gaps (ms, at ms): " + ", ".join(f"{ms:.1f} at {at:.0f}" for ms, at in middle["idle_gaps"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", type=Path, default=RECIPE)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    topology = topology_from_environment()
    run = setup(load_recipe(args.recipe, [*SETTINGS, *args.overrides]), Console(quiet=True))
    try:
        batches = next_batches(run)
        local = torch.tensor(float(sum(int(b.num_tokens) for b in batches)), dtype=torch.float64, device=run.device)
        tokens = int(all_reduce_sum(local).item())  # every process's
        for _ in range(WARMUP):
            train_step(run, batches)

        def timed(action, before_each=None) -> float:
            return measure(action, device=run.device, warmup=1, repeats=REPEATS, memory=False,
                           before_each=before_each).median_ms

        def drop_gradients():
            run.model.zero_grad(set_to_none=True)

        phases = {"forward": timed(lambda: forward_backward(run, batches, backward=False)),
                  "forward+back": timed(lambda: forward_backward(run, batches, backward=True), drop_gradients),
                  "step": timed(lambda: train_step(run, batches)),
                  "step, new data": timed(lambda: train_step(run, next_batches(run))),
                  "loop step": timed(lambda: stop_requested(run, None) or log(run, train_step(run, next_batches(run))))}
        timelines = [t for _ in range(PROFILED) if (t := device_timeline(lambda: train_step(run, batches)))]
    finally:
        cleanup(run)
    if topology.is_main:
        step = phases["step"]
        print(f"{args.recipe}, {topology.world_size} process(es), {tokens} tokens a step "
              f"({tokens / step * 1e3:,.0f} tokens/s)")
        print("| phase | ms |\n|---|---:|")
        for name, ms in phases.items():
            print(f"| {name} | {ms:.1f} |")
        print(f"| backward (forward+back - forward) | {phases['forward+back'] - phases['forward']:.1f} |")
        print(f"| clipping, optimizer, schedule (step - forward+back) | {step - phases['forward+back']:.1f} |")
        print(f"| the data (step, new data - step) | {phases['step, new data'] - step:.1f} |")
        print(f"| the loop around the step (loop step - step, new data) | "
              f"{phases['loop step'] - phases['step, new data']:.1f} |")
        if timelines:
            show_timelines(timelines)


if __name__ == "__main__":
    main()
    finished_together()
    destroy_process_group()
