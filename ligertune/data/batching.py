"""Micro-batches as tensors: packs flattened into one row for varlen attention, or padded rows.

`collate(packs)` lays the packs of a micro-batch end to end in ONE row of T tokens ([1, T]):
attention is confined to each conversation through `cu_seqlens` (varlen attention), so nothing
is padded and the packs need not be the same length. `collate_padded` builds the classic
[B, L] right-padded batch with one conversation per row: the reference that packed training
must agree with.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ligertune.data.chat import IGNORE_INDEX, TokenizedExample
from ligertune.data.packing import Pack, shift_labels
from ligertune.devices import to_device


@dataclass
class Batch:
    """One flattened micro-batch of n conversations and T tokens.

    `input_ids`, `targets`, `position_ids`: [1, T] int64; `cu_seqlens`: [n + 1] int32 (the
    conversation boundaries, from 0 to T); `max_seqlen`: the longest conversation; `seq_ids`: [T]
    int64, the conversation (0..n-1) each token belongs to.

    `to(device)` moves every tensor but `cu_seqlens`, which stays on the host: the attention kwargs
    are checked there and copied over without the host waiting on the device
    (`packed_attention_kwargs`).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def to(self, device: torch.device | str) -> Batch:
        return _to(self, device, keep_on_host=("cu_seqlens",))


@dataclass
class PaddedBatch:
    """B conversations, one per row, right-padded to the longest (L).

    `input_ids` (padding: `pad_id`), `targets` (padding: -100), `attention_mask` (1 on real tokens)
    and `position_ids` (0..n-1 per row, 0 on padding): [B, L] int64.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device: torch.device | str) -> PaddedBatch:
        return _to(self, device)


def collate(packs: Sequence[Pack]) -> Batch:
    """The packs of one micro-batch concatenated into one row (see `Batch`)."""
    if not packs:
        raise ValueError("collate needs at least one pack")
    input_ids = list(itertools.chain.from_iterable(p.input_ids for p in packs))
    targets = list(itertools.chain.from_iterable(p.targets for p in packs))
    seq_lens = torch.tensor([n for p in packs for n in p.seq_lens], dtype=torch.int64)
    starts = seq_lens.cumsum(0) - seq_lens
    seq_ids = torch.repeat_interleave(torch.arange(seq_lens.numel()), seq_lens)
    cu_seqlens = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = seq_lens.cumsum(0)
    return Batch(
        input_ids=torch.tensor([input_ids], dtype=torch.int64),
        targets=torch.tensor([targets], dtype=torch.int64),
        position_ids=(torch.arange(len(input_ids)) - starts[seq_ids]).unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(seq_lens.max()),
        seq_ids=seq_ids,
    )


def collate_padded(items: Sequence[TokenizedExample | Pack], pad_id: int) -> PaddedBatch:
    """One conversation per row, right-padded; targets shifted inside each conversation.

    Accepts examples or packs of one conversation (`packs_of_one`); a pack of several is refused,
    since a [B, L] attention mask cannot keep its conversations apart.
    """
    if not items:
        raise ValueError("collate_padded needs at least one item")
    rows: list[tuple[list[int], list[int]]] = []
    for item in items:
        if isinstance(item, Pack):
            if len(item.seq_lens) != 1:
                raise ValueError(
                    f"a padded row holds one conversation; this pack has {len(item.seq_lens)} "
                    "(use packs_of_one)"
                )
            rows.append((item.input_ids, item.targets))
        else:
            rows.append((item.input_ids, shift_labels(item.labels)))
    width = max(len(ids) for ids, _ in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.int64)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros(shape, dtype=torch.int64)
    position_ids = torch.zeros(shape, dtype=torch.int64)
    for r, (ids, tgt) in enumerate(rows):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(ids, dtype=torch.int64)
        targets[r, :n] = torch.tensor(tgt, dtype=torch.int64)
        attention_mask[r, :n] = 1
        position_ids[r, :n] = torch.arange(n)
    return PaddedBatch(input_ids, targets, attention_mask, position_ids)


def _to(batch, device: torch.device | str, keep_on_host: tuple[str, ...] = ()):
    """The batch with its tensors (but those named in `keep_on_host`) on `device`, without waiting."""
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        movable = isinstance(value, torch.Tensor) and f.name not in keep_on_host
        moved[f.name] = to_device(value, device) if movable else value
    return type(batch)(**moved)
