"""Measures where a training step's time and memory go (ligertune, HF + Liger) and the loss's chunk budget.

Findings: docs/PERF.md, "Where the step goes" (under "One training step") and "Low-memory chunk
budget" (under "Fused linear cross-entropy").

    python3 scripts/probes/step.py step [RECIPE] [--set KEY=VALUE ...] [--no-peers]  # one step of each variant
    python3 scripts/probes/step.py chunks   # fused loss, forward + backward, at several chunk budgets

`step` runs `bench step`'s variants (ligertune, HF, HF + Liger when importable) of RECIPE
(recipes/bench/llama-3.2-1b.yaml) and, after two warm-up steps of each, one more step under the
profiler and one under the allocator's history:

- device time by kernel kind (GEMMs in bf16 and in float8, the casts to float8, attention, the
  loss's row kernel, norms, RoPE, SwiGLU, optimizer, copies and elementwise kernels), the
  kernels that took the most, and the longest stretches with no kernel running, named by the
  kernels on either side;
- the GEMMs, copies, elementwise and other kernels by what launched them: the operator and its
  callers, the line of ligertune, transformers, peft or Liger code, the input shapes (and for a
  matrix product the TFLOP/s it ran at);
- the host's time by operator (its own time, waits for the device included);
- peak memory by phase (forward, backward, clipping + optimizer step);
- at the step's peak, the live allocations by the line of Python that made them.

`chunks` times ligertune's fused loss at `bench kernels`' three shapes with chunk budgets from
64 MiB to 1 GiB, next to Liger-Kernel's when importable. CUDA only.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.checkpoint import set_checkpoint_early_stop

from ligertune.bench.timing import measure

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "bench" / "llama-3.2-1b.yaml"
SHAPES = [(8192, 4096, 128256), (16384, 2048, 128256), (4096, 3584, 152064)]
CHUNK_MIB = (64, 96, 120, 128, 1024)

KINDS = [  # first match wins
    ("attention", r"sdpa|flash|fmha|attention"),
    ("float8 cast", r"quantize_rows|transpose_kernel|float8_copy"),
    ("GEMM float8", r"nvjet_sm90_qq|e4m3|e5m2|f8f8"),
    ("GEMM", r"nvjet|gemm|cutlass|xmma"),
    ("loss rows", r"cross_entropy"),
    ("norm", r"rms_norm"),
    ("rope", r"rope"),
    ("swiglu", r"swiglu|silu"),
    ("optimizer", r"FusedOpti|multi_tensor|foreach|norm_kernel|reduce_kernel"),
    ("copy/elementwise", r"elementwise|copy|Cat|index|fill|embedding|scatter|gather|Memset"),
]


ProfileSummary = tuple[dict[str, float], list[tuple[str, float, int]], list[tuple[float, str, str]]]
"""Device ms by kernel kind; (kernel, ms, calls) by ms; (ms, kernel before, kernel after) of each idle gap."""


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, kernel, re.IGNORECASE)), "other")


def profile_kinds(step) -> ProfileSummary:
    """Device ms by kernel kind; the kernels by device ms: (name, ms, calls); and the gaps in the
    device's timeline (no kernel nor copy running), longest first: (ms, the kernel before, the one
    after), the step's idle time being their sum."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return profile_summary(prof)


def profile_summary(prof) -> ProfileSummary:
    """`profile_kinds`' three results from a finished `torch.profiler.profile` of CUDA activity."""
    by_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.device_time_total / 1e3
        kernels.append((event.key, event.device_time_total / 1e3, event.count))
    timeline = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA)
    return dict(by_kind), sorted(kernels, key=lambda k: -k[1]), idle_gaps(timeline)


def idle_gaps(timeline: list[tuple[float, float, str]]) -> list[tuple[float, str, str]]:
    """(ms, before, after) for each stretch of the sorted (start us, end us, name) intervals that no
    interval covers, longest first."""
    gaps = []
    busy_until, last = None, ""
    for start, end, name in timeline:
        if busy_until is not None and start > busy_until:
            gaps.append(((start - busy_until) / 1e3, last, name))
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    return sorted(gaps, reverse=True)


CODE_OF_INTEREST = ("ligertune", "transformers", "peft", "liger_kernel")
"""Packages whose innermost frame names where an allocation or a kernel launch came from."""


def _of_interest(filename: str) -> bool:
    return any(package in filename for package in CODE_OF_INTEREST)


def _site(frames) -> str:
    ours = [f for f in frames if _of_interest(f["filename"])]
    f = (ours or frames or [{"filename": "(no Python frame)", "line": 0, "name": ""}])[0]
    return f"{Path(f['filename']).name}:{f['line']} {f['name']}".strip()


