"""Packing tokenized conversations into sequences of at most `max_seq_len` tokens.

Labels are shifted inside each conversation before packing, so no target crosses a conversation
boundary (`Pack` draws an example). Packing is best-fit decreasing: the conversations, longest
first, each go to the open pack with the least room that still fits them, or to a new pack. Ties
are broken by position, so the result is a function of the lengths alone. The order in which
packs are trained is `order.shuffled`'s.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from ligertune.data.chat import IGNORE_INDEX, TokenizedExample


@dataclass
class Pack:
    """Conversations laid end to end, each with its labels shifted inside it.

    `targets[j]` is the label of position j+1 of the same conversation; the last token of every
    conversation has target -100. Two conversations in one pack (max_seq_len 8; `-` is -100;
    a2, a3, b1, b2 are trained):

        conversation     A   A   A   A   B   B   B
        input_ids        a0  a1  a2  a3  b0  b1  b2
        labels           -   -   a2  a3  -   b1  b2      (per conversation, unshifted)
        targets          -   a2  a3  -   b1  b2  -       (shifted inside A and inside B)
        position_ids     0   1   2   3   0   1   2
        seq_lens [4, 3]   cu_seqlens [0, 4, 7]

    A pack is not padded: 7 of its 8 slots hold real tokens.
    """

    input_ids: list[int]
    targets: list[int]
    seq_lens: list[int]
    example_indices: list[int] = field(default_factory=list)  # which examples, in order
    sources: list[int] = field(default_factory=list)  # the source of each conversation (`TokenizedExample.source`)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def position_ids(self) -> list[int]:
        """0, 1, ... restarting at every conversation (derived from `seq_lens`, not stored)."""
        return [i for n in self.seq_lens for i in range(n)]

    @property
    def cu_seqlens(self) -> list[int]:
        """Start offset of every conversation, then the total: `[0, n_0, n_0 + n_1, ...]`."""
        return [0, *itertools.accumulate(self.seq_lens)]

    @property
    def trained_tokens(self) -> int:
        return sum(t != IGNORE_INDEX for t in self.targets)


def shift_labels(labels: Sequence[int]) -> list[int]:
    """`targets[j] = labels[j + 1]`; the last position predicts nothing."""
    return [*labels[1:], IGNORE_INDEX] if labels else []


def make_pack(examples: Sequence[TokenizedExample], indices: Sequence[int]) -> Pack:
    """The examples at `indices`, in that order, as one pack."""
    input_ids: list[int] = []
    targets: list[int] = []
    for i in indices:
        input_ids += examples[i].input_ids
        targets += shift_labels(examples[i].labels)
    seq_lens = [len(examples[i].input_ids) for i in indices]
    return Pack(input_ids, targets, seq_lens, list(indices), [examples[i].source for i in indices])


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths`, each summing to at most `capacity` (best-fit decreasing).

    Open bins are kept by remaining room: a sorted list of the distinct rooms and, per room, a
    stack of bins. The best fit for length n is the first room >= n (one bisect), so packing costs
    O(N log N) for the sort plus O(N log C) for the placements, where a scan over open bins would
    be O(N * bins). Bins left with no room are never looked at again.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # stable: ties by index
    bins: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct remaining rooms of open bins
    by_room: dict[int, list[int]] = {}
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has length {n}, more than the capacity {capacity}")
        j = bisect.bisect_left(rooms, n)
        if j == len(rooms):
            b = len(bins)
            bins.append([i])
            room = capacity - n
        else:
            fit = rooms[j]
            stack = by_room[fit]
            b = stack.pop()
            if not stack:
                del by_room[fit]
                del rooms[j]
            bins[b].append(i)
            room = fit - n
        if room > 0:
            stack = by_room.get(room)
            if stack is None:
                by_room[room] = [b]
                bisect.insort(rooms, room)
            else:
                stack.append(b)
    return bins


def pack(examples: Sequence[TokenizedExample], max_seq_len: int, *, packing: bool = True) -> list[Pack]:
    """Pack examples best-fit decreasing into packs of at most `max_seq_len` tokens.

    `packing=False` gives one pack per example, in order (`packs_of_one`). An example longer than
    `max_seq_len` is an error: `prepare_data` truncates or drops those first.
    """
    lengths = [len(example.input_ids) for example in examples]
    for i, n in enumerate(lengths):
        if n > max_seq_len:
            raise ValueError(
                f"example {i} ({examples[i].origin or 'no origin'}) has {n} tokens, more than "
                f"max_seq_len={max_seq_len}; prepare_data truncates or drops such conversations"
            )
    if not packing:
        return packs_of_one(examples)
    return [make_pack(examples, group) for group in best_fit_decreasing(lengths, max_seq_len)]


def packs_of_one(examples: Sequence[TokenizedExample]) -> list[Pack]:
    """One pack per example, in order: the unpacked layout (for `data.packing: false` and references)."""
    return [make_pack(examples, [i]) for i in range(len(examples))]


def packs_digest(packs: Sequence) -> str:
    """SHA-256 of the packs as steps take them: every field of each pack (tokens, targets, layout,
    which examples and sources), a preference pack's reference log-probabilities left out (they are
    computed from the packs). About 0.1 s per million tokens."""
    h = hashlib.sha256()
    for pack in packs:
        for f in dataclasses.fields(pack):
            value = getattr(pack, f.name)
            if f.name == "reference_logps" or value is None:
                continue
            h.update(f"{f.name}:{len(value)}:".encode())
            if value and isinstance(value[0], int):
                h.update(array.array("q", value).tobytes())
            else:  # a preference pack's answer lengths, KTO's labels
                h.update(repr(value).encode())
    return h.hexdigest()
