"""Preference losses: per-answer log-probabilities without logits, each loss against its formula in
float64, and the step loss as one number whatever the batching."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ligertune.data import PreferenceBatch, collate_preferences
from ligertune.data.preference import KTOExample, PreferenceExample, make_preference_pack
from ligertune.kernels import LossOptions
from ligertune.numerics import relative_error
from ligertune.objectives.preference import (
    AnswerLogps,
    Preference,
    PreferenceConfig,
    answer_logps,
    dpo_loss,
    ipo_loss,
    kto_loss,
    log1mexp,
    num_pairs,
    orpo_loss,
    pair_answers,
    simpo_loss,
    step_pair_weights,
)
from ligertune.training.evaluation import without_targets

# --------------------------------------------------------------------------------------------------
# answer_logps against explicit float64 logits


def oracle_logps(hidden, weight, rows, targets, answers, num_answers, bias=None, softcap=None):
    """log_softmax of the explicit logits, in float64, summed per answer."""
    z = hidden.double()[rows] @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, dim=-1).gather(1, targets[:, None]).squeeze(1)
    return torch.zeros(num_answers, dtype=torch.float64).index_add(0, answers, logp)


def make_scores(n_rows: int, vocab: int, n_scores: int, num_answers: int, gen: torch.Generator):
    rows = torch.randint(0, n_rows, (n_scores,), generator=gen)
    rows[1] = rows[0]  # a row scored twice, as the prompt's last row of a pair
    rows[-1] = rows[0]
    targets = torch.randint(0, vocab, (n_scores,), generator=gen)
    answers = torch.randint(0, num_answers - 1, (n_scores,), generator=gen)  # the last answer: no tokens
    answers[0], answers[1] = 0, 1
    return rows, targets, answers


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize(
    "dtype, tol",
    [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 2e-2, id="bf16")],
)
@pytest.mark.parametrize(
    "n, h, v, s, a, extras",
    [
        pytest.param(37, 24, 101, 29, 5, False, id="N37-H24-V101-S29"),
        pytest.param(8, 16, 64, 8, 3, False, id="N8-H16-V64-S8"),
        pytest.param(37, 24, 101, 53, 7, True, id="N37-H24-V101-S53-bias-softcap-chunks"),
    ],
)
def test_answer_logps_matches_explicit_logits(path, dtype, tol, n, h, v, s, a, extras, monkeypatch):
    monkeypatch.setenv("LIGERTUNE_KERNELS", path)
    gen = torch.Generator().manual_seed(n * 1000 + s)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).requires_grad_()
    bias = (torch.randn(v, generator=gen) * 0.1).to(dtype).requires_grad_() if extras else None
    softcap = 3.0 if extras else None
    # A small budget cuts the rows into several chunks.
    # The head's own options: their smoothing, z-loss and reduction do not apply to log-probabilities.
    options = LossOptions(softcap=softcap, chunk_bytes=4096 if extras else None, label_smoothing=0.3,
                          z_loss_weight=1e-3, reduction="sum")
    rows, targets, answers = make_scores(n, v, s, a, gen)
    grad_out = torch.randn(a, generator=gen, dtype=torch.float64)

    out = answer_logps(hidden, weight, rows, targets, answers, a, bias=bias, options=options)
    (out.logp_sum.double() * grad_out).sum().backward()

    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    b64 = bias.detach().double().requires_grad_() if extras else None
    expected = oracle_logps(*leaves, rows, targets, answers, a, bias=b64, softcap=softcap)
    (expected * grad_out).sum().backward()

    assert out.logp_sum.dtype == torch.float32
    assert torch.equal(out.n_tokens, torch.bincount(answers, minlength=a))
    assert out.logp_sum[-1] == 0 and out.n_tokens[-1] == 0
    assert relative_error(out.logp_sum, expected) < tol
    assert relative_error(hidden.grad, leaves[0].grad) < tol
    assert relative_error(weight.grad, leaves[1].grad) < tol
    if extras:
        assert relative_error(bias.grad, b64.grad) < tol


def test_answer_logps_row_scored_twice_is_gathered_twice():
    """The prompt's last row predicts both answers' first tokens: each sum has its own term."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    rows, targets, answers = torch.tensor([2, 2]), torch.tensor([3, 7]), torch.tensor([0, 1])
    out = answer_logps(hidden.float(), weight.float(), rows, targets, answers, 2)
    logp = torch.log_softmax(hidden[2] @ weight.T, dim=-1)
    torch.testing.assert_close(out.logp_sum.double(), logp[[3, 7]], rtol=1e-6, atol=1e-6)