SITE_KINDS = ("copy/elementwise", "other", "GEMM", "GEMM float8")
"""The kernel kinds `launch_sites` attributes: the small ones, whose cause a kernel name hides, and
the GEMMs, whose shapes say what each multiplies and how near the peak it runs."""


def matmul_flops(op: str, shapes: list) -> float | None:
    """2 M N K of a matrix product operator from its input shapes (`aten::mm`: [M, K], [K, N];
    `aten::addmm` and `addmm_`: C, [M, K], [K, N]); None for any other operator."""
    first = 1 if op in ("aten::addmm", "aten::addmm_") else 0
    if op not in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::_scaled_mm") or len(shapes) < first + 2:
        return None
    a, b = shapes[first], shapes[first + 1]
    if len(a) != 2 or len(b) != 2:
        return None
    return 2.0 * a[0] * a[1] * b[1]


def launch_sites(events, kinds=SITE_KINDS) -> list[tuple[str, float, int, str, float | None]]:
    """The device time of kernels of `kinds` by what launched them: (kind, ms, kernels, where,
    TFLOP/s), where = the operator and up to three callers, the innermost frame of
    `CODE_OF_INTEREST`, and the operator's input shapes, most ms first; TFLOP/s where the operator is
    a matrix product (`matmul_flops`), else None. `events`: the profiler's events (`prof.events()`
    with `with_stack` and `record_shapes`): a CPU operator carries the kernels it launched, its caller
    (`cpu_parent`) and its Python stack."""
    sites: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0, 0.0])
    for event in events:
        counted = False  # an operator's FLOPs once, however many kernels it launched
        for kernel in getattr(event, "kernels", None) or []:
            kind = kind_of(kernel.name)
            if kind not in kinds:
                continue
            chain, parent = [event.name], event.cpu_parent
            while parent is not None and len(chain) < 4:
                if parent.name != chain[-1]:
                    chain.append(parent.name)
                parent = parent.cpu_parent
            frame = next((f for f in event.stack or [] if _of_interest(f)), None)
            where = " < ".join(chain)
            if frame:  # "/path/file.py(line): function"
                path, _, rest = frame.partition("(")
                where += f"  {Path(path).name}({rest}"
            shapes = list(event.input_shapes or [])
            where += f"  {shapes[:3]}"
            site = sites[(kind, where)]
            site[0] += kernel.duration / 1e3
            site[1] += 1
            if not counted:
                site[2] += matmul_flops(event.name, shapes) or 0.0
                counted = True
    return sorted(((kind, ms, n, where, flops / ms / 1e9 if flops and ms else None)
                   for (kind, where), (ms, n, flops) in sites.items()), key=lambda s: -s[1])


def kernel_sites(step) -> list[tuple[str, float, int, str]]:
    """`launch_sites` of one step under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    return launch_sites(prof.events())


def host_ops(step) -> list[tuple[str, float, int]]:
    """The host's time by operator in one step (self time: what it did itself, waits included, as
    in a synchronization): (name, ms, calls), the most first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    ops = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    return sorted(ops, key=lambda op: -op[1])


def peak_allocations(step) -> tuple[float, list[tuple[str, float, int]]]:
    """The step's own peak (GiB above what was allocated before it) and what was live then, by site."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        sites[site][0] += size
        sites[site][1] += 1
    ranked = sorted(((s, b / 2**20, n) for s, (b, n) in sites.items()), key=lambda r: -r[1])
    return peak / 2**30, ranked


def showing_tracebacks(fn):
    """`fn`, printing the traceback of what it raises before raising it: the bench shows only the
    exception's line, the probe where it came from."""
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            traceback.print_exc()
            raise

    return wrapper


def observed(measure, step):
    """`measure(step)`; where a checkpointed step fails under it with torch's "returned NULL without
    setting an exception" (seen under torch 2.11's profiler, not understood yet), once more with the
    checkpoint's early stop off, which recomputes each layer to its end, and says so."""
    try:
        return measure(step)
    except SystemError as err:
        print(f"  {measure.__name__}: the step failed ({err}); again with the checkpoint's early stop off")
        with set_checkpoint_early_stop(False):
            return measure(step)


