"""Draft trees, drafters, the verification mask and the acceptance rules, without a model."""

from __future__ import annotations

import pytest
import torch

from ligertune.decoding import (
    DraftTree,
    NgramDraft,
    Sampling,
    accept_rule,
    medusa_tree,
    sparse_tree_choices,
)
from ligertune.decoding.drafts import default_medusa_choices, make_drafter
from ligertune.decoding.verify import ExactSampling, GreedyMatch, TypicalAcceptance, tree_mask, tree_positions
from ligertune.errors import UserError

# the module docstring's tree: [a b c], [a d], [e] with a=1, b=2, c=3, d=4, e=5
TREE = DraftTree.from_sequences([[1, 2, 3], [1, 4], [5]])


def test_tree_from_sequences_shares_prefixes():
    assert TREE.tokens == (1, 2, 3, 4, 5)
    assert TREE.parents == (-1, 0, 1, 0, -1)
    assert TREE.depths == (1, 2, 3, 2, 1)
    assert TREE.sequences() == [[1, 2, 3], [1, 4], [5]]
    assert TREE.children(-1) == [0, 4] and TREE.children(0) == [1, 3] and TREE.path(2) == [0, 1, 2]
    assert DraftTree.from_sequences([[1, 2, 3], [1, 4]], max_nodes=3).sequences() == [[1, 2, 3]]
    pruned = TREE.pruned(1)
    assert (pruned.tokens, pruned.parents, pruned.depths) == ((1, 5), (-1, -1), (1, 1))


def test_tree_mask_lets_a_node_see_the_past_the_pending_tokens_and_its_ancestors():
    mask = tree_mask(TREE, past=3, pending=2, dtype=torch.float32, device=torch.device("cpu"))
    assert mask.shape == (1, 1, 2 + 5, 3 + 2 + 5)
    seen = (mask[0, 0] == 0).int()
    expected = torch.tensor([
        # past    pending  a  b  c  d  e
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # pending 0
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],  # pending 1 (the root)
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],  # a
        [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],  # b: a
        [1, 1, 1, 1, 1, 1, 1, 1, 0, 0],  # c: a b
        [1, 1, 1, 1, 1, 1, 0, 0, 1, 0],  # d: a
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 1],  # e
    ])
    assert torch.equal(seen, expected)
    assert tree_positions(TREE, past=3, pending=2).tolist() == [3, 4, 5, 6, 7, 6, 5]
    # a window of 3: the query at position 7 (c) sees keys at positions 5, 6, 7 only
    windowed = tree_mask(TREE, past=3, pending=2, dtype=torch.float32, device=torch.device("cpu"), window=3)
    assert ((windowed[0, 0, 4] == 0).int().tolist()) == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]


def test_ngram_draft_proposes_what_followed_the_latest_match_longest_n_first():
    draft = NgramDraft(max_ngram=3, depth=3, branches=3)
    # "7 8" occurred twice before: latest first (followed by 1 2), then the earlier one (9 9)
    tree = draft.propose([7, 8, 9, 9, 0, 7, 8, 1, 2, 5, 7, 8], None)
    assert tree.sequences()[:2] == [[1, 2, 5], [9, 9, 0]]
    # the 3-gram "4 5 6" wins over its shorter tails' matches, which come after it
    assert draft.propose([4, 5, 6, 1, 2, 3, 5, 6, 9, 4, 5, 6], None).sequences()[0] == [1, 2, 3]
    assert len(draft.propose([1, 2, 3, 4], None)) == 0  # nothing repeats
    # a repeating tail goes on repeating past the end of the text
    assert NgramDraft(depth=5).propose([3, 1, 2, 1, 2], None).sequences()[0] == [1, 2, 1, 2, 1]


def test_medusa_tree_from_fake_head_outputs():
    head_topk = [[10, 11, 12], [20, 21], [30]]  # head k's best tokens, for depth k + 1
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)]
    tree = medusa_tree(head_topk, choices)
    assert sorted(tree.sequences()) == [[10, 20, 30], [10, 21], [11, 20], [12]]
    assert tree.parents[tree.tokens.index(30)] == tree.path(tree.tokens.index(30))[1]
    assert medusa_tree(head_topk[:1], choices).sequences() == [[10], [11], [12]]  # one head: depth 1 only
    with pytest.raises(ValueError, match="prefix"):
        medusa_tree(head_topk, [(0, 1)])


