"""Micro-batches: one flattened row with conversation boundaries, and the padded reference."""

from __future__ import annotations

import pytest
import torch

from ligertune.data import IGNORE_INDEX, TokenizedExample, collate, collate_padded, pack, packs_of_one
from ligertune.data.batching import host_tensor
from ligertune.data.packing import make_pack

_ = IGNORE_INDEX

EXAMPLES = [
    TokenizedExample([10, 11, 12, 13], [_, _, 12, 13]),
    TokenizedExample([20, 21, 22], [_, 21, 22]),
    TokenizedExample([30, 31, 32, 33, 34], [_, _, _, 33, 34]),
]
PACKS = [make_pack(EXAMPLES, [2]), make_pack(EXAMPLES, [0, 1])]


def test_collate_flattens_packs_into_one_row():
    batch = collate(PACKS)
    assert batch.input_ids.shape == batch.targets.shape == batch.position_ids.shape == (1, 12)
    assert batch.input_ids.dtype == batch.targets.dtype == batch.position_ids.dtype == torch.int64
    assert batch.input_ids[0].tolist() == [30, 31, 32, 33, 34, 10, 11, 12, 13, 20, 21, 22]
    assert batch.targets[0].tolist() == [_, _, 33, 34, _, _, 12, 13, _, 21, 22, _]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 5, 9, 12]
    assert batch.max_seqlen == 5
    assert batch.seq_ids.shape == (12,) and batch.seq_ids.dtype == torch.int64
    assert batch.seq_ids.tolist() == [0] * 5 + [1] * 4 + [2] * 3
    assert (batch.num_tokens, batch.num_sequences) == (12, 3)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_host_tensor_holds_the_values_in_the_dtype_asked(dtype):
    values = [True, False, True] if dtype == torch.bool else [0, -100, 2**31 - 1, 7]
    if dtype == torch.int64:
        values.append(2**40)
    got = host_tensor(iter(values), dtype)
    assert got.dtype == dtype and got.shape == (len(values),)
    assert got.tolist() == values
    assert got.tolist() == torch.tensor(values, dtype=dtype).tolist()
    empty = host_tensor([], dtype)
    assert empty.dtype == dtype and empty.shape == (0,)


def test_padded_reference_holds_the_same_tokens_per_conversation():
    batch = collate(PACKS)
    padded = collate_padded(EXAMPLES, pad_id=0)
    assert padded.input_ids.shape == (3, 5)
    order = [2, 0, 1]  # the packed row's conversations, by example index
    for seq, i in enumerate(order):
        start, end = batch.cu_seqlens[seq].item(), batch.cu_seqlens[seq + 1].item()
        n = end - start
        assert padded.attention_mask[i].tolist() == [1] * n + [0] * (5 - n)
        for name in ("input_ids", "targets", "position_ids"):
            assert getattr(padded, name)[i, :n].tolist() == getattr(batch, name)[0, start:end].tolist()
        assert padded.input_ids[i, n:].tolist() == [0] * (5 - n)
        assert padded.targets[i, n:].tolist() == [_] * (5 - n)


def test_padded_accepts_packs_of_one_but_not_packs_of_several():
    from_packs = collate_padded(packs_of_one(EXAMPLES), pad_id=7)
    from_examples = collate_padded(EXAMPLES, pad_id=7)
    for name in ("input_ids", "targets", "attention_mask", "position_ids"):
        assert torch.equal(getattr(from_packs, name), getattr(from_examples, name))
    with pytest.raises(ValueError, match="one conversation"):
        collate_padded(pack(EXAMPLES[:2], 8), pad_id=0)


def test_to_moves_every_tensor_but_the_boundaries():
    batch = collate(PACKS).to("meta")
    for name in ("input_ids", "targets", "position_ids", "seq_ids"):
        assert getattr(batch, name).device.type == "meta"
    # The boundaries stay on the host, where the attention kwargs are checked without a device sync.
    assert batch.cu_seqlens.device.type == "cpu" and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 5
    padded = collate_padded(EXAMPLES, pad_id=0)
    assert padded.to("meta").attention_mask.device.type == "meta"
    assert padded.to("cpu").attention_mask.sum().item() == 12
