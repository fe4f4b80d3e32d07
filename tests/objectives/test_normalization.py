"""Step-level loss weights: the worked example of docs/loss.md, and invariance to how a step is cut."""

from __future__ import annotations

import pytest
import torch

from ligertune.objectives.normalization import step_token_weights

IGNORE = -100


def micro_batch(lengths: list[int], unsupervised_first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and seq_ids of one flattened micro-batch of conversations of `lengths` supervised tokens."""
    targets, seq_ids = [], []
    for i, n in enumerate(lengths):
        targets += [IGNORE] * unsupervised_first + list(range(1, n + 1))
        seq_ids += [i] * (unsupervised_first + n)
    return torch.tensor([targets]), torch.tensor(seq_ids)


def test_worked_example_two_conversations():
    # [a..g] (7 supervised tokens) and [x, y] (2) packed in one micro-batch.
    targets, seq_ids = micro_batch([7, 2], unsupervised_first=3)
    losses = torch.rand(targets.shape, dtype=torch.float64)
    supervised = targets != IGNORE
    (w_seq,) = step_token_weights([targets], [seq_ids], "sequence")
    (w_tok,) = step_token_weights([targets], [seq_ids], "token")
    (w_sum,) = step_token_weights([targets], [seq_ids], "sum")
    l_a = losses[0, 3:10]
    l_x = losses[0, 13:15]
    by_hand_seq = 0.5 * (l_a.sum() / 7 + l_x.sum() / 2)
    by_hand_tok = (l_a.sum() + l_x.sum()) / 9
    assert torch.allclose((w_seq * losses).sum(), by_hand_seq)
    assert torch.allclose((w_tok * losses).sum(), by_hand_tok)
    assert torch.allclose((w_sum * losses).sum(), losses[supervised].sum())
    assert not torch.allclose(by_hand_seq, by_hand_tok)  # the example is not degenerate
    assert (w_seq[~supervised] == 0).all() and (w_tok[~supervised] == 0).all()


@pytest.mark.parametrize("mode", ["token", "sequence", "sum"])
def test_one_micro_batch_of_eight_equals_eight_of_one(mode):
    lengths = [5, 1, 9, 3, 2, 7, 4, 6]
    whole = step_token_weights(*map(list, zip(micro_batch(lengths))), mode)
    whole_per_conversation = [whole[0][0, micro_batch(lengths)[1] == i].sum() for i in range(8)]
    cut = [micro_batch([n]) for n in lengths]
    split = step_token_weights([t for t, _ in cut], [s for _, s in cut], mode)
    split_per_conversation = [w.sum() for w in split]
    assert torch.allclose(torch.stack(whole_per_conversation), torch.stack(split_per_conversation))


def test_conversation_without_supervised_tokens_does_not_count():
    targets = torch.tensor([[IGNORE, IGNORE, 1, 2]])
    seq_ids = torch.tensor([0, 0, 1, 1])
    (w,) = step_token_weights([targets], [seq_ids], "sequence")
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.5, 0.5]]))


def test_token_and_sum_need_no_conversation_ids():
    targets = torch.tensor([[IGNORE, 1, 2, 3]])
    (w,) = step_token_weights([targets], None, "token")
    assert torch.allclose(w, torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]]))
    with pytest.raises(ValueError, match="needs the seq_ids"):
        step_token_weights([targets], None, "sequence")
