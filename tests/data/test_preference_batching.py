"""Preference micro-batches: packs laid end to end in one row, every range and index offset.

The oracle for the attention ranges is each pack's own dense mask (`PreferencePack.attention_mask`):
the batch's segments, drawn as a dense mask over the whole row, must be those masks on the diagonal.
"""

from __future__ import annotations

import pytest
import torch

from ligertune.data import (
    IGNORE_INDEX,
    KTOExample,
    PreferenceExample,
    collate_preferences,
    pack_preferences,
)
from ligertune.data.preference import make_preference_pack

_ = IGNORE_INDEX


def pair(base: int, p: int, c: int, r: int, unscored: int = 0) -> PreferenceExample:
    """A pair: prompt p, answers c and r tokens; the first `unscored` tokens of each answer unscored."""
    ids = [base + i for i in range(p + c + r)]
    labels = [_] * p
    for n in (c, r):
        start = len(labels)
        labels += [_ if i < unscored else ids[start + i] for i in range(n)]
    return PreferenceExample(input_ids=ids, labels=labels, prompt_len=p, answer_lens=(c, r))


def kto(base: int, p: int, n: int, desirable: bool, mismatched: int = 0) -> KTOExample:
    """A KTO example: prompt p, completion n tokens, and a mismatched completion of `mismatched`."""
    lens = (n, mismatched) if mismatched else (n,)
    ids = [base + i for i in range(p + sum(lens))]
    return KTOExample(input_ids=ids, labels=[_] * p + ids[p:], prompt_len=p, answer_lens=lens,
                      desirable=desirable)


PAIRS = [pair(100, 3, 3, 2), pair(200, 2, 1, 4, unscored=1), pair(300, 4, 2, 2), pair(400, 1, 3, 1)]
KTOS = [kto(100, 3, 2, True), kto(200, 2, 4, False), kto(300, 1, 1, False)]


def dense_mask(cu_q, cu_k, key_index, total: int) -> torch.Tensor:
    """[T, T] bool from the varlen segments: causal aligned to the end of each segment."""
    mask = torch.zeros(total, total, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        for j, row in enumerate(range(q0, q1)):
            for key in key_index[k0: k1 - (q1 - q0) + j + 1]:
                mask[row, key] = True
    return mask


@pytest.mark.parametrize("groups", [[[0, 1], [2], [3]], [[2, 3], [1, 0]], [[0], [1, 2, 3]]],
                         ids=["3packs", "2packs-reordered", "2packs-1-3"])
def test_pair_packs_are_laid_end_to_end_with_every_index_offset(groups):
    packs = [make_preference_pack(PAIRS, g) for g in groups]
    batch = collate_preferences(packs)
    total = sum(len(p) for p in packs)
    assert batch.input_ids.shape == batch.position_ids.shape == (1, total)
    assert batch.input_ids[0].tolist() == [t for p in packs for t in p.input_ids]
    assert batch.position_ids[0].tolist() == [t for p in packs for t in p.position_ids]
    assert not batch.kto

    # Attention: the dense mask of the batch's segments is the packs' own masks on the diagonal.
    assert batch.cu_seqlens_q.dtype == batch.cu_seqlens_k.dtype == torch.int32
    assert batch.cu_seqlens_q[-1] == total and batch.cu_seqlens_k[-1] == batch.key_index.numel()
    mask = dense_mask(batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist(), batch.key_index.tolist(),
                      total)
    assert torch.equal(mask, torch.block_diag(*[p.attention_mask() for p in packs]))
    widths_q = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).tolist()
    widths_k = (batch.cu_seqlens_k[1:] - batch.cu_seqlens_k[:-1]).tolist()
    assert batch.max_seqlen_q == max(widths_q) and batch.max_seqlen_k == max(widths_k)

    # Scores: every pack's triples, rows offset by the pack's start, answers by the answers before.
    expected, row0, answer0 = [], 0, 0
    for p in packs:
        triples = zip(p.score_rows, p.score_targets, p.score_answers)
        expected += [(row0 + r, t, answer0 + a) for r, t, a in triples]
        row0, answer0 = row0 + len(p), answer0 + p.num_answers
    got = list(zip(batch.score_rows.tolist(), batch.score_targets.tolist(), batch.score_answers.tolist()))
    assert got == expected
    ids = batch.input_ids[0]
    for row, target, _answer in got:  # each target is a token of the row after (or of its answer's start)
        assert ids[row] != target and target in ids[row + 1:].tolist()

    # Per answer: its pair, chosen first, and its scored-token count from the units themselves.
    units = [PAIRS[i] for g in groups for i in g]
    assert batch.num_units == len(units) and batch.num_answers == 2 * len(units)
    assert batch.answer_unit.tolist() == [u for u in range(len(units)) for _ in range(2)]
    assert batch.answer_chosen.tolist() == [True, False] * len(units)
    assert not batch.answer_mismatched.any()
    assert batch.answer_tokens.tolist() == [n for u in units for n in u.scored_tokens()]


