"""Rotary embedding: the Triton path against the reference (q_embed, k_embed, dq, dk), the reference
against `apply_rotary_pos_emb` of `transformers` bit for bit, and a pack against its conversations.

cos/sin come from `LlamaRotaryEmbedding` itself, for position ids that restart like a pack's.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, rel_err

import ligertune.kernels as K
from ligertune.kernels import reference

# (batch, q heads, kv heads, seq len, head dim)
SHAPES = [
    pytest.param((2, 6, 2, 37, 24), id="B2-Hq6-Hk2-L37-D24"),
    pytest.param((2, 6, 2, 37, 16), id="B2-Hq6-Hk2-L37-D16"),
    pytest.param((1, 3, 3, 5, 8), id="B1-Hq3-Hk3-L5-D8"),
    # D=256 leaves room for 16 heads per tile: the 20 q heads take two steps of the head loop.
    pytest.param((1, 20, 4, 3, 256), id="B1-Hq20-Hk4-L3-D256"),
]

# (dtype, relative tolerance ||a - b|| / ||b|| on outputs and gradients)
DTYPES = [
    pytest.param(torch.float32, 1e-6, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16"),
]

LAYOUTS = [
    pytest.param(True, id="hf-transposed"),  # q/k viewed as [B, H, L, D] over a [B, L, H, D] buffer
    pytest.param(False, id="contiguous"),
]


def pack_positions(batch: int, seq_len: int) -> torch.Tensor:
    """Position ids of packs: row b holds conversations of lengths 7 + 4b, 11, then the rest."""
    rows = []
    for b in range(batch):
        lengths, left = [], seq_len
        for n in (7 + 4 * b, 11):
            lengths.append(min(n, left))
            left -= lengths[-1]
        lengths.append(left)
        rows.append(torch.cat([torch.arange(n) for n in lengths if n]))
    return torch.stack(rows)


def rotary(head_dim: int, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=100.0)
    module = LlamaRotaryEmbedding(config).to(DEVICE)
    return module(torch.zeros(1, device=DEVICE, dtype=dtype), position_ids.to(DEVICE))


def make_qk(shape, dtype, hf_layout: bool, seed=0):
    b, hq, hk, seq_len, d = shape
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for h in (hq, hk, hq, hk):  # q, k, dq_embed, dk_embed
        t = torch.randn(b, seq_len, h, d, generator=gen).to(DEVICE, dtype)
        tensors.append(t.transpose(1, 2) if hf_layout else t.transpose(1, 2).contiguous())
    return tensors


def run(fn, q, k, cos, sin, dq_embed, dk_embed):
    q = q.detach().clone().requires_grad_(True)  # clone keeps the strides
    k = k.detach().clone().requires_grad_(True)
    q_embed, k_embed = fn(q, k, cos, sin)
    torch.autograd.backward((q_embed, k_embed), (dq_embed, dk_embed))
    return q_embed.detach(), k_embed.detach(), q.grad, k.grad


@pytest.mark.parametrize("hf_layout", LAYOUTS)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(triton_path, shape, dtype, tol, hf_layout):
    q, k, dq_embed, dk_embed = make_qk(shape, dtype, hf_layout)
    cos, sin = rotary(shape[-1], pack_positions(shape[0], shape[3]), dtype)
    got = run(K.apply_rope, q, k, cos, sin, dq_embed, dk_embed)
    want = run(reference.apply_rope, q, k, cos, sin, dq_embed, dk_embed)
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < tol, name
    # The outputs keep the inputs' memory layout, so attention gets what the eager code gives it.
    assert got[0].stride() == q.stride() and got[1].stride() == k.stride()


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_cos_shared_by_the_batch(triton_path, dtype, tol):
    """cos/sin of shape [1, L, D] (one position row for every sequence), given in float32 while
    q/k are in `dtype`: both paths round them to q's dtype first."""
    shape = (3, 4, 2, 9, 12)
    q, k, dq_embed, dk_embed = make_qk(shape, dtype, hf_layout=True, seed=1)
    cos, sin = rotary(12, torch.arange(9)[None], torch.float32)
    got = run(K.apply_rope, q, k, cos, sin, dq_embed, dk_embed)
    want = run(reference.apply_rope, q, k, cos, sin, dq_embed, dk_embed)
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), got, want):
        assert rel_err(a, b) < tol, name


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_pack_equals_its_conversations(triton_path, dtype):
    """Rotating a pack (positions restarting per conversation) gives, token for token, what rotating
    each conversation alone from position 0 gives."""
    b, hq, hk, seq_len, d = 1, 4, 2, 29, 16
    q, k, _, _ = make_qk((b, hq, hk, seq_len, d), dtype, hf_layout=True, seed=2)
    lengths = [7, 11, 11]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cos, sin = rotary(d, positions, dtype)
    q_pack, k_pack = K.apply_rope(q, k, cos, sin)
    start = 0
    for n in lengths:
        cos_1, sin_1 = rotary(d, torch.arange(n)[None], dtype)
        q_1, k_1 = K.apply_rope(q[:, :, start : start + n], k[:, :, start : start + n], cos_1, sin_1)
        # Not always equal to the bit on a GPU: the two launches compile for different block sizes.
        # A position taken from the wrong token would differ by far more than rounding.
        torch.testing.assert_close(q_pack[:, :, start : start + n], q_1)
        torch.testing.assert_close(k_pack[:, :, start : start + n], k_1)
        start += n


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_reference_is_transformers_apply_rotary_pos_emb(dtype):
    from transformers.models.llama import modeling_llama

    # transformers' own function, also where an earlier test's patched model left ligertune's
    # redirect in the modeling module (`models.patching`: it keeps the original).
    apply_rotary_pos_emb = getattr(modeling_llama.apply_rotary_pos_emb, "original",
                                   modeling_llama.apply_rotary_pos_emb)
    shape = (2, 6, 2, 37, 24)
    q, k, dq_embed, dk_embed = make_qk(shape, dtype, hf_layout=True, seed=4)
    cos, sin = rotary(24, pack_positions(2, 37), dtype)
    got = run(reference.apply_rope, q, k, cos, sin, dq_embed, dk_embed)
    want = run(apply_rotary_pos_emb, q, k, cos, sin, dq_embed, dk_embed)
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_partial_rotary_turns_the_first_channels_as_phi3_does(triton_path, dtype, tol):
    """The patched `apply_rotary_pos_emb` of Phi-3 (`models.patching._RopeRedirect`) with cos and sin
    narrower than the head (`partial_rotary_factor`): the kernel turns the first 8 of 24 channels
    and the others pass through, against Phi-3's own function, values and gradients."""
    from transformers.models.phi3 import modeling_phi3

    from ligertune.models.patching import _RopeRedirect

    original = getattr(modeling_phi3.apply_rotary_pos_emb, "original", modeling_phi3.apply_rotary_pos_emb)
    shape = (2, 6, 2, 37, 24)
    q, k, dq_embed, dk_embed = make_qk(shape, dtype, hf_layout=True, seed=5)
    cos, sin = rotary(8, pack_positions(2, 37), dtype)
    got = run(_RopeRedirect(original), q, k, cos, sin, dq_embed, dk_embed)
    want = run(original, q, k, cos, sin, dq_embed, dk_embed)
    for name, a, b in zip(("q_embed", "k_embed", "dq", "dk"), got, want):
        assert rel_err(a, b) < tol, name
        assert torch.equal(a[..., 8:], b[..., 8:]), name  # passed through untouched


def test_bad_arguments_raise():
    q, k, _, _ = make_qk((2, 4, 2, 5, 8), torch.float32, hf_layout=False)
    cos, sin = rotary(8, torch.arange(5)[None], torch.float32)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        reference.apply_rope(q, k, cos[..., :4], sin[..., :4])
    with pytest.raises(ValueError, match="share B, L and D"):
        reference.apply_rope(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match="must be even"):
        reference.apply_rope(q[..., :5], k[..., :5], cos[..., :5], sin[..., :5])