def test_answer_logps_without_scores_still_reaches_the_inputs():
    hidden = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.long)
    out = answer_logps(hidden, weight, empty, empty, empty, 2)
    assert torch.equal(out.logp_sum, torch.zeros(2))
    assert torch.equal(out.n_tokens, torch.zeros(2, dtype=torch.long))
    out.logp_sum.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_answer_logps_refuses_an_answer_beyond_the_batch():
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="names answer 2"):
        answer_logps(torch.randn(2, 3), torch.randn(4, 3), one, one, torch.tensor([2]), 2)


# --------------------------------------------------------------------------------------------------
# Each loss against its formula on hand-made numbers


def t64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def test_dpo_at_zero_margin_is_log_two_with_or_without_smoothing():
    for eps in (0.0, 0.1, 0.3):
        out = dpo_loss(t64(-5.0, -9.0), t64(-7.0, -2.0), t64(-5.0, -8.0), t64(-7.0, -1.0), beta=0.3,
                       label_smoothing=eps)
        torch.testing.assert_close(out.losses, t64(math.log(2), math.log(2)), rtol=0, atol=1e-15)


@pytest.mark.parametrize("eps", [0.0, 0.2], ids=["plain", "smoothed"])
def test_dpo_matches_its_formula(eps):
    pc, pr, beta = [-3.5, -12.0, -1.0], [-6.0, -4.0, -30.0], 0.7
    rc, rr = [-4.0, -10.0, -2.0], [-5.0, -5.0, -20.0]
    out = dpo_loss(t64(*pc), t64(*pr), t64(*rc), t64(*rr), beta=beta, label_smoothing=eps)
    expected, chosen, rejected = [], [], []
    for a, b, c, d in zip(pc, pr, rc, rr):
        m = beta * ((a - c) - (b - d))
        expected.append(-(1 - eps) * log_sigmoid(m) - eps * log_sigmoid(-m))
        chosen.append(beta * (a - c))
        rejected.append(beta * (b - d))
    torch.testing.assert_close(out.losses, t64(*expected), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.chosen_rewards, t64(*chosen), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.margins, t64(*chosen) - t64(*rejected), rtol=1e-14, atol=0)
    assert out.accuracies.tolist() == [1.0, 0.0, 1.0]


def test_dpo_label_smoothing_is_the_flipped_pair_mixed_in():
    args = (t64(-3.0), t64(-6.0), t64(-4.0), t64(-4.5))
    plain = dpo_loss(*args, beta=0.5).losses
    flipped = dpo_loss(args[1], args[0], args[3], args[2], beta=0.5).losses
    smoothed = dpo_loss(*args, beta=0.5, label_smoothing=0.25).losses
    torch.testing.assert_close(smoothed, 0.75 * plain + 0.25 * flipped, rtol=1e-14, atol=0)
    assert not torch.allclose(smoothed, plain)


def test_dpo_does_not_train_the_reference():
    rc = t64(-4.0).requires_grad_()
    pc = t64(-3.0).requires_grad_()
    dpo_loss(pc, t64(-6.0), rc, t64(-4.5)).losses.sum().backward()
    assert rc.grad is None and pc.grad is not None and pc.grad.item() < 0  # raising pc lowers the loss