def test_sparse_tree_choices_keep_the_likeliest_paths_and_their_prefixes():
    accuracy = [[0.8, 0.1], [0.5, 0.2], [0.4, 0.1]]
    choices = sparse_tree_choices(accuracy, 5)
    # products: (0,) .8, (0,0) .4, (0,1) .16, (0,0,0) .16, (1,) .1, ...
    assert choices[:2] == [(0,), (0, 0)] and set(choices[2:4]) == {(0, 1), (0, 0, 0)} and choices[4] == (1,)
    many = default_medusa_choices(heads=4, size=64)
    assert len(many) == 64 and all(c[:-1] in set(many) or len(c) == 1 for c in many)
    assert len(medusa_tree([list(range(10))] * 4, many)) == 64


def test_make_drafter_refuses_medusa_without_heads_and_unknown_names(tmp_path):
    with pytest.raises(UserError, match="has no Medusa heads"):
        make_drafter("medusa", model_dir=tmp_path)
    with pytest.raises(UserError, match="--draft: expected one of none, ngram, medusa"):
        make_drafter("eagle")
    with pytest.raises(UserError, match="--accept"):
        accept_rule(Sampling(1.0), "greedy")


# --------------------------------------------------------------------------------------------------
# acceptance rules


def logits_for(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is each row's distribution over a vocabulary of its length."""
    return torch.tensor(rows).log()


def test_greedy_match_keeps_the_path_of_argmaxes_and_adds_the_next_one():
    # root picks 1 (a), a picks 4 (d), d picks 0: [a d] then 0
    rows = [[0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]]
    verdict = GreedyMatch()(torch.tensor(rows, dtype=torch.float32), TREE)
    assert (verdict.path, verdict.next_token) == ([0, 3], 0)
    assert isinstance(accept_rule(Sampling(0.0), "typical"), GreedyMatch)


@pytest.mark.parametrize("top_p", [1.0, 0.8], ids=["top_p-1", "top_p-0.8"])
def test_exact_sampling_keeps_the_target_distribution_whatever_the_guesses(top_p):
    """The first token of many verdicts over a tree guessing 1, 0 and 3 at depth 1 (and 2 under 1)
    is distributed as plain sampling would draw it."""
    p = [0.1, 0.5, 0.15, 0.05, 0.2]
    tree = DraftTree.from_sequences([[1, 2], [0], [3]])
    rows = [p] + [[0.2] * 5] * len(tree)
    sampling = Sampling(temperature=1.0, top_p=top_p)
    rule = ExactSampling(sampling)
    logits = logits_for(*rows)
    draws = 6000
    torch.manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(draws):
        verdict = rule(logits, tree)
        counts[tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    target = sampling.probs(torch.tensor(p).log())
    assert (counts / draws - target).abs().max() < 0.03, (counts / draws, target)
    if top_p < 1:
        assert counts[3] == 0  # outside the nucleus: never accepted, though guessed


def test_typical_acceptance_keeps_plausible_tokens_and_the_longest_path():
    # the root is confident in 1 (a): above the threshold; a is unsure between 2 (b) and 4 (d)
    rows = [[0.02, 0.9, 0.02, 0.02, 0.02, 0.02], [0.0, 0.0, 0.45, 0.0, 0.45, 0.1],
            [0.0, 0.0, 0.0, 0.97, 0.01, 0.02],  # b: c (3) is likely -> [a b c] is the longest path kept
            [1 / 6] * 6, [1 / 6] * 6, [1 / 6] * 6]
    rule = TypicalAcceptance(Sampling(temperature=1.0))
    torch.manual_seed(0)
    assert rule(logits_for(*rows).clamp_min(-1e4), TREE).path == [0, 1, 2]
    # a guess the model finds unlikely (e at 0.02 after the root) is not kept
    assert rule(logits_for(*rows).clamp_min(-1e4), DraftTree.from_sequences([[5]])).path == []
