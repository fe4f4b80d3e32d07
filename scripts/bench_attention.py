"""Attention alone, forward + backward, at the shapes of a training step: where do the milliseconds go?

Compares, on the same bf16 inputs (query [B, Hq, L, D], key/value [B, Hk, L, D], the layout the
attention modules of `transformers` hand over):

- ligertune's packed attention as training runs it (varlen FlashAttention over cu_seqlens; on a
  torch whose `varlen_attn` lacks `enable_gqa`, key and value heads are repeated first);
- SDPA, causal, with native GQA (`enable_gqa=True`), as HF's sdpa attention runs one sequence a row;
- SDPA with the cuDNN backend forced, where it runs.

Rows hold one sequence each, so every variant computes the same thing; outputs are checked against
the first. Usage (CUDA only): python3 scripts/bench_attention.py [--batch 4 --seq 4096 --heads 32
--kv-heads 8 --head-dim 64 --layers 16]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ligertune.bench.timing import measure  # noqa: E402
from ligertune.models.attention import packed_attention_forward, packed_attention_kwargs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16, help="to scale per-call times to a step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this experiment needs CUDA")

    b, s, hq, hk, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def hf_layout(heads: int) -> torch.Tensor:
        # [B, L, H, D] memory seen as [B, H, L, D], as q_proj(x).view(...).transpose(1, 2) gives.
        x = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = hf_layout(hq), hf_layout(hk), hf_layout(hk)
    grad_out = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    kwargs = packed_attention_kwargs(cu, s, total_tokens=b * s)

    def ligertune_packed():
        out, _ = packed_attention_forward(torch.nn.Module(), q, k, v, None, scaling=d**-0.5, **kwargs)
        return out  # [B, L, Hq, D]

    def sdpa(backend=None):
        def run():
            from torch.nn.attention import sdpa_kernel

            context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            with context:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True)
            return out.transpose(1, 2)

        return run

    from torch.nn.attention import SDPBackend

    variants = [
        ("ligertune packed (as trained)", ligertune_packed),
        ("SDPA causal, GQA (default backend)", sdpa()),
        ("SDPA causal, GQA, flash", sdpa(SDPBackend.FLASH_ATTENTION)),
        ("SDPA causal, GQA, cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION)),
    ]
    reference = None
    rows = []
    for name, fn in variants:
        try:
            with torch.no_grad():
                out = fn().float()
            if reference is None:
                reference = out
            err = ((out - reference).norm() / reference.norm()).item()

            def step(fn=fn):
                for t in (q, k, v):
                    t.grad = None
                fn().backward(grad_out)

            fwd = measure(lambda fn=fn: fn(), device="cuda", repeats=20, memory=False).median_ms
            both = measure(step, device="cuda", repeats=20, memory=False).median_ms
            rows.append((name, fwd, both, err))
        except Exception as exc:  # a backend that does not run here is a row saying so
            rows.append((name, None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"))

    print(f"attention B{b} L{s} Hq{hq} Hk{hk} D{d} bf16, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'variant':38} {'fwd ms':>8} {'fwd+bwd ms':>11} {'x layers (fwd x2 + bwd)':>24}  error vs first")
    for name, fwd, both, err in rows:
        if fwd is None:
            print(f"{name:38} {'-':>8} {'-':>11} {'-':>24}  {err}")
            continue
        # With gradient checkpointing a step runs the forward twice and the backward once.
        per_step = args.layers * (both + fwd)
        print(f"{name:38} {fwd:8.3f} {both:11.3f} {per_step:24.1f}  {err:.1e}")


if __name__ == "__main__":
    main()
