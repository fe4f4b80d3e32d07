"""Measures attention alone, forward + backward, at a training step's shapes: which kernel for packed rows?

Findings: docs/PERF.md, "Attention for packed rows" and "Attention alone: varlen FlashAttention
against SDPA".

Two layouts of 4 x 4096 tokens in one flattened row, bf16, Hq 32, Hk 8, D 64 (Llama-3.2-1B):
"equal" (four sequences of 4096, bench step's synthetic batch) and "chat" (the first micro-batch of
bench step's synthetic chat conversations, packed best-fit). Variants, on the same inputs:

    ligertune             packed_attention_forward as training runs it (SDPA over rows for equal
                          lengths, varlen FlashAttention with grouped heads otherwise)
    varlen, heads repeated  torch's varlen_attn with the key and value heads repeated first (the
                          way of a torch whose varlen_attn has no enable_gqa, before grouped heads)
    varlen, grouped heads aten's FlashAttention 2 varlen kernel called directly with the key and value
                          heads in place (what training does there now; varlen_attn's enable_gqa on
                          later torches)
    cuDNN ragged          aten's cuDNN attention over cu_seqlens (THD layout, grouped heads in place)
    SDPA rows             causal SDPA over [4, 4096] rows (equal lengths only; cuDNN on Hopper)
    flex attention        torch.compile'd flex_attention with a causal document block mask
    per-sequence SDPA     one causal SDPA call per sequence

Each is checked against the float32 per-sequence reference (output and the three gradients, relative
error); a variant that fails or is wrong says so in its row. Usage (CUDA only):

    python3 scripts/probes/attention.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ligertune.bench.timing import measure
from ligertune.models import attention

HQ, HK, D, ROWS, LEN = 32, 8, 64, 4, 4096


class _CudnnRagged(torch.autograd.Function):
    """aten's cuDNN attention over cumulative lengths: q [T, Hq, D], k/v [T, Hk, D]."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        res = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
        )
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, ctx.max_len, ctx.max_len,
            0.0, True, scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


class _FlashVarlenGrouped(torch.autograd.Function):
    """aten's FlashAttention 2 varlen kernel with the key and value heads as they are (grouped query
    heads read them in place; `varlen_attn` on torch 2.11 has no `enable_gqa`, so training repeats
    them first): q [T, Hq, D], k/v [T, Hk, D]."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng, unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


def layouts() -> dict[str, torch.Tensor]:
    from ligertune.bench.synthetic import synthetic_conversations
    from ligertune.data.batching import collate
    from ligertune.data.packing import pack

    packs = pack(synthetic_conversations(2 * ROWS * LEN, LEN, 1000, 0), LEN)
    chat = collate(packs[:ROWS]).cu_seqlens
    return {
        "equal 4 x 4096": torch.arange(0, (ROWS + 1) * LEN, LEN, dtype=torch.int32),
        f"chat ({chat.numel() - 1} conversations)": chat,
    }


def variants(cu: torch.Tensor, scale: float) -> list[tuple[str, callable]]:
    """(name, fn(q, k, v) -> out), all in the THD layout [T, H, D]."""
    total = int(cu[-1])
    lengths = (cu[1:] - cu[:-1]).tolist()
    max_len = max(lengths)
    cu_host, cu = cu, cu.cuda()

    def hf(x):  # [T, H, D] seen as the [1, H, T, D] that transformers hands over
        return x.transpose(0, 1)[None]

    def ligertune(q, k, v):
        kwargs = attention.packed_attention_kwargs(cu_host, max_len, total_tokens=total, device="cuda")
        out, _ = attention.packed_attention_forward(torch.nn.Module(), hf(q), hf(k), hf(v), None, scaling=scale,
                                                    **kwargs)
        return out[0]

    def varlen_repeated(q, k, v):
        k, v = (x.repeat_interleave(HQ // HK, dim=1) for x in (k, v))
        return attention._varlen_attention(hf(q), hf(k), hf(v), cu, max_len, scale, None, 1)[0]

    def cudnn_ragged(q, k, v):
        return _CudnnRagged.apply(q, k, v, cu, max_len, scale)

    def varlen_grouped(q, k, v):
        return _FlashVarlenGrouped.apply(q, k, v, cu, max_len, scale)

    def per_sequence(q, k, v, dtype=None):
        outs = []
        for start, end in zip(cu_host[:-1].tolist(), cu_host[1:].tolist()):
            qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
            if dtype is not None:
                qs, ks, vs = qs.to(dtype), ks.to(dtype), vs.to(dtype)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    out = [("ligertune", ligertune), ("varlen, heads repeated", varlen_repeated),
           ("varlen, grouped heads", varlen_grouped), ("cuDNN ragged", cudnn_ragged)]
    if len(set(lengths)) == 1:
        rows = len(lengths)

        def sdpa_rows(q, k, v):
            def split(x):
                return x.view(rows, -1, x.shape[1], D).transpose(1, 2)

            o = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, scale=scale,
                                               enable_gqa=True)
            return o.transpose(1, 2).reshape(total, HQ, D)

        out.append(("SDPA rows", sdpa_rows))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.searchsorted(cu[1:].contiguous(), torch.arange(total, device="cuda"), right=True)
        mask = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, total, total)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex(q, k, v):
            return compiled(hf(q), hf(k), hf(v), block_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)

        out.append(("flex attention", flex))
    except Exception as exc:  # an older torch: the row says why
        out.append(("flex attention", exc))
    out.append(("per-sequence SDPA", per_sequence))
    out.append(("float32 reference", lambda q, k, v: per_sequence(q, k, v, torch.float32)))
    return out


def outputs_and_gradients(fn, q, k, v, grad) -> list[torch.Tensor]:
    """fn(q, k, v) and the gradients of q, k and v under `grad`, in float32."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [t.float() for t in (out, *(x.grad for x in leaves))]


def checked_and_timed(fn, q, k, v, grad, expected: list[torch.Tensor]) -> str:
    """A row's figures for attention `fn`: forward ms, forward + backward ms (medians of 20), and the
    relative errors of its output and gradients against `expected`; or why it failed."""
    try:
        errors = [((a - b).norm() / b.norm()).item()
                  for a, b in zip(outputs_and_gradients(fn, q, k, v, grad), expected)]
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def step():
            for x in leaves:
                x.grad = None
            fn(*leaves).backward(grad)

        fwd = measure(lambda: fn(q, k, v), device="cuda", repeats=20, memory=False).median_ms
        both = measure(step, device="cuda", repeats=20, memory=False).median_ms
        return f"{fwd:8.3f} {both:8.3f}  " + " / ".join(f"{e:.1e}" for e in errors)
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs CUDA")
    print(f"attention, forward + backward, bf16, Hq {HQ} Hk {HK} D {D}; torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    print(f"{'layout':28} {'variant':24} {'fwd ms':>8} {'fwd+bwd':>8}  error out / dq / dk / dv")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layout, cu in layouts().items():
        total = int(cu[-1])
        q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(total, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        grad = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        candidates = variants(cu, D**-0.5)
        expected = outputs_and_gradients(candidates[-1][1], q, k, v, grad)
        for name, fn in candidates[:-1]:
            if isinstance(fn, Exception):
                print(f"{layout:28} {name:24} unavailable: {type(fn).__name__}: {str(fn)[:80]}")
            else:
                print(f"{layout:28} {name:24} {checked_and_timed(fn, q, k, v, grad, expected)}")


if __name__ == "__main__":
    main()
