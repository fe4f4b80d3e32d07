"""What `ligertune bench kernels` measures: each kernel forward + backward, against its peers.

For every kernel and shape, one problem is drawn (`problems`: the inputs and the implementations
that run on them) and every implementation runs on those same inputs, in one process, one after
the other; a peer that is not installed, or needs CUDA, is reported as such, and one row that
fails does not stop the others.

Per row: median ms of forward + backward (`timing.measure`), throughput (the problem's nominal
flops or bytes over that time), extra peak memory, the speed-up of ligertune over the row (row ms /
ligertune ms: 1.5 means ligertune takes 1/1.5 of the row's time), and the relative error
||a - b|| / ||b|| of every output and gradient against `ligertune.kernels.reference` run on the
same inputs cast to float32 (float64 on a CPU). The Lion step has no backward: a row is one step,
in place, and its error is measured by the problem on a sample (`problems.lion_problem`).

Rows rated in GB/s also give their share of the memory roofline: of the data-sheet bandwidth of
the GPU (`PEAK_MEMORY_GBPS`, or `peak_gbps`), and of a device-to-device copy measured once in the
same run (`copy_gbps`), the most a streaming kernel reaches in practice.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ligertune.bench.peers import NOT_INSTALLED, PEERS, Peer, find_peer, versions
from ligertune.bench.problems import PROBLEMS, GemmFloor, Impl, Problem
from ligertune.bench.results import KernelReport, KernelRow, describe_error
from ligertune.bench.shapes import (
    CPU_SHAPES,
    DEFAULT_KERNELS,
    FLOP_RATED,
    GPU_SHAPES,
    KERNELS,
    SHAPE_DIMS,
    shape_label,
)
from ligertune.bench.timing import measure
from ligertune.devices import device_name, release_memory, resolve_device, resolve_dtype
from ligertune.errors import UserError
from ligertune.numerics import relative_error

PEAK_MEMORY_GBPS = (
    # (substring of the device name, memory bandwidth in GB/s from the data sheet); first match wins.
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("GH200 144G", 4900.0),
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("A10G", 600.0),
    ("4090", 1008.0),
)

COPY_BYTES = 2**30
"""Size of the buffer copied to measure the device's copy bandwidth: far beyond any L2 cache."""


@dataclass
class KernelBenchConfig:
    """What to run: kernels, shapes (None: the defaults of the device), dtype, repeats; `peak_gbps`
    replaces the data sheet's memory bandwidth."""

    kernels: tuple[str, ...] = DEFAULT_KERNELS
    shapes: dict[str, list[tuple[int, ...]]] | None = None
    device: str = "auto"
    dtype: str | None = None
    repeats: int | None = None
    warmup: int | None = None
    compile: bool | None = None
    flush_l2: bool = False
    seed: int = 0
    peak_gbps: float | None = None


def path_note(device: torch.device) -> str | None:
    """The line shown above the tables off CUDA: which path ran and what the numbers are worth."""
    if device.type == "cuda":
        return None
    from ligertune.kernels import active_path

    path = active_path(device)
    if path == "triton":
        interp = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        how = ("in the Triton interpreter (TRITON_INTERPRET=1)" if interp
               else "without TRITON_INTERPRET=1 (expect failures)")
        return (f"cpu: no GPU; ligertune runs its Triton kernels {how}, small shapes; "
                "timings say nothing of GPU speed")
    return ("cpu: no GPU; ligertune runs its pure-torch reference path (LIGERTUNE_KERNELS=triton with "
            "TRITON_INTERPRET=1 runs the Triton kernels in the interpreter), small shapes; timings say "
            "nothing of GPU speed")


