"""Everything that needs a GPU, in one run: kernel correctness at real sizes, model checks, benchmarks.

    python3 scripts/gpu_check.py --out OUT_DIR

Stages, each timed and isolated (a failing stage prints its traceback and the next one runs):

    env              versions, the GPU, whether Liger-Kernel and Cut Cross-Entropy import
    kernels          every Triton kernel against `ligertune.kernels.reference` at realistic shapes,
                     bf16 and fp32, values and gradients (relative error ||a - b|| / ||b|| against
                     the reference in float32 for bf16 inputs, float64 for fp32 inputs). A kernel
                     passes when its error is within twice that of the same-dtype reference (the
                     error any implementation in that dtype has), or under a small floor.
    model-patched    a small Llama: loss and every gradient with ligertune's kernels (RMSNorm,
                     RoPE, SwiGLU, fused loss) equal those of the unpatched model
    model-packed     the same model: conversations packed in one row (varlen attention on CUDA in
                     bf16) give the loss and gradients of the conversations run one by one
    bench-kernels    `ligertune bench kernels` at its GPU shapes
    bench-step       `ligertune bench step recipes/bench/llama-3.2-1b.yaml`

Written under OUT_DIR: gpu_check.json (every number and each stage's status), gpu_check.log (all
that is printed), bench_kernels.json, bench_kernels.png (when matplotlib imports), bench_step.json.
The peers are optional; to measure against them, install them first:

    pip install liger-kernel cut-cross-entropy

The whole run takes under 3 minutes on an H100 (140 s measured), `--quick` about one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

STAGES = ("env", "kernels", "model-patched", "model-packed", "bench-kernels", "bench-step")


class Tee:
    """stdout that is also written to a log file, flushed line by line."""

    def __init__(self, path: Path):
        self.file = path.open("w", encoding="utf-8")
        self.stdout = sys.stdout

    def write(self, text: str) -> int:
        self.stdout.write(text)
        self.file.write(text)
        if "\n" in text:
            self.flush()
        return len(text)

    def flush(self) -> None:
        self.stdout.flush()
        self.file.flush()

    def isatty(self) -> bool:
        return False


def say(text: str = "") -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------------------------------
# stage: env


def stage_env(args) -> dict[str, Any]:
    import torch

    from ligertune.bench.peers import find_peer, versions
    from ligertune.kernels import active_path

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this script checks the GPU path")
    props = torch.cuda.get_device_properties(0)
    info = {
        "device": torch.cuda.get_device_name(0),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "sms": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "kernel_path": active_path("cuda"),
        "versions": versions(),
        "peers": {key: (peer.version if peer.available else peer.unavailable)
                  for key, peer in ((k, find_peer(k)) for k in ("liger", "cce"))},
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    for key, value in info.items():
        say(f"  {key}: {value}")
    return info


# --------------------------------------------------------------------------------------------------
# stage: kernels


BF16_FLOOR = 2e-3
FP32_FLOOR = 1e-5


class Checker:
    """Collects comparisons: the kernel's error and the same-dtype reference's error, both against
    a higher-precision reference."""

    def __init__(self):
        self.rows: list[dict[str, Any]] = []

    def compare(self, case: str, names, got, same, high, dtype) -> None:
        from ligertune.bench.kernels import relative_error

        import torch

        floor = BF16_FLOOR if dtype in (torch.bfloat16, torch.float16) else FP32_FLOOR
        for name, g, s, h in zip(names, got, same, high):
            if g is None and h is None:
                continue
            err = relative_error(g, h)
            yardstick = relative_error(s, h) if s is not None else math.nan
            limit = max(floor, 2.0 * yardstick) if math.isfinite(yardstick) else floor
            ok = math.isfinite(err) and err <= limit
            self.rows.append({"case": case, "output": name, "error": err, "reference_error": yardstick,
                              "limit": limit, "ok": ok})
            mark = "ok  " if ok else "FAIL"
            say(f"  {mark} {case:<46} {name:<12} err {err:.2e}   same-dtype reference {yardstick:.2e}")

    def exact(self, case: str, name: str, got, want, slack: int = 0) -> None:
        got, want = int(got), int(want)
        ok = abs(got - want) <= slack
        self.rows.append({"case": case, "output": name, "got": got, "want": want, "ok": ok})
        say(f"  {'ok  ' if ok else 'FAIL'} {case:<46} {name:<12} {got} vs {want}")


def _run(fn: Callable, inputs: dict, grad_outputs=None, scalar_index: int | None = 0):
    """(outputs..., grads of the floating leaves) of fn(**inputs) with backward."""
    import torch

    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = fn(**inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if grad_outputs is None:
        outs[scalar_index].backward()
    else:
        differentiable = [o for o in outs if o.requires_grad]
        torch.autograd.backward(differentiable, [g.to(o.dtype) for g, o in zip(grad_outputs, differentiable)])
    grads = tuple(t.grad for t in leaves)
    for t in leaves:
        t.grad = None
    return tuple(o.detach() for o in outs), grads


def _cast(inputs: dict, dtype) -> dict:
    import torch

    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "token_weights":
            out[k] = v.detach().to(dtype).requires_grad_(v.requires_grad)
        else:
            out[k] = v
    return out


def _triple(checker, case, fn_kernel, fn_ref, inputs, dtype, names, grad_outputs=None, counts=()):
    """Kernel on `inputs`, reference on the same inputs, reference in higher precision: compare."""
    import torch

    high = torch.float32 if dtype != torch.float32 else torch.float64
    got_o, got_g = _run(fn_kernel, inputs, grad_outputs)
    same_o, same_g = _run(fn_ref, inputs, grad_outputs)
    hi_go = None if grad_outputs is None else [g.to(high) for g in grad_outputs]
    high_o, high_g = _run(fn_ref, _cast(inputs, high), hi_go)
    value_idx = [i for i, n in enumerate(names) if not n.startswith("grad")]
    got = [got_o[i] for i in value_idx] + list(got_g)
    same = [same_o[i] for i in value_idx] + list(same_g)
    hi = [high_o[i] for i in value_idx] + list(high_g)
    checker.compare(case, [names[i] for i in value_idx] + [n for n in names if n.startswith("grad")],
                    got, same, hi, dtype)
    for index, name in counts:  # integer outputs (accuracy counts) must match the high-precision reference
        checker.exact(case, name, got_o[index], high_o[index], slack=max(1, int(got_o[index]) // 10000))
    del got_o, got_g, same_o, same_g, high_o, high_g


def stage_kernels(args) -> dict[str, Any]:
    import torch

    from ligertune import kernels
    from ligertune.kernels import reference

    dev = torch.device("cuda")
    checker = Checker()
    gen = torch.Generator(device=dev).manual_seed(1)
    bf16, fp32 = torch.bfloat16, torch.float32
    quick = args.quick

    def randn(*shape, dtype, scale=1.0, grad=True):
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype).requires_grad_(grad)

    # ---- fused linear cross-entropy
    def flce_inputs(n, h, v, dtype, ignored=0.1):
        targets = torch.randint(0, v, (n,), generator=gen, device=dev)
        targets[torch.rand(n, generator=gen, device=dev) < ignored] = -100
        return {
            "hidden": randn(n, h, dtype=dtype),
            "weight": randn(v, h, dtype=dtype, scale=2.0 / math.sqrt(h)),
            "targets": targets,
            "token_weights": (0.5 + torch.rand(n, generator=gen, device=dev)) / n,
        }

    def flce(impl, **options):
        def fn(hidden, weight, targets, token_weights):
            extra = dict(options)
            if extra.pop("weighted", False):
                extra["token_weights"] = token_weights
            out = impl(hidden, weight, targets, **extra)
            return out.loss, out.z_loss.detach(), out.n_correct, out.n_tokens
        return fn

    names = ("loss", "z_loss", "n_correct", "n_tokens", "grad_hidden", "grad_weight")
    flce_cases = [
        ("N8192-H4096-V128256 bf16 mean", (8192, 4096, 128256), bf16, {}),
        ("N8192-H4096-V128256 bf16 +options sum", (8192, 4096, 128256), bf16,
         dict(z_loss_weight=1e-4, label_smoothing=0.1, weighted=True, reduction="sum")),
        ("N8192-H4096-V128256 bf16 64MiB chunks", (8192, 4096, 128256), bf16, dict(chunk_bytes=64 * 2**20)),
        ("N4096-H3584-V152064 bf16 softcap 30", (4096, 3584, 152064), bf16, dict(softcap=30.0)),
        ("N4093-H2048-V32003 fp32 +options", (4093, 2048, 32003), fp32,
         dict(z_loss_weight=1e-4, label_smoothing=0.1, weighted=True, reduction="sum")),
    ]
    if quick:
        flce_cases = [(c, (1031, 512, 32003), d, o) for c, _, d, o in flce_cases[:2]]
    for case, (n, h, v), dtype, options in flce_cases:
        inputs = flce_inputs(n, h, v, dtype)
        _triple(checker, f"flce {case}", flce(kernels.fused_linear_cross_entropy, **options),
                flce(reference.fused_linear_cross_entropy, **options), inputs, dtype,
                [n_ for n_ in names if n_ not in ("n_correct", "n_tokens")],
                counts=((2, "n_correct"), (3, "n_tokens")))
        del inputs
        torch.cuda.empty_cache()

    # reduction="none": the backward that recomputes, with an upstream gradient per row
    n, h, v = (2048, 2048, 128256) if not quick else (517, 256, 32003)
    inputs = flce_inputs(n, h, v, bf16)

    def flce_none(impl):
        def fn(hidden, weight, targets, token_weights):
            return impl(hidden, weight, targets, reduction="none", label_smoothing=0.1).loss
        return fn

    upstream = [torch.rand(n, generator=gen, device=dev)]
    _triple(checker, f"flce N{n}-H{h}-V{v} bf16 none +smoothing",
            flce_none(kernels.fused_linear_cross_entropy), flce_none(reference.fused_linear_cross_entropy),
            inputs, bf16,
            ("loss", "grad_hidden", "grad_weight"), grad_outputs=upstream)
    del inputs
    torch.cuda.empty_cache()

    # ---- rms_norm, rope, swiglu
    t = 16384 if not quick else 1031
    for dtype in (bf16, fp32):
        tag = "bf16" if dtype == bf16 else "fp32"
        for offset in (0.0, 1.0):
            weight = (1 + 0.1 * torch.randn(4096, generator=gen, device=dev)).to(dtype).requires_grad_(True)
            x = {"x": randn(t, 4096, dtype=dtype), "weight": weight}
            dy = [randn(t, 4096, dtype=dtype, grad=False)]
            _triple(checker, f"rms_norm T{t}-H4096 {tag} offset {offset:g}",
                    lambda x, weight, o=offset: kernels.rms_norm(x, weight, 1e-6, o),
                    lambda x, weight, o=offset: reference.rms_norm(x, weight, 1e-6, o),
                    x, dtype, ("y", "grad_x", "grad_weight"), grad_outputs=dy)
        b, seq, hq, hk, d = (4, 4096, 32, 8, 128) if not quick else (2, 257, 8, 2, 64)
        q = randn(b, seq, hq, d, dtype=dtype)
        k = randn(b, seq, hk, d, dtype=dtype)
        pos = torch.arange(seq, device=dev, dtype=torch.float32)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
        cos = emb.cos()[None].expand(b, seq, d).to(dtype).contiguous()
        sin = emb.sin()[None].expand(b, seq, d).to(dtype).contiguous()

        def rope(impl):
            # q and k as transformers hands them over: [B, L, H, D] projections, transposed.
            return lambda q, k, cos, sin: tuple(impl(q.transpose(1, 2), k.transpose(1, 2), cos, sin))

        grads = [randn(b, hq, seq, d, dtype=dtype, grad=False), randn(b, hk, seq, d, dtype=dtype, grad=False)]
        _triple(checker, f"rope B{b}-L{seq}-Hq{hq}-Hk{hk}-D{d} {tag}", rope(kernels.apply_rope),
                rope(reference.apply_rope), {"q": q, "k": k, "cos": cos, "sin": sin}, dtype,
                ("q", "k", "grad_q", "grad_k"), grad_outputs=grads)
        ti = 14336 if not quick else 1376
        g = {"gate": randn(t, ti, dtype=dtype), "up": randn(t, ti, dtype=dtype)}
        _triple(checker, f"swiglu T{t}-I{ti} {tag}", kernels.swiglu, reference.swiglu, g, dtype,
                ("y", "grad_gate", "grad_up"), grad_outputs=[randn(t, ti, dtype=dtype, grad=False)])
        del q, k, g, x
        torch.cuda.empty_cache()

    failed = [r for r in checker.rows if not r["ok"]]
    say(f"  {len(checker.rows) - len(failed)}/{len(checker.rows)} comparisons passed")
    return {"rows": checker.rows, "failed": len(failed), "passed": not failed}


# --------------------------------------------------------------------------------------------------
# stages: model checks


SMALL_LLAMA = {
    "model_type": "llama", "vocab_size": 3001, "hidden_size": 512, "intermediate_size": 1376,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}


def _small_model(dtype, attention: str):
    import torch

    from ligertune.models import build_model
    from ligertune.recipe import ModelConfig

    cfg = ModelConfig(config=dict(SMALL_LLAMA), attention=attention)
    model = build_model(cfg, device="cuda", dtype=dtype, seed=0)
    model.train()
    return model


def _loss_and_grads(head, model, batches) -> tuple[float, "torch.Tensor"]:
    """Sum of the losses over `batches` (each: args and kwargs of `head`), and the gradient of every
    parameter, flattened into one vector."""
    import torch

    model.zero_grad(set_to_none=True)
    total = 0.0
    for a, kw in batches:
        out = head(*a, **kw)
        out.loss.backward()
        total += out.loss.item()
    grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return total, grads


def _conversations(lengths, vocab, seed=0):
    import random

    from ligertune.data.chat import TokenizedExample

    rng = random.Random(seed)
    examples = []
    for n in lengths:
        ids = [rng.randrange(vocab) for _ in range(n)]
        prompt = n // 3
        examples.append(TokenizedExample(ids, [-100] * prompt + ids[prompt:]))
    return examples


def stage_model_patched(args) -> dict[str, Any]:
    import torch

    from ligertune.bench.kernels import relative_error
    from ligertune.data.batching import collate
    from ligertune.data.packing import pack
    from ligertune.models import CausalLMLoss, patch_model, unpatch_model

    results = []
    for dtype, tol_loss, tol_grad in ((torch.float32, 1e-5, 1e-4), (torch.bfloat16, 1e-2, 5e-2)):
        model = _small_model(dtype, "packed")
        examples = _conversations([300, 1000, 57, 641], SMALL_LLAMA["vocab_size"])
        batch = collate(pack(examples, 2048)).to("cuda")
        supervised = (batch.targets != -100).float()
        weights = supervised / supervised.sum()
        call = [((batch.input_ids, batch.position_ids, batch.targets, weights),
                 {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen})]
        plain_loss, plain_grads = _loss_and_grads(CausalLMLoss(model, fused=False), model, call)
        report = patch_model(model)
        try:
            fused_loss, fused_grads = _loss_and_grads(CausalLMLoss(model, fused=True), model, call)
        finally:
            unpatch_model(model)
        err_loss = abs(fused_loss - plain_loss) / abs(plain_loss)
        err_grad = relative_error(fused_grads, plain_grads)
        ok = err_loss <= tol_loss and err_grad <= tol_grad
        tag = str(dtype).removeprefix("torch.")
        say(f"  {'ok  ' if ok else 'FAIL'} patched vs unpatched {tag}: loss {fused_loss:.6f} vs "
            f"{plain_loss:.6f} (err {err_loss:.1e}), gradients err {err_grad:.1e}   [{report.describe()}]")
        results.append({"dtype": tag, "loss": fused_loss, "loss_unpatched": plain_loss,
                        "loss_error": err_loss, "grad_error": err_grad, "ok": ok})
        del model
        torch.cuda.empty_cache()
    return {"rows": results, "passed": all(r["ok"] for r in results)}


def stage_model_packed(args) -> dict[str, Any]:
    import torch

    from ligertune.bench.kernels import relative_error
    from ligertune.data.batching import collate
    from ligertune.data.packing import pack
    from ligertune.models import CausalLMLoss, patch_model

    results = []
    lengths = [37, 700, 5, 513, 64, 1, 1200, 300]
    for dtype, tol_loss, tol_grad in ((torch.float32, 1e-5, 1e-4), (torch.bfloat16, 1e-2, 5e-2)):
        model = _small_model(dtype, "packed")
        patch_model(model)
        head = CausalLMLoss(model, fused=True)
        examples = _conversations(lengths, SMALL_LLAMA["vocab_size"], seed=1)
        packs = pack(examples, 2048)
        total = sum(sum(t != -100 for t in p.targets) for p in packs)

        def weights_of(targets):
            return (targets != -100).float() / total

        packed_calls = []
        for i in range(0, len(packs), 2):
            batch = collate(packs[i : i + 2]).to("cuda")
            args_ = (batch.input_ids, batch.position_ids, batch.targets, weights_of(batch.targets))
            packed_calls.append((args_, {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen}))
        # One conversation per forward, no packing kwargs: plain causal attention of the model.
        single_calls = []
        for example in examples:
            batch = collate(pack([example], 2048)).to("cuda")
            args_ = (batch.input_ids, batch.position_ids, batch.targets, weights_of(batch.targets))
            single_calls.append((args_, {}))
        packed_loss, packed_grads = _loss_and_grads(head, model, packed_calls)
        single_loss, single_grads = _loss_and_grads(head, model, single_calls)
        err_loss = abs(packed_loss - single_loss) / abs(single_loss)
        err_grad = relative_error(packed_grads, single_grads)
        ok = err_loss <= tol_loss and err_grad <= tol_grad
        tag = str(dtype).removeprefix("torch.")
        say(f"  {'ok  ' if ok else 'FAIL'} packed ({len(packs)} packs, {len(packed_calls)} micro-batches) vs "
            f"{len(examples)} conversations one by one, {tag}: loss {packed_loss:.6f} vs {single_loss:.6f} "
            f"(err {err_loss:.1e}), gradients err {err_grad:.1e}")
        results.append({"dtype": tag, "loss_packed": packed_loss, "loss_single": single_loss,
                        "loss_error": err_loss, "grad_error": err_grad, "ok": ok})
        del model, head
        torch.cuda.empty_cache()
    return {"rows": results, "passed": all(r["ok"] for r in results)}


# --------------------------------------------------------------------------------------------------
# stages: benchmarks


def _console():
    from rich.console import Console

    return Console(file=sys.stdout, width=150, force_terminal=False, highlight=False)


def stage_bench_kernels(args) -> dict[str, Any]:
    from ligertune.bench.kernels import KernelBenchConfig, run_kernel_bench
    from ligertune.bench.report import kernel_tables, plot_kernels, write_json

    config = KernelBenchConfig(repeats=args.repeats, compile=not args.no_compile)
    if args.quick:
        config.shapes = {"flce": [(2048, 2048, 32000)], "rms_norm": [(4096, 4096)],
                         "rope": [(1, 2048, 32, 8, 128)], "swiglu": [(4096, 8192)]}
    started = time.perf_counter()
    report = run_kernel_bench(
        config, log=lambda line: say(f"  .. {line} ({time.perf_counter() - started:.0f}s)")
    )
    console = _console()
    for table in kernel_tables(report):
        console.print(table)
    data = report.to_dict()
    write_json(args.out / "bench_kernels.json", data)
    try:
        plot_kernels(report, args.out / "bench_kernels.png")
    except Exception as err:  # the plot is a nicety; the numbers are in the JSON
        say(f"  no plot: {err}")
    return {"rows": len(report.rows), "failed_rows": [f"{r.kernel} {r.shape} {r.impl}: {r.detail}"
                                                       for r in report.rows if r.status == "failed"],
            "summary": _kernel_summary(report)}


def _kernel_summary(report) -> list[str]:
    """The numbers the performance targets are stated in, one line per FLCE shape."""
    lines = []
    shapes = list(dict.fromkeys(r.shape for r in report.rows if r.kernel == "flce"))
    for shape in shapes:
        rows = {r.impl.split(" (")[0] if r.impl.startswith("ligertune (") else r.impl: r
                for r in report.rows if r.kernel == "flce" and r.shape == shape}
        ms = {k: (r.timing.median_ms if r.timing else None) for k, r in rows.items()}
        base = ms.get("ligertune")
        parts = [f"ligertune {base:.1f} ms" if base else "ligertune -"]
        for key, label in (("3 GEMMs (floor)", "floor"), ("cce", "cce"), ("liger", "liger"),
                           ("torch eager", "eager")):
            if base and ms.get(key):
                parts.append(f"{label} {ms[key]:.1f} ms ({ms[key] / base:.2f}x)")
        opt = ms.get("ligertune +options")
        if base and opt:
            parts.append(f"options +{100 * (opt / base - 1):.1f}%")
        low = next((r for k, r in rows.items() if k.startswith("ligertune low-mem")), None)
        if low is not None and low.timing is not None and low.timing.extra_peak_mib is not None:
            parts.append(f"low-mem {low.timing.median_ms:.1f} ms / {low.timing.extra_peak_mib:.0f} MiB")
        if base and rows["ligertune"].timing.extra_peak_mib is not None:
            parts.append(f"ligertune extra {rows['ligertune'].timing.extra_peak_mib:.0f} MiB")
        lines.append(f"flce {shape}: " + ", ".join(parts))
    for line in lines:
        say(f"  {line}")
    return lines


def stage_bench_step(args) -> dict[str, Any]:
    from ligertune.bench.report import step_header, step_table, write_json
    from ligertune.bench.step import StepBenchConfig, run_step_bench
    from ligertune.recipe import load_recipe

    path = ROOT / "recipes" / "bench" / "llama-3.2-1b.yaml"
    overrides = []
    if args.quick:
        overrides = ["data.max_seq_len=1024", "train.micro_batch_size=2"]
    recipe = load_recipe(path, overrides)
    started = time.perf_counter()
    report = run_step_bench(
        recipe, StepBenchConfig(steps=args.steps, warmup=2), recipe_name=str(path.relative_to(ROOT)),
        log=lambda line: say(f"  .. {line} ({time.perf_counter() - started:.0f}s)"),
    )
    console = _console()
    for line in step_header(report):
        console.print(f"  {line}")
    console.print(step_table(report))
    write_json(args.out / "bench_step.json", report.to_dict())
    return {
        "rows": [
            {k: r.to_dict()[k] for k in ("name", "status", "detail", "tokens_per_s", "peak_mem_gib", "mfu")}
            for r in report.rows
        ]
    }


# --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Directory for the JSON files, plot and log.")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"Comma-separated subset of {','.join(STAGES)}.")
    parser.add_argument("--repeats", type=int, default=10, help="Timed calls per kernel row.")
    parser.add_argument("--steps", type=int, default=5, help="Timed training steps per variant.")
    parser.add_argument("--no-compile", action="store_true",
                        help="Leave torch.compile out of the kernel bench.")
    parser.add_argument("--quick", action="store_true",
                        help="Small shapes everywhere: a smoke run in a minute.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(args.out / "gpu_check.log")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; choose from {STAGES}")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    functions = {
        "env": stage_env,
        "kernels": stage_kernels,
        "model-patched": stage_model_patched,
        "model-packed": stage_model_packed,
        "bench-kernels": stage_bench_kernels,
        "bench-step": stage_bench_step,
    }
    results: dict[str, Any] = {}
    start_all = time.perf_counter()
    for name in stages:
        say(f"== {name} ({time.perf_counter() - start_all:.0f}s elapsed)")
        start = time.perf_counter()
        try:
            result = functions[name](args)
            status = "failed" if result.get("passed") is False else "ok"
        except Exception as err:  # each stage stands alone: report it and go on
            traceback.print_exc(file=sys.stdout)
            result = {"error": f"{type(err).__name__}: {err}"}
            status = "error"
        finally:
            _free_cuda()
        seconds = time.perf_counter() - start
        results[name] = {"status": status, "seconds": round(seconds, 1), **result}
        say(f"== {name}: {status} in {seconds:.0f}s")
        from ligertune.bench.report import write_json

        write_json(args.out / "gpu_check.json", results)

    say("")
    say(f"summary ({time.perf_counter() - start_all:.0f}s):")
    for name, result in results.items():
        say(f"  {name:<14} {result['status']:<7} {result['seconds']:>6.0f}s"
            + (f"  {result['error']}" if "error" in result else ""))
    for line in results.get("bench-kernels", {}).get("summary", []):
        say(f"  {line}")
    for row in results.get("bench-step", {}).get("rows", []):
        tps = f"{row['tokens_per_s']:,.0f} tok/s" if row["tokens_per_s"] else row["detail"] or row["status"]
        mem = f", {row['peak_mem_gib']:.1f} GiB" if row["peak_mem_gib"] else ""
        mfu = f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] else ""
        say(f"  step {row['name']}: {tps}{mem}{mfu}")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


def _free_cuda() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # freeing memory between stages must not mask the stage's own result
        pass


if __name__ == "__main__":
    sys.exit(main())