def test_ipo_matches_its_formula_on_token_means():
    pc, pr, rc, rr = [-6.0, -2.0], [-9.0, -1.0], [-4.0, -3.0], [-8.0, -2.5]
    nc, nr, beta = [3, 1], [5, 2], 0.25
    out = ipo_loss(t64(*pc), t64(*pr), t64(*rc), t64(*rr), torch.tensor(nc), torch.tensor(nr), beta=beta)
    expected = [((a - c) / n - (b - d) / k - 1 / (2 * beta)) ** 2
                for a, b, c, d, n, k in zip(pc, pr, rc, rr, nc, nr)]
    torch.testing.assert_close(out.losses, t64(*expected), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.chosen_rewards, t64(*[beta * (a - c) / n for a, c, n in zip(pc, rc, nc)]),
                               rtol=1e-14, atol=0)
    # At the target h = 1/(2 beta) the loss is 0.
    zero = ipo_loss(t64(2.0), t64(0.0), t64(0.0), t64(0.0), torch.tensor([1]), torch.tensor([1]), beta=0.25)
    assert zero.losses.item() == 0.0


def test_simpo_matches_its_formula():
    pc, pr, nc, nr, beta, gamma = [-6.0, -2.0], [-9.0, -0.5], [3, 4], [5, 1], 2.5, 0.8
    out = simpo_loss(t64(*pc), t64(*pr), torch.tensor(nc), torch.tensor(nr), beta=beta, gamma=gamma)
    expected = [-log_sigmoid(beta * (a / n - b / k) - gamma) for a, b, n, k in zip(pc, pr, nc, nr)]
    torch.testing.assert_close(out.losses, t64(*expected), rtol=1e-14, atol=0)
    assert out.accuracies.tolist() == [0.0, 0.0]  # -2 > -1.8 is false; -0.5 > -0.5 is false


def test_orpo_matches_its_formula():
    pc, pr, nc, nr, lam = [-6.0, -0.3], [-9.0, -0.2], [3, 4], [5, 1], 0.1
    out = orpo_loss(t64(*pc), t64(*pr), torch.tensor(nc), torch.tensor(nr), lam=lam)
    expected = []
    for a, b, n, k in zip(pc, pr, nc, nr):
        ma, mb = a / n, b / k
        odds = (ma - math.log(1 - math.exp(ma))) - (mb - math.log(1 - math.exp(mb)))
        expected.append(-ma - lam * log_sigmoid(odds))
    torch.testing.assert_close(out.losses, t64(*expected), rtol=1e-14, atol=0)


def test_log1mexp_is_accurate_at_both_ends_and_orpo_stays_finite_near_certainty():
    xs = [-1e-12, -1e-6, -0.1, -0.6931, -0.6932, -1.0, -20.0, -50.0]
    mpmath = pytest.importorskip("mpmath")  # installed with torch (through sympy)
    mpmath.mp.dps = 50
    got = log1mexp(t64(*xs))
    expected = t64(*[float(mpmath.log(1 - mpmath.exp(mpmath.mpf(x)))) for x in xs])
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)
    got32 = log1mexp(torch.tensor(xs, dtype=torch.float32))
    assert relative_error(got32, expected) < 1e-6
    # A chosen answer the model is nearly sure of, in float32: finite loss and gradient.
    pc = torch.tensor([-1e-7], requires_grad=True)
    out = orpo_loss(pc, torch.tensor([-3.0]), torch.tensor([1]), torch.tensor([1]))
    out.losses.sum().backward()
    assert torch.isfinite(out.losses).all() and torch.isfinite(pc.grad).all()