def run_kernel_bench(config: KernelBenchConfig, log: Callable[[str], None] = lambda _: None) -> KernelReport:
    """Run every requested kernel at every shape; one `KernelRow` per implementation."""
    import datetime

    from ligertune.kernels import active_path

    device = resolve_device(config.device, key="--device")
    dtype = resolve_dtype(config.dtype, device, key="--dtype")
    try:
        active_path(device)
    except ValueError as err:  # a bad LIGERTUNE_KERNELS value is the user's to fix
        raise UserError(str(err)) from None
    on_cuda = device.type == "cuda"
    ref_dtype = torch.float32 if on_cuda else torch.float64
    repeats = config.repeats or (10 if on_cuda else 3)
    warmup = config.warmup if config.warmup is not None else (2 if on_cuda else 1)
    use_compile = on_cuda if config.compile is None else config.compile
    defaults = GPU_SHAPES if on_cuda else CPU_SHAPES
    unknown = [k for k in config.kernels if k not in KERNELS]
    if unknown:
        raise UserError(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}")

    peers = {key: find_peer(key) for key in PEERS}
    peak_gbps = config.peak_gbps
    if peak_gbps is None and on_cuda:
        peak_gbps = spec_memory_gbps(torch.cuda.get_device_name(device))
    copy_rate = None
    if on_cuda and any(k not in FLOP_RATED for k in config.kernels):  # the rows rated in GB/s
        log(f"measuring a {COPY_BYTES >> 20} MiB device-to-device copy for the attainable bandwidth")
        copy_rate = copy_gbps(device)
        release_memory(device)  # its 2 GiB back before the first problem is drawn
    rows: list[KernelRow] = []
    for kernel in config.kernels:
        shapes = (config.shapes or {}).get(kernel) or defaults[kernel]
        for values in shapes:
            dims = dict(zip(SHAPE_DIMS[kernel], values))
            label = shape_label(kernel, values)
            log(f"{kernel} {label}: drawing inputs")
            try:
                problem = PROBLEMS[kernel](dims, device, dtype, config.seed)
            except torch.cuda.OutOfMemoryError:  # e.g. an 8B Lion step on a smaller GPU
                problem = None
            if problem is None:  # outside the handler: its traceback no longer holds the tensors
                rows.append(KernelRow(kernel, label, dims, "(inputs)", "failed",
                                      "out of memory drawing the inputs"))
                release_memory(device)
                continue
            rows.extend(_run_problem(problem, label, peers, device, ref_dtype, repeats, warmup,
                                     use_compile, config.flush_l2, log))
            del problem
            release_memory(device)
    for row in rows:
        if row.gbps is not None:
            row.of_peak_bandwidth = row.gbps / peak_gbps if peak_gbps else None
            row.of_copy_bandwidth = row.gbps / copy_rate if copy_rate else None

    return KernelReport(
        device=device_name(device),
        device_type=device.type,
        kernel_path=active_path(device),
        dtype=str(dtype).removeprefix("torch."),
        reference_dtype=str(ref_dtype).removeprefix("torch."),
        repeats=repeats,
        warmup=warmup,
        note=path_note(device),
        versions=versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        rows=rows,
        peak_gbps=peak_gbps,
        copy_gbps=copy_rate,
    )


def spec_memory_gbps(name: str) -> float | None:
    """The data-sheet memory bandwidth of a known GPU, by its name (`PEAK_MEMORY_GBPS`)."""
    for key, value in PEAK_MEMORY_GBPS:
        if key in name:
            return value
    return None