def probe_step(recipe: Path, overrides: list[str], peers: bool) -> None:
    from ligertune.bench import step as bench_step
    from ligertune.recipe import load_recipe

    phases: list[tuple[str, float]] = []
    recording = [False]  # only the probed step marks its phases
    original = (bench_step.StepBench._time, torch.Tensor.backward)

    def mark(phase: str) -> None:
        if recording[0]:
            phases.append((phase, torch.cuda.max_memory_allocated() / 2**30))
            torch.cuda.reset_peak_memory_stats()

    def backward(self, *args, **kwargs):
        mark("forward")
        out = original[1](self, *args, **kwargs)
        mark("backward")
        return out

    def finish(optimizer, args, kwargs):  # after any optimizer's step: clipping came before it
        mark("clip + optimizer")

    def probe(self, name, layout, steps, *args, **kwargs):
        if layout == "synthetic":
            step = steps[0]
            step()
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            torch.Tensor.backward = backward
            phases.clear()
            recording[0] = True
            try:
                step()
            finally:
                torch.Tensor.backward = original[1]
                recording[0] = False
            kinds, kernels, gaps = observed(profile_kinds, step)
            host = observed(host_ops, step)
            sites = observed(kernel_sites, step)
            peak, live = observed(peak_allocations, step)
            print(f"\n{name}: {sum(kinds.values()):.1f} ms of kernels: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
            others = [k for k in kernels[12:] if kind_of(k[0]) == "other"]  # not already among the first 12
            for kernel, ms, calls in kernels[:12] + others[:4]:
                print(f"    {ms:8.2f} ms {calls:5d}x  {kind_of(kernel):12} {kernel[:100]}")
            print(f"  the device idle {sum(ms for ms, _, _ in gaps):.1f} ms in {len(gaps)} gaps; the longest, "
                  "between the kernels named:")
            for ms, before, after in gaps[:8]:
                print(f"    {ms:8.2f} ms  {before[:60]}  ->  {after[:60]}")
            gemms = [site for site in sites if site[0].startswith("GEMM")]
            print(f"  GEMMs by what launched them ({sum(s[1] for s in gemms):.1f} ms; TFLOP/s of the operator):")
            for kind, ms, n, where, tflops in gemms[:24]:
                rate = f"{tflops:6.0f}" if tflops else "     -"
                print(f"    {ms:8.2f} ms {n:5d}x {rate} TFLOP/s  {where[:150]}")
            print("  copies, elementwise and other kernels by what launched them:")
            for kind, ms, n, where, _ in [site for site in sites if not site[0].startswith("GEMM")][:12]:
                print(f"    {ms:8.2f} ms {n:5d}x  {kind:12} {where[:160]}")
            print(f"  the host, {sum(ms for _, ms, _ in host):.1f} ms under the profiler; by operator (self time):")
            for op, ms, calls in host[:12]:
                print(f"    {ms:8.2f} ms {calls:5d}x  {op[:100]}")
            print("  peak GiB by phase: " + ", ".join(f"{p} {g:.2f}" for p, g in phases))
            print(f"  at the peak ({base:.2f} GiB before the step + {peak:.2f}), live by site:")
            for site, mib, count in live[:12]:
                print(f"    {mib:8.1f} MiB {count:4d}x  {site}")
        return original[0](self, name, layout, steps, *args, **kwargs)

    bench_step.StepBench._time = showing_tracebacks(probe)
    finished = register_optimizer_step_post_hook(finish)
    try:
        config = bench_step.StepBenchConfig(steps=3, warmup=1, chat=False, peers=peers, measure_matmul=False)
        report = bench_step.run_step_bench(load_recipe(recipe, overrides), config)
    finally:
        bench_step.StepBench._time = original[0]
        finished.remove()
    print()
    for row in report.rows:
        if row.step_ms:
            print(f"{row.name:12} {row.step_ms:7.1f} ms/step {row.tokens_per_s:9,.0f} tokens/s "
                  f"peak {row.peak_mem_gib:.3f} GiB")
        else:
            print(f"{row.name:12} {row.status}: {row.detail}")


def probe_chunks() -> None:
    from ligertune import kernels
    from ligertune.bench.peers import find_peer
    from ligertune.bench.problems import flce_problem

    liger = find_peer("liger").available
    for n, h, v in SHAPES:
        x = flce_problem({"N": n, "H": h, "V": v}, torch.device("cuda"), torch.bfloat16, 0).inputs
        runs = {f"ligertune {mib} MiB": (lambda mib=mib: kernels.fused_linear_cross_entropy(
            x["hidden"], x["weight"], x["targets"], chunk_bytes=mib << 20).loss) for mib in CHUNK_MIB}
        if liger:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            runs["Liger-Kernel"] = lambda: LigerFusedLinearCrossEntropyLoss()(x["weight"], x["hidden"], x["targets"])
        for name, loss in runs.items():
            def step(loss=loss):
                x["hidden"].grad = x["weight"].grad = None
                loss().backward()

            t = measure(step, device="cuda", repeats=10)
            print(f"N{n} H{h} V{v}  {name:20} {t.median_ms:8.2f} ms  extra {t.extra_peak_mib:7.1f} MiB")
        x = None  # the inputs freed before the next shape's are made (the closures above read x)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("this probe needs CUDA")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="step", choices=("step", "chunks"))
    parser.add_argument("recipe", nargs="?", type=Path, default=RECIPE)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="ligertune's variant only")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
    if args.what == "step":
        probe_step(args.recipe, args.overrides, args.peers)
    else:
        probe_chunks()
