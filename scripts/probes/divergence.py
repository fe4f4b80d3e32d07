"""Measures the fused linear divergence's row kernel against the GEMMs it must do, over launch
configurations of the row kernel (a GPU).

Findings: docs/PERF.md, the fused linear divergence (2026-11-25 and after).

    python3 scripts/probes/divergence.py [--divergence jsd|forward_kl] [--repeats N]

For each of `bench kernels`' three distillation shapes (bf16, 10% of the rows ignored, 1 GiB chunks),
the fused loss's forward + backward (`bench kernels`' ligertune row) and the four GEMMs of its floor,
timed alike (`bench.timing.measure`, CUDA events, median). The row kernel's launch is varied:

    programs   one per row (the default), or a fixed number that each take rows one after another:
               fewer rows in flight at once, so that the second and third passes over a row (two
               bf16 rows of the vocabulary, 0.5 MiB at 128k) may find it in the L2 cache (50 MiB on
               an H100) rather than in device memory
    num_warps  8 (the default at these vocabularies) or 16

The table: ms, ms over the floor's, and the extra time over the floor.
"""

from __future__ import annotations

import argparse
import functools

import torch

import ligertune.kernels.divergence as row_kernel
from ligertune.bench.kernels import _drop_grads, _step
from ligertune.bench.problems import DIVERGENCE_FLOOR, divergence_problem
from ligertune.bench.timing import measure
from ligertune.devices import release_memory

SHAPES = [dict(N=8192, H=4096, V=128256), dict(N=16384, H=2048, V=128256), dict(N=4096, H=3584, V=152064)]


def configs(sms: int) -> list[tuple[str, int | None, int | None]]:
    """(label, programs, num_warps); None keeps the default."""
    out = [("default", None, None)]
    for programs in (4 * sms, 2 * sms, sms, sms // 2):
        out.append((f"{programs} programs", programs, None))
    out.append(("16 warps", None, 16))
    out.append((f"{sms} programs, 16 warps", sms, 16))
    return out


def with_launch(programs: int | None, num_warps: int | None):
    default = row_kernel._row_kernel_config

    def config(vocab: int, n_rows: int) -> tuple[int, int, int]:
        block_v, warps, rows = default(vocab, n_rows)
        return block_v, num_warps or warps, programs or rows

    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--divergence", default="jsd", choices=("jsd", "forward_kl"))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; {args.divergence}, bf16, forward + backward")
    default = row_kernel._row_kernel_config
    for dims in SHAPES:
        problem = divergence_problem(dims, device, torch.bfloat16, seed=0, divergence=args.divergence)
        ours = problem.impls[0]
        floor = next(i for i in problem.impls if i.name == DIVERGENCE_FLOOR)
        time = functools.partial(measure, device=device, warmup=2, repeats=args.repeats, memory=False,
                                 before_each=functools.partial(_drop_grads, problem))
        floor_ms = time(_step(problem, floor.run, True)).median_ms
        label = "x".join(str(dims[k]) for k in ("N", "H", "V"))
        print(f"\n{label}: 4 GEMMs {floor_ms:.2f} ms")
        for name, programs, warps in configs(sms):
            row_kernel._row_kernel_config = with_launch(programs, warps)
            try:
                ms = time(_step(problem, ours.run, False)).median_ms
            finally:
                row_kernel._row_kernel_config = default
            print(f"  {name:28} {ms:8.2f} ms  {ms / floor_ms:5.3f}x floor  +{ms - floor_ms:5.2f} ms")
        floor.run.release()
        del problem
        release_memory(device)


if __name__ == "__main__":
    main()
