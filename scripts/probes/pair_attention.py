"""Measures a preference pack's attention alone, forward + backward: which kernel for pairs?

A pair packs as prompt P, chosen C, rejected R; the chosen rows attend causally to P + C, the
rejected rows to P and causally to themselves (`ligertune.models.attention`, "Preference packs").
Two DPO pairs of the bench's drawn lengths (seed 1 at a spread of 50%), bf16, Hq 32, Hk 8, D 64
(Llama-3.2-1B). Variants, on the same inputs:

    ligertune             packed_attention_forward as training runs it: the key rows gathered,
                          FlashAttention 2's varlen kernel over query and key boundaries
    cuDNN, pieces merged  three dense cuDNN calls a pair (P + C causal; R over P, unmasked; R
                          causal over itself), the rejected rows' two pieces merged by their
                          log-sum-exps; the backward of each piece given the merged output and
                          log-sum-exp, as ring attention does
    float32 reference     SDPA over the gathered keys with the end-aligned causal mask, float32

Each is checked against the reference (output and the three gradients, relative error). Usage
(CUDA only):

    python3 scripts/probes/pair_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import checked_and_timed, outputs_and_gradients  # the packed-rows probe's

from ligertune.models import attention

HQ, HK, D = 32, 8, 64
PAIRS = [(2828, 1431, 1726), (1425, 1494, 1579)]  # prompt, chosen, rejected


def pair_boundaries(pairs):
    """`preference_attention_kwargs`' arguments for the pairs packed one after another."""
    cu_q, cu_k, index, start = [0], [0], [], 0
    for p, c, r in pairs:
        prompt, chosen, rejected = (list(range(start, start + p)), list(range(start + p, start + p + c)),
                                    list(range(start + p + c, start + p + c + r)))
        for queries, keys in ((prompt + chosen, prompt + chosen), (rejected, prompt + rejected)):
            cu_q.append(cu_q[-1] + len(queries))
            cu_k.append(cu_k[-1] + len(keys))
            index += keys
        start += p + c + r
    return cu_q, cu_k, index, start


def _cudnn(q, k, v, causal, scale):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                             scale=scale)
    return out[0], out[1], out[6], out[7]


def _cudnn_backward(grad, q, k, v, out, lse, seed, offset, causal, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale,
    )


def _pieces(start, p, c, r):
    """The rows of a pair at `start`: prompt + chosen, prompt, rejected."""
    return slice(start, start + p + c), slice(start, start + p), slice(start + p + c, start + p + c + r)


class _CudnnPairs(torch.autograd.Function):
    """q [1, Hq, T, D], k/v [1, Hk, T, D] (transformers' layout) -> [1, Hq, T, D]."""

    @staticmethod
    def forward(ctx, q, k, v, pairs, scale):
        out = torch.empty_like(q.transpose(1, 2)).transpose(1, 2)
        saved, start = [], 0
        for p, c, r in pairs:
            a, b, e = _pieces(start, p, c, r)
            o_a, lse_a, *rng_a = _cudnn(q[:, :, a], k[:, :, a], v[:, :, a], True, scale)
            o_1, lse_1, *rng_1 = _cudnn(q[:, :, e], k[:, :, b], v[:, :, b], False, scale)
            o_2, lse_2, *rng_2 = _cudnn(q[:, :, e], k[:, :, e], v[:, :, e], True, scale)
            lse = torch.logaddexp(lse_1, lse_2)
            w1, w2 = (torch.exp(x - lse).reshape(*o_2.shape[:3], 1) for x in (lse_1, lse_2))
            o_e = torch.empty_like(o_2)
            o_e.copy_(o_1 * w1 + o_2 * w2)
            out[:, :, a], out[:, :, e] = o_a, o_e
            saved.append((o_a, lse_a, rng_a, o_e, lse, rng_1, rng_2))
            start += p + c + r
        ctx.save_for_backward(q, k, v)
        ctx.saved, ctx.pairs, ctx.scale = saved, pairs, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        start, scale = 0, ctx.scale
        for (p, c, r), (o_a, lse_a, rng_a, o_e, lse, rng_1, rng_2) in zip(ctx.pairs, ctx.saved):
            a, b, e = _pieces(start, p, c, r)
            g_a = grad[:, :, a].contiguous().transpose(1, 2).contiguous().transpose(1, 2)
            g_e = grad[:, :, e].contiguous().transpose(1, 2).contiguous().transpose(1, 2)
            x = _cudnn_backward(g_a, q[:, :, a], k[:, :, a], v[:, :, a], o_a, lse_a, *rng_a, True, scale)
            dq[:, :, a], dk[:, :, a], dv[:, :, a] = x
            x = _cudnn_backward(g_e, q[:, :, e], k[:, :, b], v[:, :, b], o_e, lse, *rng_1, False, scale)
            dq[:, :, e] = x[0]
            dk[:, :, b] += x[1]
            dv[:, :, b] += x[2]
            x = _cudnn_backward(g_e, q[:, :, e], k[:, :, e], v[:, :, e], o_e, lse, *rng_2, True, scale)
            dq[:, :, e] += x[0]
            dk[:, :, e], dv[:, :, e] = x[1], x[2]
            start += p + c + r
        return dq, dk, dv, None, None


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs CUDA")
    cu_q, cu_k, index, total = pair_boundaries(PAIRS)
    print(f"pair attention, forward + backward, bf16, Hq {HQ} Hk {HK} D {D}, pairs {PAIRS}; torch "
          f"{torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k, v = (torch.randn(1, total, HK, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
            for _ in range(2))
    grad = torch.randn(1, total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    scale = D**-0.5
    kwargs = attention.preference_attention_kwargs(cu_q, cu_k, index, total_tokens=total, device="cuda")
    mask = attention.end_aligned_causal_mask(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    rows = kwargs["key_index"]

    def ligertune(q, k, v):  # -> [1, Hq, T, D]
        out, _ = attention.packed_attention_forward(torch.nn.Module(), q, k, v, None, scaling=scale, **kwargs)
        return out.transpose(1, 2)

    def reference(q, k, v):
        k, v = (x.float().index_select(2, rows).repeat_interleave(HQ // HK, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale)

    def merged(q, k, v):
        return _CudnnPairs.apply(q, k, v, PAIRS, scale)

    expected = outputs_and_gradients(reference, q, k, v, grad)
    print(f"{'variant':24} {'fwd ms':>8} {'fwd+bwd':>8}  error out / dq / dk / dv")
    for name, fn in (("ligertune", ligertune), ("cuDNN, pieces merged", merged)):
        print(f"{name:24} {checked_and_timed(fn, q, k, v, grad, expected)}")


if __name__ == "__main__":
    main()