def copy_gbps(device: torch.device) -> float:
    """GB/s of a device-to-device copy of `COPY_BYTES` (read once, written once: 2 x COPY_BYTES
    moved), median of 10 after 3 warm-ups: the bandwidth a streaming kernel can reach in practice."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), device=device, warmup=3, repeats=10, memory=False)
    return 2 * COPY_BYTES / (timing.median_ms * 1e-3) / 1e9


def _run_problem(problem, label, peers, device, ref_dtype, repeats, warmup, use_compile, flush_l2, log):
    references: dict[str, tuple[torch.Tensor, ...]] = {}
    rows = []
    # The first row is ligertune's default: the one the others are compared with, unless a row
    # names its own baseline.
    first = problem.impls[0].name if problem.impls else None
    measured_ms: dict[str, float] = {}
    for impl in problem.impls:
        row = KernelRow(problem.kernel, label, problem.dims, impl.name, "ok")
        rows.append(row)
        skip = _skip_reason(impl, peers, device, use_compile)
        if skip:
            row.status, row.detail = skip
            continue
        log(f"{problem.kernel} {label}: {impl.name}")
        run = impl.run
        try:
            if impl.setup is not None:
                impl.setup()
            if impl.compiled:
                run = torch.compile(impl.run, dynamic=False)
            # Every row gets its own copy of the inputs, and the error check another one: some
            # implementations write into their inputs or into the upstream gradient (in place), which
            # must reach neither the next row nor the comparison with the reference.
            work = _fresh_copy(problem) if problem.copy_inputs else problem
            row.timing = measure(
                _step(work, run, impl.manual), device=device, warmup=warmup, repeats=repeats,
                flush_l2=flush_l2, before_each=functools.partial(_drop_grads, work),
            )
            del work
            if impl.manual:
                if problem.check is not None:
                    row.errors = problem.check(impl)
            else:
                if impl.semantics not in references:
                    references[impl.semantics] = _reference_results(problem, impl.semantics, ref_dtype)
                row.errors = _errors(_fresh_copy(problem), run, references[impl.semantics])
        except Exception as err:  # one broken row must not hide the others
            row.status = "failed"
            row.detail = describe_error(err)
            row.timing = None
        finally:
            if impl.teardown is not None:
                impl.teardown()
            if isinstance(impl.run, GemmFloor):
                impl.run.release()
            if impl.compiled:
                _reset_compile()
            release_memory(device)
        if row.timing is None:
            continue
        ms = row.timing.median_ms
        measured_ms[impl.name] = ms
        n_bytes = impl.bytes or problem.bytes
        if problem.flops:
            row.tflops = problem.flops / (ms * 1e-3) / 1e12
        if n_bytes:
            row.gbps = n_bytes / (ms * 1e-3) / 1e9
        base_ms = measured_ms.get(impl.baseline or first)
        if base_ms is not None:
            row.vs_ligertune = ms / base_ms
    return rows


def _skip_reason(impl: Impl, peers: dict[str, Peer], device: torch.device, use_compile: bool):
    if impl.peer is not None:
        peer = peers[impl.peer]
        if not peer.available:
            return ("not installed" if peer.unavailable == NOT_INSTALLED else "failed"), peer.unavailable
        if device.type != "cuda" and not impl.peer_on_cpu:
            return "skipped", "needs CUDA"
    if impl.compiled and not use_compile:
        return "skipped", "torch.compile is off (--compile to run it)"
    return None


def _step(problem: Problem, run, manual: bool) -> Callable[[], None]:
    """Forward and backward once; gradients land in the leaves' `.grad`."""

    def step():
        outputs = run(problem.inputs)
        if manual:
            return
        if problem.grad_outputs is None:
            outputs[0].backward()
        else:
            torch.autograd.backward(outputs, problem.grad_outputs)

    return step


def _fresh_copy(problem: Problem) -> Problem:
    """The problem with its own copies of the inputs (leaves again) and of the upstream gradients."""
    inputs = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in problem.inputs.items()}
    grad_outputs = None if problem.grad_outputs is None else tuple(g.clone() for g in problem.grad_outputs)
    return dataclasses.replace(problem, inputs=inputs, grad_outputs=grad_outputs)


def _drop_grads(problem: Problem) -> None:
    for _, t in problem.leaves:
        t.grad = None


def _results(run, inputs: dict[str, torch.Tensor], grad_outputs) -> tuple[torch.Tensor, ...]:
    """(outputs..., gradient of every leaf) of one forward + backward on `inputs`."""
    leaves = [t for t in inputs.values() if t.requires_grad]
    for t in leaves:  # a timed call before may have left its gradients, which backward would add to
        t.grad = None
    outputs = run(inputs)
    if grad_outputs is None:
        outputs[0].backward()
    else:
        # A fresh copy: some implementations write their input gradient into the upstream one.
        torch.autograd.backward(outputs, [g.clone() for g in grad_outputs])
    grads = tuple(t.grad for t in leaves)
    for t in leaves:
        t.grad = None
    return tuple(o.detach() for o in outputs) + grads


def _reference_results(problem: Problem, semantics: str, ref_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    def upcast(name: str, t: torch.Tensor) -> torch.Tensor:
        # Token weights keep float32, as the kernels take them; integer targets stay integers.
        if not t.is_floating_point() or name == "token_weights":
            return t
        return t.detach().to(ref_dtype).requires_grad_(t.requires_grad)

    inputs = {name: upcast(name, t) for name, t in problem.inputs.items()}
    grad_outputs = None
    if problem.grad_outputs is not None:
        grad_outputs = tuple(g.to(ref_dtype) for g in problem.grad_outputs)
    return _results(lambda x: problem.reference(x, semantics), inputs, grad_outputs)


def _errors(problem: Problem, run, reference: tuple[torch.Tensor, ...]) -> dict[str, float]:
    got = _results(run, problem.inputs, problem.grad_outputs)
    return {name: relative_error(a, b) for name, a, b in zip(problem.output_names, got, reference)}


def _reset_compile() -> None:
    try:
        torch._dynamo.reset()
    except Exception:  # resetting is tidiness, never a reason to fail
        pass