def test_kto_matches_its_formula_and_signs():
    p, ref = t64(-3.0, -3.0, -8.0, -8.0), t64(-5.0, -5.0, -6.0, -6.0)
    desirable = torch.tensor([True, False, True, False])
    beta, z, wd, wu = 0.5, 0.4, 1.0, 1.5
    out = kto_loss(p.clone().requires_grad_(), ref, desirable, z, beta=beta,
                   desirable_weight=wd, undesirable_weight=wu)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [wd * (1 - sig(beta * (2 - z))), wu * (1 - sig(beta * (z - 2))),
                wd * (1 - sig(beta * (-2 - z))), wu * (1 - sig(beta * (z + 2)))]
    torch.testing.assert_close(out.losses, t64(*expected), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.chosen_rewards, beta * (p - ref), rtol=1e-14, atol=0)
    # A desirable answer above the reference point costs less than an undesirable one there.
    assert out.losses[0] < out.losses[1] and out.losses[2] > out.losses[3]
    # Gradient: raise the log p of desirable answers, lower that of undesirable ones.
    policy = p.clone().requires_grad_()
    kto_loss(policy, ref, desirable, z, beta=beta).losses.sum().backward()
    assert (policy.grad[desirable] < 0).all() and (policy.grad[~desirable] > 0).all()


def test_kto_reference_point_is_clamped_at_zero_and_fixed():
    p, ref, desirable = t64(-3.0, -7.0), t64(-5.0, -6.0), torch.tensor([True, False])
    at_zero = kto_loss(p, ref, desirable, 0.0).losses
    negative = t64(-2.0).requires_grad_()
    clamped = kto_loss(p, ref, desirable, negative).losses
    torch.testing.assert_close(clamped, at_zero, rtol=0, atol=0)
    z = t64(0.7).requires_grad_()
    kto_loss(p.clone().requires_grad_(), ref, desirable, z).losses.sum().backward()
    assert z.grad is None


# --------------------------------------------------------------------------------------------------
# One step loss whatever the batching


def test_pair_answers_finds_each_side_of_each_pair_in_any_order():
    # pairs 0..3; pair 2 lists its rejected answer first, pair 3 has only a chosen one
    answer_pair = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    answer_chosen = torch.tensor([True, False, True, False, False, True, True])
    chosen, rejected = pair_answers(answer_pair, answer_chosen, 4)
    assert chosen.tolist() == [0, 2, 5, 6]
    assert rejected.tolist() == [1, 3, 4, -1]


def test_num_pairs_counts_the_units_with_answers():
    units = [
        PreferenceExample(input_ids=[1, 2, 3, 4, 5, 6], labels=[-100, -100, -100, 4, 5, 6], prompt_len=3,
                          answer_lens=(2, 1)),
        PreferenceExample(input_ids=[7, 8, 9, 10], labels=[-100, 8, 9, 10], prompt_len=1, answer_lens=(1, 2)),
    ]
    pack = make_preference_pack(units, [0, 1])
    batch = collate_preferences([pack])
    assert num_pairs(batch) == 2 == int(batch.answer_pair.max()) + 1
    # a rank's stand-in pack in held-out evaluation: a prompt and no answer
    stand_in = without_targets(pack)
    assert num_pairs(collate_preferences([stand_in])) == 0
    assert num_pairs(collate_preferences([pack, stand_in])) == 2


def test_step_pair_weights_count_the_whole_step():
    weights = step_pair_weights([3, 0, 1])
    assert [w.shape[0] for w in weights] == [3, 0, 1]
    assert all(torch.equal(w, torch.full_like(w, 0.25)) for w in weights)
    assert step_pair_weights([0])[0].numel() == 0  # no pairs: nothing to divide


VOCAB, HIDDEN = 29, 12


class ToyScorer(nn.Module):
    """A stand-in for the model: a token's hidden state from its id and position (no attention,
    which a batching identity does not need), then the output projection."""

    def __init__(self, *, explicit_logits: bool):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64))
        self.pos = nn.Parameter(torch.randn(64, HIDDEN, generator=gen, dtype=torch.float64) * 0.1)
        self.proj = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5)
        self.explicit_logits = explicit_logits

    def forward(self, input_ids, position_ids, score_rows, score_targets, score_answers, num_answers,
                **attention):
        hidden = torch.tanh(self.embed[input_ids.reshape(-1)] + self.pos[position_ids.reshape(-1)])
        if self.explicit_logits:  # the float64 oracle
            logp = oracle_logps(hidden, self.proj, score_rows, score_targets, score_answers, num_answers)
            return AnswerLogps(logp, torch.bincount(score_answers, minlength=num_answers))
        return answer_logps(hidden, self.proj, score_rows, score_targets, score_answers, num_answers)


