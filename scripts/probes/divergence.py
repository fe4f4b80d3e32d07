"""Measures the fused linear divergence against the GEMMs it must do, and where its extra time goes
(a GPU).

Findings: docs/PERF.md, the fused linear divergence (2026-11-25 and after).

    python3 scripts/probes/divergence.py [--divergence jsd|forward_kl|reverse_kl] [--repeats N] [--configs]

For each of `bench kernels`' three distillation shapes (bf16, 10% of the rows ignored), timed alike
(`bench.timing.measure`, CUDA events, median):

    floor          the four GEMMs of `bench kernels`' floor, each over all the supervised rows at
                   once (before 2026-11-29: over every row, the ignored 10% too)
    fused          the fused loss's forward + backward (`bench kernels`' ligertune row), with chunk
                   budgets of 1 GiB (the default), 2 and 4 GiB: fewer chunks, fewer passes of the
                   weight gradient's accumulation over its [V, H] output
    chunked GEMMs  the fused loss's GEMMs alone, chunk by chunk as its loop runs them (both logits,
                   grad_h, grad_W written by the first chunk and accumulated by the others), over
                   the supervised rows, without the row kernel
    row kernel     the row kernel alone over one 1 GiB chunk of random logits, and over the
                   problem's own first chunk (the student's restored before each call, untimed),
                   times the number of chunks; with the bytes it moves (passes x two bf16 rows
                   read, one written) and the bandwidth that makes. The own chunk is timed twice:
                   as it is, and with the chunk's two logits GEMMs run (untimed) before each call,
                   as in the loss. Under the GEMMs' power draw an H200 lowers its SM clock (1980
                   to about 1470 MHz) and the kernel slows with it (docs/PERF.md, 2026-11-29,
                   thirteenth run); run right after the loss's timings, the other two rows may
                   already find the clock lowered.

so that fused ~ chunked GEMMs + row kernel (after GEMMs), and the floor's distance splits into the
chunking's share and the row kernel's.

`--configs` times the row kernel alone under other launches (`LAUNCHES`: BLOCK_V columns a loop
step, warps a program; fewer registers a thread let more programs share an SM) against the default
of `_row_kernel_config`, each with its bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch

import ligertune.kernels.divergence as row_kernel
from ligertune.bench.kernels import _drop_grads, _step
from ligertune.bench.problems import DIVERGENCE_FLOOR, JSD_BETA, divergence_problem
from ligertune.bench.timing import measure
from ligertune.devices import release_memory
from ligertune.kernels import DivergenceOptions, fused_linear_divergence
from ligertune.kernels.chunked_loss import _chunk_rows

SHAPES = [dict(N=8192, H=4096, V=128256), dict(N=16384, H=2048, V=128256), dict(N=4096, H=3584, V=152064)]
GIB = 1 << 30
# row transfers of the row kernel with a gradient: passes over both rows read, and the gradient written
ROW_TRANSFERS = {"jsd": 3 * 2 + 1, "reverse_kl": 2 * 2 + 1, "forward_kl": 2 * 2 + 1}


def chunked_gemms(x: dict[str, torch.Tensor], rows: torch.Tensor, chunk: int):
    """The fused loss's GEMMs alone, as its chunk loop runs them over the supervised `rows`."""
    hidden, weight = x["hidden"].detach(), x["weight"].detach()
    teacher_hidden, teacher_weight = x["teacher_hidden"], x["teacher_weight"]
    n, vocab = rows.numel(), weight.shape[0]
    student = torch.empty(min(chunk, n), vocab, dtype=hidden.dtype, device=hidden.device)
    teacher = torch.empty_like(student)
    grad_h, grad_w = torch.zeros_like(hidden), torch.empty_like(weight)

    def run() -> None:
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h_c, ht_c = (t.index_select(0, rows[start:end]) for t in (hidden, teacher_hidden))
            b_s, b_t = student[: end - start], teacher[: end - start]
            torch.mm(h_c, weight.t(), out=b_s)
            torch.mm(ht_c, teacher_weight.t(), out=b_t)
            grad_h.index_copy_(0, rows[start:end], b_s @ weight)
            if start == 0:
                torch.mm(b_s.t(), h_c, out=grad_w)
            else:
                grad_w.addmm_(b_s.t(), h_c)

    return run