def test_kto_packs_carry_each_label():
    packs = [make_preference_pack(KTOS, [1]), make_preference_pack(KTOS, [2, 0])]
    batch = collate_preferences(packs)
    assert batch.kto
    assert batch.answer_unit.tolist() == [0, 1, 2]
    assert batch.answer_chosen.tolist() == [False, False, True]
    assert batch.answer_tokens.tolist() == [4, 1, 2]
    total = batch.num_tokens
    mask = dense_mask(batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist(), batch.key_index.tolist(),
                      total)
    assert torch.equal(mask, torch.block_diag(*[p.attention_mask() for p in packs]))
    assert batch.key_index.tolist() == list(range(total))  # KTO units are plain causal segments


def test_kto_packs_with_mismatched_completions_mark_them():
    """A KTO example's second answer is its mismatched completion: never desirable, always marked,
    attending to the prompt and itself as a pair's rejected answer does."""
    units = [kto(100, 3, 2, True, mismatched=3), kto(200, 2, 4, False, mismatched=1),
             kto(300, 1, 1, True, mismatched=2)]
    packs = [make_preference_pack(units, [1]), make_preference_pack(units, [2, 0])]
    batch = collate_preferences(packs)
    assert batch.kto
    assert batch.answer_unit.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.answer_chosen.tolist() == [False, False, True, False, True, False]
    assert batch.answer_mismatched.tolist() == [False, True] * 3
    assert batch.answer_tokens.tolist() == [4, 1, 1, 2, 2, 3]
    mask = dense_mask(batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist(), batch.key_index.tolist(),
                      batch.num_tokens)
    assert torch.equal(mask, torch.block_diag(*[p.attention_mask() for p in packs]))
    first = packs[0].attention_mask()  # unit 1: prompt 2, completion 4, mismatched 1
    assert first[6, :2].all() and not first[6, 2:6].any() and first[6, 6]


def test_packs_from_pack_preferences_collate():
    packs = pack_preferences(PAIRS, max_seq_len=12)
    assert len(packs) > 1
    batch = collate_preferences(packs)
    assert batch.answer_tokens.sum() == batch.score_rows.numel() == sum(p.trained_tokens for p in packs)


def test_mixed_or_empty_batches_are_refused():
    with pytest.raises(ValueError, match="separate batches"):
        collate_preferences([make_preference_pack(PAIRS, [0]), make_preference_pack(KTOS, [0])])
    with pytest.raises(ValueError, match="at least one pack"):
        collate_preferences([])


def test_to_keeps_the_attention_boundaries_and_the_scored_counts_on_the_host():
    batch = collate_preferences([make_preference_pack(PAIRS, [0, 1])])
    moved = batch.to("meta")
    moved_fields = ("input_ids", "position_ids", "score_rows", "score_answers", "answer_chosen",
                    "answer_mismatched")
    for name in moved_fields:
        assert getattr(moved, name).device.type == "meta"
    for name in ("cu_seqlens_q", "cu_seqlens_k", "key_index", "answer_tokens"):
        assert getattr(moved, name).device.type == "cpu"
    assert moved.max_seqlen_k == batch.max_seqlen_k and moved.kto is False
    assert set(batch.attention()) == {"cu_seqlens", "max_seqlen", "cu_seqlens_k", "max_seqlen_k", "key_index"}


def alone(unit: KTOExample, answer: int) -> KTOExample:
    """The unit as its prompt and its answer `answer` alone."""
    p = unit.prompt_len
    start, end = unit.answer_spans[answer]
    return KTOExample(input_ids=unit.input_ids[:p] + unit.input_ids[start:end],
                      labels=unit.labels[:p] + unit.labels[start:end], prompt_len=p,
                      answer_lens=(unit.answer_lens[answer],), desirable=unit.desirable)


