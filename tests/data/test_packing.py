"""Packing: the drawn example, invariants against the unpacked conversations, efficiency, order."""

from __future__ import annotations

import random

import pytest

from ligertune.data import (
    IGNORE_INDEX,
    TokenizedExample,
    best_fit_decreasing,
    length_histogram,
    pack,
    packing_stats,
    packs_of_one,
    shuffled,
)

_ = IGNORE_INDEX


def random_examples(n: int, max_len: int, seed: int, min_len: int = 1) -> list[TokenizedExample]:
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(1000) for _ in range(length)]
        labels = [t if rng.random() < 0.5 else IGNORE_INDEX for t in ids]
        examples.append(TokenizedExample(ids, labels, origin=f"synthetic:{i}"))
    return examples


def test_the_drawn_example():
    a = TokenizedExample([10, 11, 12, 13], [_, _, 12, 13])
    b = TokenizedExample([20, 21, 22], [_, 21, 22])
    (p,) = pack([a, b], 8)
    assert p.input_ids == [10, 11, 12, 13, 20, 21, 22]
    assert p.targets == [_, 12, 13, _, 21, 22, _]
    assert p.position_ids == [0, 1, 2, 3, 0, 1, 2]
    assert p.seq_lens == [4, 3]
    assert p.cu_seqlens == [0, 4, 7]
    assert p.example_indices == [0, 1]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "n, max_seq_len, max_len",
    [pytest.param(1, 8, 8, id="one"), pytest.param(37, 64, 64, id="N37-L64"),
     pytest.param(203, 123, 41, id="N203-L123-short"), pytest.param(500, 256, 256, id="N500-L256")],
)
def test_packs_hold_every_conversation_once_and_keep_them_apart(n, max_seq_len, max_len, seed):
    examples = random_examples(n, max_len, seed)
    packs = pack(examples, max_seq_len)

    seen = sorted(i for p in packs for i in p.example_indices)
    assert seen == list(range(n))
    for p in packs:
        assert len(p.input_ids) == len(p.targets) == len(p.position_ids) == sum(p.seq_lens) <= max_seq_len
        assert p.cu_seqlens[0] == 0 and p.cu_seqlens[-1] == len(p.input_ids)
        for i, start, end in zip(p.example_indices, p.cu_seqlens, p.cu_seqlens[1:]):
            example = examples[i]
            assert p.input_ids[start:end] == example.input_ids
            assert p.position_ids[start:end] == list(range(end - start))  # restart per conversation
            assert p.targets[start:end] == example.labels[1:] + [IGNORE_INDEX]  # never crosses a boundary


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_matches_a_plain_scan(seed):
    """Bin fills equal those of the O(n * bins) textbook best-fit decreasing."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(300)]
    bins = []
    for n in sorted(lengths, reverse=True):
        fits = [b for b in range(len(bins)) if bins[b] + n <= 100]
        if fits:
            best = min(fits, key=lambda b: 100 - bins[b])
            bins[best] += n
        else:
            bins.append(n)
    ours = best_fit_decreasing(lengths, 100)
    assert sorted(sum(lengths[i] for i in b) for b in ours) == sorted(bins)


def test_efficiency_on_a_realistic_mix():
    """Log-normal chat lengths (median 300, long tail, capped at 2048) fill packs >= 95%."""
    rng = random.Random(0)
    lengths = [min(2048, max(8, int(rng.lognormvariate(5.7, 0.9)))) for _ in range(20_000)]
    bins = best_fit_decreasing(lengths, 2048)
    assert sum(lengths) / (len(bins) * 2048) >= 0.95


def test_packing_is_deterministic():
    examples = random_examples(300, 100, seed=3)
    first, second = pack(examples, 128), pack(list(examples), 128)
    assert [p.example_indices for p in first] == [p.example_indices for p in second]


def test_too_long_is_refused():
    with pytest.raises(ValueError, match="more than max_seq_len=8"):
        pack([TokenizedExample(list(range(9)), list(range(9)))], 8)


def test_packs_of_one_keep_order():
    examples = random_examples(10, 30, seed=4)
    for packs in (packs_of_one(examples), pack(examples, 30, packing=False)):
        assert [p.example_indices for p in packs] == [[i] for i in range(10)]
        assert [p.input_ids for p in packs] == [e.input_ids for e in examples]


def test_shuffled_depends_on_seed_and_epoch_only():
    packs = pack(random_examples(200, 40, seed=5), 64)
    order = lambda ps: [p.example_indices[0] for p in ps]  # noqa: E731
    assert order(shuffled(packs, seed=1, epoch=0)) == order(shuffled(packs, seed=1, epoch=0))
    assert order(shuffled(packs, seed=1, epoch=0)) != order(shuffled(packs, seed=1, epoch=1))
    assert order(shuffled(packs, seed=1, epoch=0)) != order(shuffled(packs, seed=2, epoch=0))
    assert sorted(order(shuffled(packs, seed=1, epoch=3))) == sorted(order(packs))


def test_packing_stats():
    a = TokenizedExample([1] * 5, [_, 1, 1, _, _])
    b = TokenizedExample([2] * 3, [_, _, 2])
    c = TokenizedExample([3] * 70, [_] * 69 + [3])
    stats = packing_stats(pack([a, b, c], 80), 80)
    assert (stats.conversations, stats.packs, stats.real_tokens, stats.slots) == (3, 1, 78, 80)
    assert stats.efficiency == pytest.approx(78 / 80)
    # Targets: a's label 1 at position 1 and 2 survive the shift (position 0 never does), b's and c's last.
    assert stats.trained_tokens == 2 + 1 + 1
    assert [(h.low, h.high, h.count) for h in stats.histogram] == [(1, 63, 2), (64, 80, 1)]


def test_length_histogram_buckets():
    buckets = length_histogram([1, 63, 64, 127, 128, 1000, 2048], 2048)
    assert [(b.low, b.high) for b in buckets] == [(1, 63), (64, 127), (128, 255), (256, 511), (512, 1023),
                                                  (1024, 2048)]
    assert [b.count for b in buckets] == [2, 2, 1, 0, 1, 1]
