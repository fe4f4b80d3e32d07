"""Packed attention: a pack gives every conversation exactly the logits it gets alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import FAMILIES, VOCAB, make_model, make_packed_batch

from ligertune.models import attention, packed_attention_forward, packed_attention_kwargs
from ligertune.models.attention import (
    _causal_rows as causal_rows,
)
from ligertune.models.attention import (
    _grouped_flash_available,
    _GroupedFlashVarlen,
    _varlen_applies,
    block_causal_mask,
    end_aligned_causal_mask,
    equal_segments,
    segment_ids_from_position_ids,
)

FAMILY_IDS = list(FAMILIES)


def alone_logits(model, batch) -> torch.Tensor:
    """Each conversation run by itself, concatenated back into the packed order: [T, V]."""
    out = []
    for start, end in batch.pieces():
        ids = batch.input_ids[:, start:end]
        out.append(model(ids, position_ids=torch.arange(end - start, device=ids.device)[None]).logits[0])
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILY_IDS)
@torch.no_grad()
def test_packed_forward_equals_each_conversation_alone(family, packed_batch):
    packed = make_model(family)
    reference = make_model(family, attention="eager")  # transformers' own attention, same weights
    kwargs = packed_attention_kwargs(packed_batch.cu_seqlens)
    logits = packed(packed_batch.input_ids, position_ids=packed_batch.position_ids, **kwargs).logits[0]
    expected = alone_logits(reference, packed_batch)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)

    # The same row without isolation (one causal sequence, restarting positions and all) differs from
    # the second conversation on: the comparison above can fail.
    naive = reference(packed_batch.input_ids, position_ids=packed_batch.position_ids,
                      attention_mask=torch.ones_like(packed_batch.input_ids)).logits[0]
    first = packed_batch.lengths[0]
    torch.testing.assert_close(naive[:first], expected[:first], rtol=1e-5, atol=1e-5)
    assert (naive[first:] - expected[first:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILY_IDS)
@torch.no_grad()
def test_the_loss_head_builds_no_mask_and_reads_no_positions(family, packed_batch, monkeypatch):
    """With cu_seqlens the head passes `conversations_mask`: transformers neither builds a mask nor
    searches the position ids for packed rows (a device sync), and the loss is the same."""
    import transformers.masking_utils as masking

    import ligertune.models.head as head_module
    from ligertune.models import CausalLMLoss

    head = CausalLMLoss(make_model(family))
    args = (packed_batch.input_ids, packed_batch.position_ids, packed_batch.targets)
    kwargs = dict(cu_seqlens=packed_batch.cu_seqlens, max_seqlen=max(packed_batch.lengths))
    searches = []
    search = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices",
                        lambda position_ids: searches.append(position_ids) or search(position_ids))
    loss = head(*args, **kwargs).loss
    assert not searches
    monkeypatch.setattr(head_module, "conversations_mask", lambda device: None)  # no mask passed
    assert torch.equal(head(*args, **kwargs).loss, loss)
    assert searches  # the search the mask avoids


@pytest.mark.parametrize("family", ["llama", "mistral"])
@torch.no_grad()
def test_restarting_position_ids_alone_also_isolate(family, packed_batch):
    """Without cu_seqlens and without a mask, conversations split where positions restart."""
    packed = make_model(family)
    reference = make_model(family, attention="eager")
    logits = packed(packed_batch.input_ids, position_ids=packed_batch.position_ids, use_cache=False).logits[0]
    torch.testing.assert_close(logits, alone_logits(reference, packed_batch), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_two_packed_rows_with_trailing_padding():
    """A batch of two packs whose cu_seqlens run over the flattened tokens; the tail is padding."""
    model = make_model("qwen3")
    reference = make_model("qwen3", attention="eager")
    rows = [make_packed_batch([5, 6], seed=1), make_packed_batch([4, 4, 2], seed=2)]
    width = 12
    ids = torch.zeros(2, width, dtype=torch.long)
    pos = torch.zeros(2, width, dtype=torch.long)
    for r, row in enumerate(rows):
        n = row.input_ids.shape[1]
        ids[r, :n], pos[r, :n] = row.input_ids[0], row.position_ids[0]
        pos[r, n:] = torch.arange(width - n)
    # Row 0 holds 11 tokens and 1 pad, row 1 10 tokens and 2 pads; the pads of row 0 are a segment.
    cu = torch.tensor([0, 5, 11, 12, 16, 20, 22], dtype=torch.int32)
    kwargs = packed_attention_kwargs(cu, total_tokens=ids.numel())
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 5, 11, 12, 16, 20, 22, 24]
    assert kwargs["max_length_q"] == 6
    logits = model(ids, position_ids=pos, **kwargs).logits
    for r, row in enumerate(rows):
        n = row.input_ids.shape[1]
        torch.testing.assert_close(logits[r, :n], alone_logits(reference, row), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@torch.no_grad()
def test_padded_batch_and_generate_match_the_models_own_attention(family):
    """With a padding mask (and a KV cache in generate), packed attention is the model's attention."""
    packed = make_model(family)
    reference = make_model(family, attention="eager")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    got = packed(ids, attention_mask=mask).logits
    want = reference(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)

    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(packed.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_packed_attention_kwargs_checks_its_input():
    with pytest.raises(ValueError, match="start at 0"):
        packed_attention_kwargs(torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="start at 0"):
        packed_attention_kwargs(torch.tensor([0, 4, 3]))
    with pytest.raises(ValueError, match="past the 5 tokens"):
        packed_attention_kwargs(torch.tensor([0, 4, 7]), total_tokens=5)
    with pytest.raises(ValueError, match="shorter than the longest"):
        packed_attention_kwargs([0, 4, 7], max_seqlen=3)
    kwargs = packed_attention_kwargs([0, 4, 7], max_seqlen=16)
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert (kwargs["max_length_q"], kwargs["max_length_k"]) == (16, 16)


def test_equal_segments_are_read_from_the_shapes_alone():
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    assert equal_segments(cu, 4, 12) == 3
    assert equal_segments(cu, 5, 12) is None  # a bound above the longest: not all equal
    assert equal_segments(torch.tensor([0, 4, 7], dtype=torch.int32), 4, 7) is None
    assert equal_segments(cu, None, 12) is None
    kwargs = packed_attention_kwargs(cu)
    assert equal_segments(kwargs["cu_seq_lens_q"], kwargs["max_length_q"], 12) == 3


def test_block_causal_mask_draws_blocks_and_window():
    segments = segment_ids_from_position_ids(torch.tensor([[0, 1, 2, 3, 0, 1]]), 1, 6)
    assert segments.tolist() == [[0, 0, 0, 0, 1, 1]]
    mask = block_causal_mask(segments, 6, sliding_window=3, device=torch.device("cpu"))[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert segment_ids_from_position_ids(torch.arange(6)[None], 1, 6) is None
    assert block_causal_mask(None, 6, sliding_window=6, device=torch.device("cpu")) is None


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "lengths", [[37, 11, 64, 5, 20], [24, 24, 24, 24]], ids=["mixed-lengths", "equal-lengths"]
)
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize(
    ("device", "dtype", "tolerance"),
    [
        pytest.param("cpu", torch.float32, 1e-5, id="cpu-fp32"),
        pytest.param("cuda", torch.bfloat16, 1e-2, id="cuda-bf16", marks=CUDA),
    ],
)
@torch.no_grad()
def test_attention_function_keeps_segments_apart(lengths, window, device, dtype, tolerance, monkeypatch):
    """Each segment's output is its own causal (windowed) attention, computed apart in fp32.

    Segments of one length without a window that bites take SDPA over rows; the others take the
    varlen kernel on CUDA and the block mask on the CPU.
    """
    total = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 8, total, 64, device=device, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, total, 64, device=device, generator=gen).to(dtype) for _ in range(2))
    assert _varlen_applies(q, 0.0, None, window) == (device == "cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = packed_attention_kwargs(cu, device=device)
    row_calls = []
    monkeypatch.setattr(attention, "_causal_rows", lambda *a: row_calls.append(a[3]) or causal_rows(*a))
    out, _ = packed_attention_forward(
        torch.nn.Module(), q, k, v, None, scaling=0.2, sliding_window=window, **kwargs
    )
    as_rows = len(set(lengths)) == 1 and (window is None or window >= lengths[0])
    assert row_calls == ([len(lengths)] if as_rows else [])

    def attend(qs, ks, vs):  # fp32 SDPA of one segment, with transformers' window rule
        n = qs.shape[2]
        idx = torch.arange(n, device=device)
        mask = (idx[None] <= idx[:, None]) & ((idx[:, None] - idx[None]) < (window or n))
        ks, vs = ks.repeat_interleave(4, dim=1), vs.repeat_interleave(4, dim=1)
        return F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), attn_mask=mask, scale=0.2)

    pieces = [attend(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in zip(cu[:-1], cu[1:])]
    expected = torch.cat(pieces, dim=2)
    expected = expected.transpose(1, 2)
    assert out.shape == expected.shape
    assert (out.float() - expected).norm() / expected.norm() < tolerance
    naive = attend(q, k, v).transpose(1, 2)  # the whole row as one sequence
    assert (out.float() - naive).norm() / naive.norm() > 0.1


@CUDA
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@torch.no_grad()
def test_packed_bf16_model_on_cuda_matches_each_conversation_alone(family):
    """A bf16 model on CUDA (varlen path) against the fp32 model run per conversation."""
    batch = make_packed_batch([37, 11, 64, 5, 20])
    batch.input_ids, batch.position_ids = batch.input_ids.cuda(), batch.position_ids.cuda()
    packed = make_model(family).to("cuda", torch.bfloat16)
    reference = make_model(family, attention="eager").to("cuda")
    kwargs = packed_attention_kwargs(batch.cu_seqlens, device="cuda")
    logits = packed(batch.input_ids, position_ids=batch.position_ids, **kwargs).logits[0].float()
    expected = alone_logits(reference, batch)
    assert (logits - expected).norm() / expected.norm() < 2e-2


@CUDA
@pytest.mark.skipif(not _grouped_flash_available(), reason="this torch has no aten FlashAttention ops")
@pytest.mark.parametrize(
    ("query_lengths", "key_lengths"),
    [([37, 11, 64, 5, 20], None), ([9, 5, 5], [9, 14, 14])],
    ids=["segments", "own-key-rows"],
)
def test_grouped_flash_varlen_matches_repeated_heads_in_fp32(query_lengths, key_lengths):
    """FlashAttention reading grouped key/value heads in place: its output and the gradients of queries,
    keys and values against fp32 attention with the heads repeated and the end-aligned causal mask."""
    key_lengths = key_lengths or query_lengths
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (query_lengths, key_lengths))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(query_lengths), 8, 64, device="cuda", generator=gen)
    k, v = (torch.randn(sum(key_lengths), 2, 64, device="cuda", generator=gen) for _ in range(2))
    grad = torch.randn_like(q)

    def run(attend, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        out.backward(grad.to(dtype))
        return [out.float()] + [x.grad.float() for x in leaves]

    def grouped(qs, ks, vs):
        return _GroupedFlashVarlen.apply(qs, ks, vs, cu_q, cu_k, max(query_lengths), max(key_lengths), 0.2)

    def repeated(qs, ks, vs):
        ks, vs = (x.repeat_interleave(4, dim=1).transpose(0, 1)[None] for x in (ks, vs))
        out = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks, vs, scale=0.2,
                                             attn_mask=end_aligned_causal_mask(cu_q, cu_k))
        return out[0].transpose(0, 1)

    for name, got, expected in zip(("out", "dq", "dk", "dv"), run(grouped, torch.bfloat16),
                                   run(repeated, torch.float32)):
        assert (got - expected).norm() / expected.norm() < 1e-2, name