def assert_same_layout(got, want) -> None:
    for name in ("input_ids", "position_ids", "cu_seqlens_q", "cu_seqlens_k", "key_index", "score_rows",
                 "score_targets", "score_answers", "answer_unit", "answer_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.max_seqlen_q, got.max_seqlen_k) == (want.max_seqlen_q, want.max_seqlen_k)
    assert (got.prompt_lens, got.answer_lens) == (want.prompt_lens, want.answer_lens)


def test_kto_parts_are_the_units_with_each_completion_alone():
    """The training forward runs each KTO unit as its prompt and completion, the KL estimate's as its
    prompt and mismatched completion: each part is the batch those units would collate to, with the
    flags and the reference values of its answers."""
    units = [kto(100, 3, 2, True, mismatched=3), kto(200, 2, 4, False, mismatched=1),
             kto(300, 1, 1, True, mismatched=2)]
    units[1].labels[2 + 4] = _  # an unscored token of a mismatched completion
    packs = [make_preference_pack(units, [1]), make_preference_pack(units, [2, 0])]
    batch = collate_preferences(packs)
    batch.reference_logps = torch.arange(6, dtype=torch.float32)
    batch.kl_estimate = torch.tensor(0.5)
    completions, mismatched = batch.kto_parts()
    order = [1, 2, 0]
    for part, answer in ((completions, 0), (mismatched, 1)):
        singles = [alone(units[i], answer) for i in order]
        assert_same_layout(part, collate_preferences([make_preference_pack(singles, [0]),
                                                      make_preference_pack(singles, [1, 2])]))
        assert part.kto and part.kl_estimate is batch.kl_estimate
        assert part.reference_logps.tolist() == batch.reference_logps[answer::2].tolist()
    assert completions.answer_chosen.tolist() == [False, True, True]
    assert not completions.answer_mismatched.any()
    assert mismatched.answer_mismatched.all() and not mismatched.answer_chosen.any()
    assert mismatched.answer_tokens.tolist() == [0, 2, 3]


def test_kto_parts_keep_the_prompt_of_a_unit_without_the_answer():
    """A unit without a mismatched completion (a padding unit has no answer at all) stays in both
    parts as its prompt, scoring nothing there: every rank runs as many forwards."""
    units = [kto(100, 3, 2, True, mismatched=3), kto(200, 2, 4, False)]
    batch = collate_preferences([make_preference_pack(units, [0, 1])])
    completions, mismatched = batch.kto_parts()
    assert completions.answer_lens == [(2,), (4,)] and completions.num_tokens == 11
    assert mismatched.answer_lens == [(3,), ()] and mismatched.num_tokens == 8
    assert mismatched.input_ids[0].tolist() == [100, 101, 102, 105, 106, 107, 200, 201]
    assert mismatched.answer_unit.tolist() == [0]
    mask = dense_mask(mismatched.cu_seqlens_q.tolist(), mismatched.cu_seqlens_k.tolist(),
                      mismatched.key_index.tolist(), 8)
    assert torch.equal(mask[6:, 6:], torch.ones(2, 2, dtype=torch.bool).tril()) and not mask[6:, :6].any()


def test_a_batch_of_pairs_is_its_own_training_part():
    batch = collate_preferences([make_preference_pack(PAIRS, [0, 1])])
    training, mismatched = batch.kto_parts()
    assert training is batch and mismatched is None


def test_select_answers_drops_a_pairs_answer_and_closes_the_row():
    batch = collate_preferences([make_preference_pack(PAIRS, [0, 1])])
    rejected_only = batch.select_answers([False, True, False, True])
    singles = [PreferenceExample(input_ids=u.input_ids[:u.prompt_len] + u.input_ids[u.answer_spans[1][0]:],
                                 labels=u.labels[:u.prompt_len] + u.labels[u.answer_spans[1][0]:],
                                 prompt_len=u.prompt_len, answer_lens=(u.answer_lens[1],)) for u in PAIRS[:2]]
    assert_same_layout(rejected_only, collate_preferences([make_preference_pack(singles, [0, 1])]))
    with pytest.raises(ValueError, match="4 answers"):
        batch.select_answers([True])


def test_a_kto_pack_that_scores_nothing_gives_two_parts_of_its_prompt():
    """The held-out padding pack (its first prompt, no answer: `evaluation.without_targets`) still
    runs both passes, so that every rank runs as many forwards."""
    from ligertune.training.evaluation import without_targets

    units = [kto(100, 3, 2, True, mismatched=3)]
    padding = without_targets(make_preference_pack(units, [0]))
    completions, mismatched = collate_preferences([padding]).kto_parts()
    for part in (completions, mismatched):
        assert part.input_ids[0].tolist() == [100, 101, 102] and part.num_answers == 0
        assert part.score_rows.numel() == 0 and part.cu_seqlens_q.tolist() == [0, 3]
