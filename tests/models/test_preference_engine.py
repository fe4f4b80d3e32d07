"""The loss head as the preference engine: `CausalLMLoss(...)(ids, positions, score_rows=...)` gives
every answer's sum of log p, in the module's own forward, equal to each prompt + answer run alone.

The oracle runs each conversation alone through `transformers`' sdpa attention in float64 and sums
its scored tokens' log-probs; the engine computes the log-probs in float32 (the fused kernel's, or
the output layer's logits of the scored rows), hence the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from test_preference_attention import CASES, alone_logprobs, conversations, float64_model, make_units

from ligertune.data import collate_preferences
from ligertune.data.preference import make_preference_pack
from ligertune.models import CausalLMLoss
from ligertune.objectives.preference import Preference, PreferenceConfig, dpo_loss, pair_answers


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("case", list(CASES))
def test_engine_sums_are_each_answer_alone(case, fused):
    shapes, kto, groups = CASES[case]
    units = make_units(shapes, kto)
    batch = collate_preferences([make_preference_pack(units, g) for g in groups])
    head = CausalLMLoss(float64_model("llama"), fused=fused)
    out = head(batch.input_ids, batch.position_ids, score_rows=batch.score_rows,
               score_targets=batch.score_targets, score_answers=batch.score_answers,
               num_answers=batch.num_answers, **batch.attention())
    expected = alone_logprobs(float64_model("llama", attention="sdpa"), conversations(units, groups))
    want = torch.stack([e.sum() for e in expected])
    torch.testing.assert_close(out.logp_sum.double(), want, rtol=1e-5, atol=1e-5)
    assert out.n_tokens.tolist() == [e.numel() for e in expected]
    assert out.n_tokens.tolist() == batch.answer_tokens.tolist()


def test_preference_forward_runs_the_engine_and_reads_the_reference():
    """`Preference.forward(head, batch, w)` is the DPO loss of the engine's sums and the batch's
    `reference_logps`, with gradients reaching the model."""
    shapes, _, groups = CASES["pairs-3+2"]
    units = make_units(shapes, kto=False)
    packs = [make_preference_pack(units, g) for g in groups]
    n_answers = [2 * len(g) for g in groups]
    reference = -torch.linspace(5.0, 20.0, sum(n_answers))
    for pack, start, n in zip(packs, [0, n_answers[0]], n_answers):
        pack.reference_logps = reference[start:start + n].tolist()
    batch = collate_preferences(packs)
    assert torch.equal(batch.reference_logps, reference)
    head = CausalLMLoss(float64_model("llama"))
    objective = Preference(PreferenceConfig(loss="dpo", beta=0.3))
    weights = objective.step_weights([batch])[0]
    out = objective.forward(head, batch, weights)

    expected = alone_logprobs(float64_model("llama", attention="sdpa"), conversations(units, groups))
    policy = torch.stack([e.sum() for e in expected]).detach()
    chosen, rejected = pair_answers(batch.answer_pair, batch.answer_chosen, 5)
    want = dpo_loss(policy[chosen], policy[rejected], reference[chosen].double(), reference[rejected].double(),
                    beta=0.3).losses.mean()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.model.parameters())


def test_engine_refuses_targets_beside_scores():
    units = make_units(CASES["pairs-3+2"][0][:1], kto=False)
    batch = collate_preferences([make_preference_pack(units, [0])])
    head = CausalLMLoss(float64_model("llama"))
    with pytest.raises(ValueError, match="not both"):
        head(batch.input_ids, batch.position_ids, batch.input_ids, score_rows=batch.score_rows,
             score_targets=batch.score_targets, score_answers=batch.score_answers, num_answers=2,
             **batch.attention())
