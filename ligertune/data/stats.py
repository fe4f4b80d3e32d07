"""What data preparation and packing report: counts by reason, tokens, efficiency, lengths."""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from ligertune.data.packing import Pack

DROP_REASONS = ("too_long", "no_trained_tokens")
TRUNCATION_REASONS = ("trailing_turns",)


@dataclass
class SourceStats:
    """One source (a file or a hub dataset) through reading, tokenization and sampling."""

    path: str
    records: int = 0  # records read, malformed ones included
    bad_records: int = 0  # malformed records skipped (`on_bad_record: skip`)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> conversations
    truncated: dict[str, int] = field(default_factory=dict)  # reason -> conversations shortened
    turns_removed: int = 0
    kept: int = 0  # usable conversations after dropping
    eval: int = 0  # of those, held out for evaluation (`eval_fraction`)
    taken: int = 0  # training conversations after `weight` / `samples` (repeats counted)
    cached: bool = False  # tokenized data came from the cache


@dataclass
class DataStats:
    """Everything `prepare_data` did, summed over sources (train sources and `eval_path`).

    `trained_tokens` / `total_tokens` count the training set as it will be packed (after weights
    and samples); trained tokens are those whose label is not -100.
    """

    conversations_read: int = 0
    bad_records: int = 0
    bad_record_examples: list[str] = field(default_factory=list)  # the first few, with file:line
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    turns_removed: int = 0
    train_conversations: int = 0
    eval_conversations: int = 0
    trained_tokens: int = 0
    total_tokens: int = 0
    eval_trained_tokens: int = 0
    eval_total_tokens: int = 0
    sources: list[SourceStats] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line, e.g. `1200 read, 12 dropped (too_long 12), 40 truncated, 81k of 310k tokens trained`."""
        parts = [f"{self.conversations_read} read"]
        if self.bad_records:
            parts.append(f"{self.bad_records} bad skipped")
        if self.dropped:
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.dropped.items()))
            parts.append(f"{sum(self.dropped.values())} dropped ({reasons})")
        if self.truncated:
            parts.append(f"{sum(self.truncated.values())} truncated")
        trained, total = compact_count(self.trained_tokens), compact_count(self.total_tokens)
        parts.append(f"{trained} of {total} tokens trained")
        return ", ".join(parts)


@dataclass
class LengthBucket:
    """Conversations with `low <= length <= high` tokens."""

    low: int
    high: int
    count: int


@dataclass
class PackingStats:
    """How full the packs are: efficiency = real tokens / slots, slots = packs * max_seq_len."""

    conversations: int
    packs: int
    max_seq_len: int
    real_tokens: int
    trained_tokens: int
    slots: int
    efficiency: float
    histogram: list[LengthBucket]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def packing_stats(packs: Sequence[Pack], max_seq_len: int) -> PackingStats:
    """Count packs, tokens and slots, and bucket the conversation lengths."""
    lengths = [n for p in packs for n in p.seq_lens]
    real = sum(lengths)
    slots = len(packs) * max_seq_len
    return PackingStats(
        conversations=len(lengths),
        packs=len(packs),
        max_seq_len=max_seq_len,
        real_tokens=real,
        trained_tokens=sum(p.trained_tokens for p in packs),
        slots=slots,
        efficiency=real / slots if slots else 0.0,
        histogram=length_histogram(lengths, max_seq_len),
    )


def length_histogram(lengths: Sequence[int], max_len: int) -> list[LengthBucket]:
    """Counts in power-of-two buckets 1-63, 64-127, 128-255, ... up to `max_len` (the last one closed)."""
    edges = [1]
    edge = 64
    while edge < max_len:
        edges.append(edge)
        edge *= 2
    edges.append(max_len + 1)
    # Lengths above max_len (none after preparation) land in the last bucket rather than vanish.
    counts = Counter(min(bisect.bisect_right(edges, n) - 1, len(edges) - 2) for n in lengths)
    return [LengthBucket(edges[b], edges[b + 1] - 1, counts[b]) for b in range(len(edges) - 1)]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, for a user's eyes: "1 pack", "2,048 packs"; `plural` where adding an s is
    not it ("micro-batches")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def compact_count(n: int) -> str:
    """`n` in three figures: 1234 -> 1.23k, 310000 -> 310k."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def merge_counts(into: dict[str, int], other: dict[str, int]) -> None:
    for reason, count in other.items():
        into[reason] = into.get(reason, 0) + count