def make_units(kto: bool) -> list:
    """4 pairs, or 4 KTO examples whose second answer is the next example's completion (mismatched)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (2 + i,), generator=gen).tolist() for i in range(4)]
    answers = [[torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1 + i % 3, 3 - i % 2)]
               for i in range(4)]
    if kto:
        answers = [[answers[i][0], answers[(i + 1) % 4][0]] for i in range(4)]
    units = []
    for i, (prompt, two) in enumerate(zip(prompts, answers)):
        labels = [-100] * len(prompt) + [t for a in two for t in a]
        if i == 1:
            labels[len(prompt) + 1] = -100  # an unscored answer token
        common = dict(input_ids=prompt + [t for a in two for t in a], labels=labels,
                      prompt_len=len(prompt), answer_lens=tuple(len(a) for a in two))
        units.append(KTOExample(**common, desirable=i % 3 != 1) if kto else PreferenceExample(**common))
    return units


def collate_toy(units, indices, reference: torch.Tensor) -> PreferenceBatch:
    """One pack of the units at `indices` as a micro-batch, with the reference sums of its answers."""
    first = [sum(len(u.answer_lens) for u in units[:i]) for i in indices]
    ref = torch.cat([reference[f:f + len(units[i].answer_lens)] for f, i in zip(first, indices)])
    batch = collate_preferences([make_preference_pack(units, indices)])
    batch.reference_logps = ref
    return batch


SPLITS = {"1x4": [[0, 1, 2, 3]], "4x1": [[2], [0], [3], [1]], "2x2": [[3, 1], [0, 2]]}


def run_step(objective: Preference, scorer: ToyScorer, units, split, reference):
    scorer.zero_grad()
    batches = objective.prepare_step(scorer, [collate_toy(units, idx, reference) for idx in split])
    weights = objective.step_weights(batches)
    loss, totals = 0.0, {name: 0.0 for name in objective.sums}
    for batch, w in zip(batches, weights):
        out = objective.forward(scorer, batch, w)
        out.loss.backward()
        loss += out.loss.item()
        for name in objective.sums:
            totals[name] += float(out.sums[name])
    grads = [p.grad.clone() for p in scorer.parameters()]
    return loss, grads, objective.summarize(totals)


@pytest.mark.parametrize("explicit_logits, tol", [pytest.param(True, 1e-12, id="float64-logits"),
                                                 pytest.param(False, 1e-5, id="fused")])
@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_step_loss_and_gradient_do_not_depend_on_the_batching(loss, explicit_logits, tol):
    kto = loss == "kto"
    units = make_units(kto)
    n_answers = sum(len(u.answer_lens) for u in units)
    reference = -torch.linspace(2.0, 9.0, n_answers, dtype=torch.float64)
    cfg = PreferenceConfig(loss=loss, beta=0.4, label_smoothing=0.1 if loss == "dpo" else 0.0, gamma=0.3,
                           orpo_lambda=0.2, desirable_weight=1.0, undesirable_weight=1.3)
    objective = Preference(cfg)
    scorer = ToyScorer(explicit_logits=explicit_logits)
    results = {name: run_step(objective, scorer, units, split, reference) for name, split in SPLITS.items()}

    # The one-batch step is the mean over the 4 pairs of the loss function, on the oracle's sums.
    oracle = ToyScorer(explicit_logits=True)
    whole = collate_toy(units, [0, 1, 2, 3], reference)
    logps = oracle(whole.input_ids, whole.position_ids, whole.score_rows, whole.score_targets,
                   whole.score_answers, n_answers)
    p, n = logps.logp_sum.detach(), logps.n_tokens
    if kto:
        completion, mismatched = torch.arange(0, n_answers, 2), torch.arange(1, n_answers, 2)
        z0 = (p[mismatched] - reference[mismatched]).mean()
        assert z0 > 0.05  # not clamped: the estimate itself is what is compared
        expected = kto_loss(p[completion], reference[completion], whole.answer_chosen[completion], z0,
                            beta=0.4, undesirable_weight=1.3).losses.mean()
    else:
        c, r = torch.arange(0, n_answers, 2), torch.arange(1, n_answers, 2)
        expected = {
            "dpo": lambda: dpo_loss(p[c], p[r], reference[c], reference[r], beta=0.4, label_smoothing=0.1),
            "ipo": lambda: ipo_loss(p[c], p[r], reference[c], reference[r], n[c], n[r], beta=0.4),
            "simpo": lambda: simpo_loss(p[c], p[r], n[c], n[r], beta=0.4, gamma=0.3),
            "orpo": lambda: orpo_loss(p[c], p[r], n[c], n[r], lam=0.2),
        }[loss]().losses.mean()
    base_loss, base_grads, base_metrics = results["1x4"]
    assert math.isclose(base_loss, expected.item(), rel_tol=tol)
    assert base_metrics["loss"] == pytest.approx(base_loss, rel=1e-6)
    for name in ("4x1", "2x2"):
        step_loss, grads, metrics = results[name]
        assert math.isclose(step_loss, base_loss, rel_tol=tol), name
        for g, g0 in zip(grads, base_grads):
            assert relative_error(g, g0) < tol, name
        for key, value in metrics.items():
            assert value == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-6), (name, key)
    assert all(g.abs().sum() > 0 for g in base_grads)


def test_summarize_reports_the_mean_over_pairs():
    objective = Preference(PreferenceConfig(loss="dpo"))
    metrics = objective.summarize({"loss": 0.5, "n_pairs": 4, "n_tokens": 40, "chosen_reward": 2.0,
                                   "rejected_reward": -2.0, "accuracy": 3, "chosen_logp": -4.0,
                                   "rejected_logp": -8.0})
    assert metrics == {"loss": 0.5, "reward_chosen": 0.5, "reward_rejected": -0.5, "reward_margin": 1.0,
                       "reward_accuracy": 0.75, "logp_chosen": -1.0, "logp_rejected": -2.0}
    assert set(objective.held_out) <= set(metrics)


def test_reference_losses_refuse_a_batch_without_reference_logps():
    units = make_units(False)
    batch = collate_toy(units, [0], torch.zeros(8, dtype=torch.float64))
    batch.reference_logps = None
    scorer = ToyScorer(explicit_logits=True)
    with pytest.raises(ValueError, match="reference"):
        Preference(PreferenceConfig(loss="dpo")).forward(scorer, batch, torch.ones(1))
    Preference(PreferenceConfig(loss="simpo")).forward(scorer, batch, torch.ones(1))  # reference-free


# --------------------------------------------------------------------------------------------------
# KTO's reference point z0, from the mismatched completions of the whole step


def kto_step(reference, split, *, desirable_weight=1.0, undesirable_weight=1.0):
    """One KTO step of the toy units (`split` into micro-batches): z0, the summed metrics and the
    policy's sums with their gradient."""
    objective = Preference(PreferenceConfig(loss="kto", beta=0.4, desirable_weight=desirable_weight,
                                            undesirable_weight=undesirable_weight))
    units, scorer = make_units(kto=True), ToyScorer(explicit_logits=True)
    batches = objective.prepare_step(scorer, [collate_toy(units, idx, reference) for idx in split])
    totals = {name: 0.0 for name in objective.sums}
    for batch, w in zip(batches, objective.step_weights(batches)):
        out = objective.forward(scorer, batch, w)
        out.loss.backward()
        for name in objective.sums:
            totals[name] += float(out.sums[name])
    return batches[0].kl_estimate, objective.summarize(totals)


