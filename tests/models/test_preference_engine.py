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
from ligertune.numerics import relative_error
from ligertune.objectives.preference import Preference, PreferenceConfig, dpo_loss, kto_loss, pair_answers
from ligertune.objectives.reference import compute_reference_logps


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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("packs_per_forward", [1, 2, 5])
def test_reference_pass_gives_each_pack_its_answers_alone(case, packs_per_forward):
    """The reference pass, any number of packs a forward (a last forward short of packs too): each
    pack's values are its answers' sums of log p, each answer alone."""
    shapes, kto, groups = CASES[case]
    units = make_units(shapes, kto)
    packs = [make_preference_pack(units, g) for g in groups]
    head = CausalLMLoss(float64_model("llama"))
    head.train()
    compute_reference_logps(head, packs, torch.device("cpu"), packs_per_forward=packs_per_forward)
    assert head.training
    expected = alone_logprobs(float64_model("llama", attention="sdpa"), conversations(units, groups))
    got = [v for pack in packs for v in pack.reference_logps]
    assert [len(p.reference_logps) for p in packs] == [p.num_answers for p in packs]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.stack([e.sum() for e in expected]), rtol=1e-5, atol=1e-5)


KTO_MISMATCHED_SHAPES = [(5, 4, 6), (3, 6, 2), (6, 2, 4), (2, 5, 4)]  # prompt, completion, mismatched
KTO_SPLITS = {  # micro-batches of packs of units
    "packed-1x4": [[[0, 1, 2, 3]]],
    "unpacked-4x1": [[[2]], [[0]], [[3]], [[1]]],
    "unpacked-2x2": [[[3], [1]], [[0], [2]]],
    "packed-2x2": [[[1, 3]], [[2, 0]]],
}


def kto_step(head, units, reference, split, cfg):
    """One KTO step through `Preference` (z0 first, then forward and backward per micro-batch)."""
    head.model.zero_grad()
    objective = Preference(cfg)
    batches = []
    for micro in split:
        packs = [make_preference_pack(units, g) for g in micro]
        for pack, g in zip(packs, micro):
            pack.reference_logps = [x for i in g for x in reference[2 * i: 2 * i + 2].tolist()]
        batches.append(collate_preferences(packs))
    batches = objective.prepare_step(head, batches)
    loss = 0.0
    for batch, w in zip(batches, objective.step_weights(batches)):
        out = objective.forward(head, batch, w)
        out.loss.backward()
        loss += out.loss.item()
    return batches[0].kl_estimate.item(), loss, [p.grad.clone() for p in head.model.parameters()]


def test_kto_z0_and_loss_are_the_formula_and_do_not_depend_on_the_batching():
    """z0 = max(0, mean over the mismatched completions of p - ref) and the mean KTO loss over the
    completions, with each answer's p from its conversation alone in float64; the same z0, loss and
    gradients packed or one unit per pack, in 1, 2 or 4 micro-batches."""
    units = make_units(KTO_MISMATCHED_SHAPES, kto=True)
    expected = alone_logprobs(float64_model("llama", attention="sdpa"), conversations(units, [[0, 1, 2, 3]]))
    policy = torch.stack([e.sum() for e in expected]).detach()  # unit order: completion, mismatched
    offsets = torch.tensor([0.3, 0.5, -0.8, -0.2, 0.1, 0.9, -0.4, 0.2], dtype=torch.float64)
    reference = (policy - offsets).float().double()  # the packs carry float32 values
    completion, mismatched = slice(0, None, 2), slice(1, None, 2)
    z0 = (policy[mismatched] - reference[mismatched]).mean()
    assert z0.item() == pytest.approx(0.35, abs=1e-6)  # the mean of the mismatched offsets
    cfg = PreferenceConfig(loss="kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.8)
    desirable = torch.tensor([u.desirable for u in units])
    want = kto_loss(policy[completion], reference[completion], desirable, z0, beta=0.5, desirable_weight=1.3,
                    undesirable_weight=0.8).losses.mean()

    head = CausalLMLoss(float64_model("llama"))
    results = {name: kto_step(head, units, reference, split, cfg) for name, split in KTO_SPLITS.items()}
    kl, loss, grads = results["packed-1x4"]
    assert kl == pytest.approx(z0.item(), rel=1e-5)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    assert all(g.abs().sum() > 0 for g in grads)
    for name, (other_kl, other_loss, other_grads) in results.items():
        assert other_kl == pytest.approx(kl, rel=1e-6), name
        assert other_loss == pytest.approx(loss, rel=1e-6), name
        for g, g0 in zip(other_grads, grads):
            assert relative_error(g, g0) < 1e-5, name


def test_kto_trains_on_the_completions_and_estimates_kl_on_the_mismatched_completions_alone():
    """The pass without gradient runs each unit as its prompt and mismatched completion, the training
    forward as its prompt and completion: no forward carries an answer it does not score."""
    units = make_units(KTO_MISMATCHED_SHAPES, kto=True)
    head = CausalLMLoss(float64_model("llama"))
    seen = []

    def recording(input_ids, *args, **kwargs):
        seen.append((torch.is_grad_enabled(), input_ids.shape[1]))
        return head(input_ids, *args, **kwargs)

    objective = Preference(PreferenceConfig(loss="kto"))
    packs = [make_preference_pack(units, [0, 1]), make_preference_pack(units, [2, 3])]
    for pack in packs:
        pack.reference_logps = [0.0] * 4
    batches = objective.prepare_step(recording, [collate_preferences([pack]) for pack in packs])
    for batch, w in zip(batches, objective.step_weights(batches)):
        objective.forward(recording, batch, w).loss.backward()
    (p0, c0, m0), (p1, c1, m1), (p2, c2, m2), (p3, c3, m3) = KTO_MISMATCHED_SHAPES
    assert seen == [(False, p0 + m0 + p1 + m1), (False, p2 + m2 + p3 + m3),
                    (True, p0 + c0 + p1 + c1), (True, p2 + c2 + p3 + c3)]


def test_engine_refuses_targets_beside_scores():
    units = make_units(CASES["pairs-3+2"][0][:1], kto=False)
    batch = collate_preferences([make_preference_pack(units, [0])])
    head = CausalLMLoss(float64_model("llama"))
    with pytest.raises(ValueError, match="not both"):
        head(batch.input_ids, batch.position_ids, batch.input_ids, score_rows=batch.score_rows,
             score_targets=batch.score_targets, score_answers=batch.score_answers, num_answers=2,
             **batch.attention())