def row_kernel_alone(rows: int, vocab: int, divergence: str, device: torch.device,
                     given: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """One chunk of the row kernel, with a gradient, over random logits or the `given` student's
    logits, teacher's logits and targets: the call, and what restores the student's logits that it
    overwrites (to run before each call, untimed)."""
    if given is None:
        gen = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(rows, vocab, generator=gen, device=device).to(torch.bfloat16)
        teacher = torch.randn(rows, vocab, generator=gen, device=device).to(torch.bfloat16)
        targets = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    else:
        logits, teacher, targets = given
    student = torch.empty_like(logits)
    values = torch.empty(rows, 4, dtype=torch.float32, device=device)
    correct = torch.empty(rows, 2, dtype=torch.int32, device=device)
    options = DivergenceOptions(divergence=divergence, beta=JSD_BETA, reduction="mean")

    def run() -> None:
        row_kernel.divergence_chunk(student, teacher, targets, None, values, correct, options=options,
                                    grad_scale=1.0 / rows, compute_grad=True)

    return run, lambda: student.copy_(logits)


LAUNCHES = [(1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
"""(BLOCK_V, num_warps) of the row kernel that `--configs` times."""


def launches(rows: int, vocab: int, divergence: str, device: torch.device) -> None:
    """The row kernel alone over one chunk of `rows`, under each of `LAUNCHES` and the default."""
    original = row_kernel._row_kernel_config
    default = original(vocab)
    moved = ROW_TRANSFERS[divergence] * rows * vocab * 2
    run, restore = row_kernel_alone(rows, vocab, divergence, device)
    try:
        for launch in [default, *(c for c in LAUNCHES if c != default)]:
            row_kernel._row_kernel_config = lambda vocab, launch=launch: launch
            ms = measure(run, device=device, warmup=2, repeats=10, memory=False,
                         before_each=restore).median_ms
            label = f"BLOCK_V {launch[0]}, {launch[1]} warps" + (" (default)" if launch == default else "")
            print(f"  row kernel, {label:<30} {ms:6.2f} ms a chunk of {rows} rows, {moved / ms / 1e6:,.0f} GB/s")
    finally:
        row_kernel._row_kernel_config = original


def split(problem, dims: dict[str, int], divergence: str, time, floor_ms: float, device: torch.device) -> None:
    x = problem.inputs
    vocab = dims["V"]
    rows = (x["targets"] != -100).nonzero().squeeze(1)
    options = DivergenceOptions(divergence=divergence, beta=JSD_BETA, reduction="mean")

    for budget in (1, 2, 4):
        opts = dataclasses.replace(options, chunk_bytes=budget * GIB)

        def fused(opts=opts):
            fused_linear_divergence(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"],
                                    x["targets"], options=opts).loss.backward()

        ms = time(fused).median_ms
        chunk = _chunk_rows(rows.numel(), vocab, 4, budget * GIB)
        print(f"  fused, {budget} GiB chunks ({-(-rows.numel() // chunk)} of {chunk} rows)"
              f"{ms:9.2f} ms  {ms / floor_ms:5.3f}x floor  +{ms - floor_ms:5.2f} ms")

    chunk = _chunk_rows(rows.numel(), vocab, 4, GIB)
    gemm_ms = time(chunked_gemms(x, rows, chunk)).median_ms
    print(f"  chunked GEMMs, 1 GiB chunks        {gemm_ms:9.2f} ms  {gemm_ms / floor_ms:5.3f}x floor  "
          f"+{gemm_ms - floor_ms:5.2f} ms")
    first = rows[:chunk]
    h_c, ht_c = x["hidden"][first].detach(), x["teacher_hidden"][first]
    with torch.no_grad():
        own = (h_c @ x["weight"].t(), ht_c @ x["teacher_weight"].t(), x["targets"][first])

    def gemms() -> None:
        # The chunk's two logits products, as the loss runs them before the kernel: the same values again.
        with torch.no_grad():
            torch.mm(h_c, x["weight"].t(), out=own[0])
            torch.mm(ht_c, x["teacher_weight"].t(), out=own[1])

    chunks = rows.numel() / chunk
    moved = ROW_TRANSFERS[divergence] * chunk * vocab * 2
    for label, given, after_gemms in (("random logits", None, False), ("the problem's first chunk", own, False),
                                      ("the same, after its GEMMs", own, True)):
        run, restore = row_kernel_alone(chunk, vocab, divergence, device, given)
        before = (lambda restore=restore: (gemms(), restore())) if after_gemms else restore
        one = measure(run, device=device, warmup=2, repeats=10, memory=False, before_each=before).median_ms
        print(f"  row kernel, {chunks:.2f} chunks of {chunk} rows, {label} {one * chunks:9.2f} ms  "
              f"({one:.2f} ms a chunk, {moved / 1e9:.2f} GB at {moved / one / 1e6:,.0f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--divergence", default="jsd", choices=("jsd", "forward_kl", "reverse_kl"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--configs", action="store_true", help="time the row kernel under other launches")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; {args.divergence}, bf16, forward + backward")
    for dims in SHAPES:
        problem = divergence_problem(dims, device, torch.bfloat16, seed=0, divergence=args.divergence)
        floor = next(i for i in problem.impls if i.name == DIVERGENCE_FLOOR)
        time = functools.partial(measure, device=device, warmup=2, repeats=args.repeats, memory=False,
                                 before_each=functools.partial(_drop_grads, problem))
        floor_ms = time(_step(problem, floor.run, True)).median_ms
        floor.run.release()
        label = "x".join(str(dims[k]) for k in ("N", "H", "V"))
        print(f"\n{label}: 4 GEMMs {floor_ms:.2f} ms")
        split(problem, dims, args.divergence, time, floor_ms, device)
        if args.configs:
            rows = int((problem.inputs["targets"] != -100).sum())
            launches(_chunk_rows(rows, dims["V"], 4, GIB), dims["V"], args.divergence, device)
        del problem
        release_memory(device)


if __name__ == "__main__":
    main()