def oracle_sums(units) -> torch.Tensor:
    whole = collate_toy(units, [0, 1, 2, 3], torch.zeros(8, dtype=torch.float64))
    return ToyScorer(explicit_logits=True)(whole.input_ids, whole.position_ids, whole.score_rows,
                                           whole.score_targets, whole.score_answers, 8).logp_sum.detach()


def test_kto_at_policy_equal_to_reference_costs_half_of_each_weight():
    """At the start (reference = policy) every log-ratio is 0: z0 = 0, rewards 0, and each example
    costs w (1 - sigmoid(0)) = w / 2, so the step loss is (w_d n_d + w_u n_u) / n / 2."""
    units = make_units(kto=True)
    n_d = sum(u.desirable for u in units)
    z0, metrics = kto_step(oracle_sums(units), [[0, 1], [2, 3]], desirable_weight=1.5, undesirable_weight=0.7)
    assert z0.item() == pytest.approx(0.0, abs=1e-12)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["reward_desirable"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["reward_undesirable"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["loss"] == pytest.approx((1.5 * n_d + 0.7 * (4 - n_d)) / 4 * 0.5, rel=1e-7)  # float32 sums


def test_kto_z0_is_the_mean_over_the_mismatched_completions_clamped_at_zero():
    units = make_units(kto=True)
    policy = oracle_sums(units)
    shift = torch.tensor([0.0, 0.9, 0.0, -0.1, 0.0, 0.4, 0.0, 0.2], dtype=torch.float64)  # mismatched: odd
    z0, metrics = kto_step(policy - shift, [[3], [1, 0], [2]])
    assert z0.item() == pytest.approx(0.35, rel=1e-12)  # (0.9 - 0.1 + 0.4 + 0.2) / 4
    assert metrics["kl"] == pytest.approx(0.35, rel=1e-7)  # the sums are float32
    below, metrics = kto_step(policy + shift, [[3], [1, 0], [2]])  # the estimate is -0.35
    assert below.item() == 0.0 and metrics["kl"] == 0.0


def test_kto_mismatched_completions_take_no_gradient_and_z0_none():
    units = make_units(kto=True)
    objective = Preference(PreferenceConfig(loss="kto"))
    batch = collate_toy(units, [0, 1, 2, 3], -torch.linspace(2.0, 9.0, 8, dtype=torch.float64))
    batch.kl_estimate = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    policy = oracle_sums(units).requires_grad_()
    out = objective.loss(AnswerLogps(policy, torch.ones(8, dtype=torch.long)), batch, torch.full((4,), 0.25))
    out.loss.backward()
    assert torch.equal(policy.grad[1::2], torch.zeros(4, dtype=torch.float64))
    assert (policy.grad[0::2] != 0).all()
    assert batch.kl_estimate.grad is None
    assert out.sums["n_tokens"].item() == 4  # the completions' scored tokens only


def test_kto_refuses_a_batch_without_its_z0():
    units = make_units(kto=True)
    batch = collate_toy(units, [0, 1], torch.zeros(8, dtype=torch.float64))
    scorer = ToyScorer(explicit_logits=True)
    with pytest.raises(ValueError, match="prepare_step"):
        Preference(PreferenceConfig(loss="kto")).forward(scorer, batch, torch.ones(2))


def test_kto_summarize_reports_z0_and_each_kind():
    objective = Preference(PreferenceConfig(loss="kto"))
    metrics = objective.summarize({"loss": 0.4, "n_pairs": 4, "n_tokens": 30, "kl": 0.8, "n_desirable": 3,
                                   "n_undesirable": 1, "desirable_reward": 0.75, "undesirable_reward": -0.5,
                                   "desirable_logp": -6.0, "undesirable_logp": -3.0})
    assert metrics == {"loss": 0.4, "kl": 0.2, "reward_desirable": 0.25, "reward_undesirable": -0.5,
                       "logp_desirable": -2.0, "logp_undesirable": -3.0}
    assert set(objective.held_out) <= set(metrics)
