"""Preference objectives: DPO, IPO, SimPO, ORPO and KTO, from per-answer sums of log p, without logits.

The data (`ligertune.data.preference`) lays a pair out as prompt + chosen + rejected and scores each
answer's tokens as (row, target, answer) triples. From the final hidden states h [N, H] of a packed
batch and the output projection W [V, H], `answer_logps` gives every answer's

    logp_sum[a] = sum over the scored tokens t of answer a of log p(target_t | h[row_t])
    n_tokens[a] = the number of those tokens

through the fused linear cross-entropy (reduction "none", no smoothing, no z-loss): the scored rows
are gathered (a row scored twice, the prompt's last row that predicts both answers' first tokens, is
gathered twice), their -log p computed without the [tokens, vocab] logits, and added into answers.

The losses take the policy's sums and the reference model's (precomputed, fixed) sums of the same
answers. With pc, pr the policy's and rc, rr the reference's sums for the chosen and rejected answer
of a pair, |c|, |r| their scored tokens, beta > 0:

    DPO    (Rafailov et al. 2023, eq. 7)   m = beta ((pc - rc) - (pr - rr))
           l = -(1 - eps) log sigmoid(m) - eps log sigmoid(-m)      (eps: conservative label smoothing)
    IPO    (Azar et al. 2023, eq. 17)      h = (pc - rc)/|c| - (pr - rr)/|r|   (token means)
           l = (h - 1/(2 beta))^2
    SimPO  (Meng et al. 2024, eq. 6)       l = -log sigmoid(beta (pc/|c| - pr/|r|) - gamma)
    ORPO   (Hong et al. 2024, eq. 6-7)     l = -pc/|c| + lambda (-log sigmoid(odds(c) - odds(r))),
           odds(y) = log p̄ - log(1 - p̄), p̄ = exp(mean token log p of y)
    KTO    (Ethayarajh et al. 2024, eq. 8) per example, r = p - ref, z0 = max(KL estimate, 0), fixed:
           desirable   w_d (1 - sigmoid(beta (r - z0)))
           undesirable w_u (1 - sigmoid(beta (z0 - r)))
           KL estimate: the mean of p - ref over the step's mismatched completions (each example's
           prompt with another example's completion, its unit's second answer), computed without
           gradient before the first backward (`Preference.prepare_step`) over the units with their
           mismatched completions alone; the training forward then runs the units with their own
           completions alone (`PreferenceBatch.kto_parts`)

The step loss is the mean over the step's pairs (KTO: examples), every micro-batch and rank counted
before the first backward (`step_pair_weights`), so it is one number whatever the batching, exactly
as SFT's token mean (docs/loss.md, "Preference losses").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from ligertune import kernels
from ligertune.devices import device_count
from ligertune.kernels import LossOptions
from ligertune.kernels.types import loss_head_output
from ligertune.objectives.base import MicroBatchLoss
from ligertune.objectives.normalization import _global_sum

PreferenceLossType = Literal["dpo", "ipo", "simpo", "orpo", "kto"]
PREFERENCE_LOSSES: tuple[str, ...] = ("dpo", "ipo", "simpo", "orpo", "kto")
REFERENCE_FREE: tuple[str, ...] = ("simpo", "orpo")
"""The losses that read no reference model."""


# --------------------------------------------------------------------------------------------------
# Per-answer log-probabilities


@loss_head_output
@dataclass
class AnswerLogps:
    """Per-answer sums of token log-probabilities.

    logp_sum: [A] float32, sum of log p(target | row) over each answer's scored tokens (differentiable).
    n_tokens: [A] int64, the scored tokens of each answer.
    """

    logp_sum: torch.Tensor
    n_tokens: torch.Tensor


def answer_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    score_rows: torch.Tensor,
    score_targets: torch.Tensor,
    score_answers: torch.Tensor,
    num_answers: int,
    *,
    bias: torch.Tensor | None = None,
    options: LossOptions | None = None,
) -> AnswerLogps:
    """Every answer's sum of log p(target | row) over its scored (row, target, answer) triples.

    `hidden` [N, H] are the final hidden states of a packed batch (after the final norm), `weight`
    [V, H] (and `bias` [V]) the output projection; `score_rows`, `score_targets`, `score_answers`
    [S] the batch's scored triples, answers numbered 0 .. num_answers - 1. The head's `options` give
    the logit `softcap` (the model's own, `models.head.final_logit_softcap`) and `chunk_bytes`; their
    label smoothing, z-loss and reduction do not apply (these are the model's plain log-probabilities).

    The [S, V] logits are never stored: `fused_linear_cross_entropy` on `hidden[score_rows]` with
    reduction "none" gives -log p per triple, added into answers with `index_add`. Differentiable
    w.r.t. hidden, weight and bias. An answer without scored tokens gets 0 and n_tokens 0.
    """
    base = options if options is not None else LossOptions()
    options = dataclasses.replace(base, reduction="none", label_smoothing=0.0, z_loss_weight=0.0)
    if not (score_rows.shape == score_targets.shape == score_answers.shape) or score_rows.dim() != 1:
        raise ValueError(
            f"score_rows, score_targets and score_answers must be [S] alike; got {tuple(score_rows.shape)}, "
            f"{tuple(score_targets.shape)}, {tuple(score_answers.shape)}"
        )
    if score_answers.device.type == "cpu" and score_answers.numel() and int(score_answers.max()) >= num_answers:
        raise ValueError(f"score_answers names answer {int(score_answers.max())}; the batch has {num_answers}")
    device = hidden.device
    rows, targets, answers = (t.to(device=device, dtype=torch.long)
                              for t in (score_rows, score_targets, score_answers))
    # Counted with index_add, not bincount: bincount's output size waits on the device.
    n_tokens = torch.zeros(num_answers, dtype=torch.long, device=device).index_add_(0, answers, torch.ones_like(answers))
    logp_sum = torch.zeros(num_answers, dtype=torch.float32, device=device)
    if rows.numel() == 0:
        # Still a function of the inputs, so that every rank's backward reaches the same parameters.
        anchor = hidden.sum() * 0.0 + weight.sum() * 0.0
        return AnswerLogps(logp_sum + anchor.float(), n_tokens)
    out = kernels.fused_linear_cross_entropy(
        hidden.index_select(0, rows), weight, targets, bias=bias, options=options
    )
    logp_sum = logp_sum.index_add(0, answers, -out.loss.float())
    return AnswerLogps(logp_sum, n_tokens)


# --------------------------------------------------------------------------------------------------
# The losses, from per-answer sums


@dataclass
class PreferenceLosses:
    """Per-pair (KTO: per-example) losses and the rewards reported beside them.

    losses:           [P] differentiable; the step loss is their mean over the step's pairs.
    chosen_rewards:   [P] detached, the implicit reward of the chosen answer (KTO: of each example,
                      desirable or not).
    rejected_rewards: [P] detached, of the rejected answer (KTO: None).
    """

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor | None = None

    @property
    def margins(self) -> torch.Tensor:
        """chosen_rewards - rejected_rewards, per pair."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        """1.0 where the chosen answer's reward exceeds the rejected one's, else 0.0."""
        return (self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype)


def _math(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The inputs in float32 at least (float64 stays float64, for oracles)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype) if t.is_floating_point() else dtype
    return [None if t is None else t.to(dtype) for t in tensors]


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceLosses:
    """DPO, the sigmoid loss of Rafailov et al. 2023 (eq. 7), with conservative label smoothing eps
    (Mitchell 2023, "cDPO"; TRL's `label_smoothing`), on per-answer *summed* log-probabilities:

        m = beta * ((pc - rc) - (pr - rr))
        l = -(1 - eps) log sigmoid(m) - eps log sigmoid(-m)

    Rewards: beta (pc - rc) and beta (pr - rr). At m = 0 the loss is log 2.
    """
    pc, pr, rc, rr = _math(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    chosen, rejected = pc - rc.detach(), pr - rr.detach()
    m = beta * (chosen - rejected)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(m) - label_smoothing * F.logsigmoid(-m)
    return PreferenceLosses(losses, (beta * chosen).detach(), (beta * rejected).detach())


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLosses:
    """IPO (Azar et al. 2023, eq. 17, the sampled loss; beta is the paper's tau), on per-answer
    *token-mean* log-probabilities, as TRL computes it (the paper leaves the length open; the mean
    keeps the target 1/(2 beta) independent of the answers' lengths):

        h = (pc - rc)/|c| - (pr - rr)/|r|
        l = (h - 1/(2 beta))^2

    Rewards: beta (pc - rc)/|c| and beta (pr - rr)/|r|, on the same token means.
    """
    pc, pr, rc, rr, nc, nr = _math(policy_chosen, policy_rejected, reference_chosen, reference_rejected,
                                   chosen_tokens, rejected_tokens)
    chosen = (pc - rc.detach()) / nc.clamp(min=1)
    rejected = (pr - rr.detach()) / nr.clamp(min=1)
    losses = (chosen - rejected - 1.0 / (2.0 * beta)) ** 2
    return PreferenceLosses(losses, (beta * chosen).detach(), (beta * rejected).detach())


def simpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> PreferenceLosses:
    """SimPO (Meng et al. 2024, eq. 6): reference-free, on token-mean log-probabilities, with the
    target reward margin gamma:

        l = -log sigmoid(beta (pc/|c| - pr/|r|) - gamma)

    Rewards: beta pc/|c| and beta pr/|r| (the paper's implicit reward).
    """
    pc, pr, nc, nr = _math(policy_chosen, policy_rejected, chosen_tokens, rejected_tokens)
    chosen = beta * pc / nc.clamp(min=1)
    rejected = beta * pr / nr.clamp(min=1)
    losses = -F.logsigmoid(chosen - rejected - gamma)
    return PreferenceLosses(losses, chosen.detach(), rejected.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate everywhere (Maechler 2012): log(-expm1(x)) near 0,
    log1p(-exp(x)) below -log 2. -inf at x = 0."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    lam: float = 0.1,
) -> PreferenceLosses:
    """ORPO (Hong et al. 2024, eq. 6-7): the chosen answer's NLL plus lambda times the odds-ratio loss,
    reference-free, on token-mean log-probabilities a = pc/|c|, b = pr/|r|:

        odds(y) = log p̄ - log(1 - p̄) = a - log1mexp(a),  p̄ = exp(a)
        l = -a + lambda * -log sigmoid(odds(c) - odds(r))

    L_SFT is each chosen answer's token mean NLL, so that the step's mean over pairs is the paper's
    expectation over pairs (each pair weighs the same, however long its chosen answer). Rewards:
    lambda * a and lambda * b (TRL's). log1mexp keeps log(1 - p̄) finite and accurate as p̄ -> 1.
    """
    pc, pr, nc, nr = _math(policy_chosen, policy_rejected, chosen_tokens, rejected_tokens)
    a = pc / nc.clamp(min=1)
    b = pr / nr.clamp(min=1)
    # A token mean of log-probabilities is <= 0; float rounding may not know it.
    a, b = a.clamp(max=0.0), b.clamp(max=0.0)
    log_odds = (a - log1mexp(a)) - (b - log1mexp(b))
    losses = -a - lam * F.logsigmoid(log_odds)
    return PreferenceLosses(losses, (lam * a).detach(), (lam * b).detach())


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl_estimate: torch.Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLosses:
    """KTO (Ethayarajh et al. 2024, eq. 8), per example, on summed log-probabilities (as TRL):

        r  = p - ref                        the example's log-ratio
        z0 = max(kl_estimate, 0)            the reference point, held fixed (no gradient)
        desirable:    w_d (1 - sigmoid(beta (r - z0)))
        undesirable:  w_u (1 - sigmoid(beta (z0 - r)))

    `kl_estimate` is the step's estimate of KL(policy || reference), from mismatched prompt/completion
    pairs (`Preference.kl_estimate`). Reward: beta r for every example, desirable or not
    (`chosen_rewards`); `rejected_rewards` is None.
    """
    p, ref = _math(policy, reference)
    z0 = torch.as_tensor(kl_estimate, dtype=p.dtype, device=p.device).detach().clamp(min=0.0)
    r = p - ref.detach()
    desirable = desirable.to(device=p.device, dtype=torch.bool)
    losses = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r))),
    )
    return PreferenceLosses(losses, (beta * r).detach())


# --------------------------------------------------------------------------------------------------
# Step normalisation


def step_pair_weights(counts: Sequence[int | torch.Tensor], *, across_ranks: bool = True,
                      device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Each micro-batch's per-pair weights 1/|P| (float32 [counts[i]]), |P| the step's pairs.

    `counts[i]` is micro-batch i's number of pairs (KTO: examples). |P| is their sum over the step's
    micro-batches and, when torch.distributed is initialized (and `across_ranks`), over the ranks:
    counted before the first backward, as SFT's |T| (`normalization.step_token_weights`), so that
    sum_i sum_p w_p l_p is the mean over the step's pairs however the step was cut.
    """
    sizes = [int(c) for c in counts]
    if device is None:
        device = next((c.device for c in counts if isinstance(c, torch.Tensor)), torch.device("cpu"))
    total = device_count(sum(sizes), device)
    if across_ranks:
        total = _global_sum(total)
    scale = 1.0 / total.clamp(min=1).float()
    return [scale.expand(n).clone() for n in sizes]


# --------------------------------------------------------------------------------------------------
# The objective


@dataclass
class PreferenceConfig:
    """What the preference objective needs to know (the recipe's `objective:` section maps onto it)."""

    loss: PreferenceLossType = "dpo"
    """Which loss: dpo, ipo, simpo, orpo (pairs) or kto (single answers with a verdict)."""
    beta: float = 0.1
    """DPO/IPO/KTO: the strength beta of the KL regularisation (IPO's tau); SimPO: the reward scale
    beta (the paper uses 2 to 2.5)."""
    label_smoothing: float = 0.0
    """DPO: the probability eps in [0, 0.5) that a pair's labels are flipped (conservative DPO)."""
    gamma: float = 1.0
    """SimPO: the target reward margin gamma."""
    orpo_lambda: float = 0.1
    """ORPO: the weight lambda of the odds-ratio term."""
    desirable_weight: float = 1.0
    """KTO: w_d, the weight of desirable examples."""
    undesirable_weight: float = 1.0
    """KTO: w_u, the weight of undesirable examples."""

    def __post_init__(self) -> None:
        if self.loss not in PREFERENCE_LOSSES:
            raise ValueError(f"loss must be one of {PREFERENCE_LOSSES}; got {self.loss!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0; got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5); got {self.label_smoothing}")


class PreferenceBatch(Protocol):
    """The fields of a collated micro-batch of preference packs that the objective reads.

    input_ids, position_ids: [1, L] the packs laid end to end (positions of both answers continue
        from their prompt).
    attention: the decoder's keyword arguments that keep units and answers apart (varlen query and
        key ranges, or a [L, L] block mask on the CPU), or a method that returns them
        (`data.PreferenceBatch.attention()`); handed to the engine unread.
    score_rows, score_targets, score_answers: [S] int64, the scored (row, target, answer) triples,
        rows into the flattened L tokens, answers numbered 0 .. A-1 through the micro-batch.
    answer_pair: [A] int64, the pair (KTO: example) each answer belongs to, 0 .. P-1 in the micro-batch.
    answer_chosen: [A] bool, the chosen answer of its pair (KTO: a desirable completion).
    answer_mismatched: [A] bool, KTO: a mismatched completion (another example's, after this
        example's prompt), scored for the KL estimate and never trained; False for pairs.
    reference_logps: [A] float32, the reference model's sums of log p over the same scored tokens
        (None for SimPO and ORPO).
    kl_estimate: KTO: the step's z0, a scalar, set by `Preference.prepare_step` (None before).
    answer_lens: [U] on the host, a tuple of answer lengths per unit (empty: a unit without answers).
    kto_parts(): KTO: (the batch with the completions only, the batch with the mismatched
        completions only), each unit keeping its prompt (`data.PreferenceBatch.kto_parts`).

    The batch is a dataclass: `prepare_step` hands back copies that carry `kl_estimate`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: Mapping[str, Any]
    score_rows: torch.Tensor
    score_targets: torch.Tensor
    score_answers: torch.Tensor
    answer_pair: torch.Tensor
    answer_chosen: torch.Tensor
    answer_mismatched: torch.Tensor
    reference_logps: torch.Tensor | None
    kl_estimate: torch.Tensor | None
    answer_lens: list[tuple[int, ...]]

    def kto_parts(self) -> tuple[PreferenceBatch, PreferenceBatch | None]: ...


class AnswerScorer(Protocol):
    """The engine a preference step runs: the decoder, then `answer_logps` on its hidden states with
    the output projection, inside the module's forward (where a sharded projection is gathered)."""

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, score_rows: torch.Tensor,
                 score_targets: torch.Tensor, score_answers: torch.Tensor, num_answers: int,
                 **attention: Any) -> AnswerLogps: ...


def score(engine: AnswerScorer, batch: PreferenceBatch) -> AnswerLogps:
    """The engine's sums of log p of every answer of `batch`."""
    attention = batch.attention() if callable(batch.attention) else batch.attention
    # Keywords: `CausalLMLoss.forward` scores answers when given `score_rows`, in its own forward.
    return engine(batch.input_ids, batch.position_ids, score_rows=batch.score_rows,
                  score_targets=batch.score_targets, score_answers=batch.score_answers,
                  num_answers=int(batch.answer_pair.numel()), **attention)


def num_pairs(batch: PreferenceBatch) -> int:
    """The pairs (KTO: examples) of a micro-batch: one past the last unit with answers (`answer_pair`
    numbers the units through the batch; a rank's stand-in pack has one unit and no answer), counted
    on the host."""
    return max((u + 1 for u, lens in enumerate(batch.answer_lens) if lens), default=0)


class Preference:
    """A preference objective (DPO, IPO, SimPO, ORPO or KTO) over packed preference units.

    The step loss is the mean of the per-pair (KTO: per-example) losses over every pair of the step,
    all micro-batches and ranks (`step_pair_weights`). Reported, per pair and averaged over the step:
    the chosen and rejected rewards, their margin and how often the chosen one is higher, and the
    policy's token-mean log p of each side. KTO reports its reference point z0 (`kl`), the mean
    reward of desirable and of undesirable examples and the policy's token-mean log p of each kind.
    """

    name = "preference"
    trained_tokens = "n_tokens"

    def __init__(self, cfg: PreferenceConfig):
        self.cfg = cfg
        self.kto = cfg.loss == "kto"
        self.units = ("n_pairs", "examples" if self.kto else "pairs")  # `examples_per_s`, `pairs_per_s`
        self.reference: Callable[[PreferenceBatch], torch.Tensor] | None = None
        """Scores a batch's answers with the reference model when its packs carry no precomputed
        sums (`objective.reference: live`, `ligertune.objectives.reference.LiveReference`)."""
        if self.kto:
            self.sums = ("loss", "n_pairs", "n_tokens", "kl", "n_desirable", "n_undesirable",
                         "desirable_reward", "undesirable_reward", "desirable_logp", "undesirable_logp")
            self.held_out = ("loss", "kl", "reward_desirable", "reward_undesirable", "logp_desirable",
                             "logp_undesirable")
        else:
            self.sums = ("loss", "n_pairs", "n_tokens", "chosen_reward", "rejected_reward", "accuracy",
                         "chosen_logp", "rejected_logp")
            self.held_out = ("loss", "reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected",
                             "logp_chosen", "logp_rejected")

    def prepare_step(self, engine: AnswerScorer, batches: Sequence[PreferenceBatch]) -> list[PreferenceBatch]:
        """KTO: the step's completions (`PreferenceBatch.kto_parts`), carrying its reference point z0
        (`kl_estimate`), which the mismatched completions give; the paired losses need nothing of the
        whole step but their weights: the batches as they are."""
        if not self.kto or not batches:
            return list(batches)
        for batch in batches:  # a live reference scores each micro-batch whole, its parts carry the values
            self.attach_reference(batch)
        completions, mismatched = zip(*(batch.kto_parts() for batch in batches))
        z0 = self.kl_estimate(engine, mismatched, device=batches[0].answer_pair.device)
        return [dataclasses.replace(batch, kl_estimate=z0) for batch in completions]

    @torch.no_grad()
    def kl_estimate(self, engine: AnswerScorer, batches: Sequence[PreferenceBatch], device: torch.device
                    ) -> torch.Tensor:
        """KTO's reference point z0 = max(0, mean over the step's mismatched completions of p - ref),
        a float64 scalar on `device`, from `batches` of mismatched completions (`kto_parts`).

        One forward per micro-batch without gradient (the policy as the step's forwards will see
        it); the sum and the count of the mismatched completions are added over the micro-batches
        and all-reduced over the ranks before the mean is taken, so z0 is one number whatever the
        batching. 0 when the step has no mismatched completion.
        """
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in batches:
            self.attach_reference(batch)
            if batch.reference_logps is None:
                raise ValueError("kto needs the reference model's log-probabilities (reference_logps) "
                                 "before the step, for its KL estimate")
            log_ratio = score(engine, batch).logp_sum.double() - batch.reference_logps.to(device).double()
            mismatched = batch.answer_mismatched.to(device, torch.bool)
            totals += torch.stack([torch.where(mismatched, log_ratio, 0.0).sum(), mismatched.sum().double()])
        total, count = _global_sum(totals).unbind()
        return (total / count.clamp(min=1)).clamp(min=0.0)

    def step_weights(self, batches: Sequence[PreferenceBatch]) -> list[torch.Tensor]:
        """Each micro-batch's per-pair (KTO: per-example) weights, 1/|P| over the whole step."""
        device = batches[0].answer_pair.device if batches else None
        return step_pair_weights([num_pairs(b) for b in batches], device=device)

    def forward(self, engine: AnswerScorer, batch: PreferenceBatch, weights: torch.Tensor) -> MicroBatchLoss:
        self.attach_reference(batch)
        return self.loss(score(engine, batch), batch, weights)

    def attach_reference(self, batch: PreferenceBatch) -> None:
        """The reference's sums on the batch, scored now when its packs carry none (`reference`)."""
        if batch.reference_logps is None and self.reference is not None:
            batch.reference_logps = self.reference(batch)

    def loss(self, logps: AnswerLogps, batch: PreferenceBatch, weights: torch.Tensor) -> MicroBatchLoss:
        """The micro-batch's weighted loss sum_p w_p l_p and its sums, from the policy's `logps`."""
        cfg = self.cfg
        policy, n_tok = logps.logp_sum, logps.n_tokens
        reference = batch.reference_logps
        if reference is None and cfg.loss not in REFERENCE_FREE:
            raise ValueError(f"{cfg.loss} needs the reference model's log-probabilities (reference_logps)")
        reference = None if reference is None else reference.to(policy.device)
        mean_logp = policy.detach() / n_tok.clamp(min=1)
        n_pairs = torch.full((), float(weights.numel()), device=policy.device)
        sums = {"n_tokens": n_tok.sum(), "n_pairs": n_pairs}
        if self.kto:
            if batch.kl_estimate is None:
                raise ValueError("kto needs the step's KL estimate z0 on the batch (Preference.prepare_step)")
            z0 = batch.kl_estimate.to(policy.device).clamp(min=0.0)
            # Each example is its completion; its mismatched completion is not trained (no loss, no gradient).
            completion = ~batch.answer_mismatched.to(policy.device, torch.bool)
            desirable = batch.answer_chosen.to(policy.device, torch.bool) & completion
            undesirable = completion & ~desirable
            out = kto_loss(policy, reference, desirable, z0, beta=cfg.beta,
                           desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight)
            losses = torch.where(completion, out.losses, 0.0)
            weights = weights.to(policy.device)[batch.answer_pair.to(policy.device)]  # an example's answers
            sums |= {
                "n_tokens": (n_tok * completion).sum(), "kl": z0 * n_pairs,
                "n_desirable": desirable.sum().float(), "n_undesirable": undesirable.sum().float(),
                "desirable_reward": (out.chosen_rewards * desirable).sum().float(),
                "undesirable_reward": (out.chosen_rewards * undesirable).sum().float(),
                "desirable_logp": (mean_logp * desirable).sum(),
                "undesirable_logp": (mean_logp * undesirable).sum(),
            }
        else:
            chosen, rejected = pair_answers(batch.answer_pair, batch.answer_chosen, weights.numel())
            pc, pr, nc, nr = policy[chosen], policy[rejected], n_tok[chosen], n_tok[rejected]
            if cfg.loss == "dpo":
                out = dpo_loss(pc, pr, reference[chosen], reference[rejected], beta=cfg.beta,
                               label_smoothing=cfg.label_smoothing)
            elif cfg.loss == "ipo":
                out = ipo_loss(pc, pr, reference[chosen], reference[rejected], nc, nr, beta=cfg.beta)
            elif cfg.loss == "simpo":
                out = simpo_loss(pc, pr, nc, nr, beta=cfg.beta, gamma=cfg.gamma)
            else:
                out = orpo_loss(pc, pr, nc, nr, lam=cfg.orpo_lambda)
            losses = out.losses
            sums |= {
                "chosen_reward": out.chosen_rewards.sum().float(),
                "rejected_reward": out.rejected_rewards.sum().float(),
                "accuracy": out.accuracies.sum().float(),
                "chosen_logp": mean_logp[chosen].sum(), "rejected_logp": mean_logp[rejected].sum(),
            }
        loss = (losses * weights.to(losses.device, losses.dtype)).sum()
        sums["loss"] = loss.detach().float()
        return MicroBatchLoss(loss, {k: sums[k].float() for k in self.sums})

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's loss (already the mean over its pairs) and the per-pair means of the rest.

        KTO: `loss`; `kl`, the step's reference point z0; `reward_desirable` and
        `reward_undesirable`, the mean reward beta (p - ref) of the desirable and of the undesirable
        examples; `logp_desirable`, `logp_undesirable`, the policy's token-mean log p of each kind."""
        if self.kto:
            n, n_d, n_u = (max(sums[k], 1) for k in ("n_pairs", "n_desirable", "n_undesirable"))
            return {"loss": sums["loss"], "kl": sums["kl"] / n,
                    "reward_desirable": sums["desirable_reward"] / n_d,
                    "reward_undesirable": sums["undesirable_reward"] / n_u,
                    "logp_desirable": sums["desirable_logp"] / n_d,
                    "logp_undesirable": sums["undesirable_logp"] / n_u}
        n = max(sums["n_pairs"], 1)
        chosen, rejected = sums["chosen_reward"] / n, sums["rejected_reward"] / n
        return {"loss": sums["loss"], "reward_chosen": chosen, "reward_rejected": rejected,
                "reward_margin": chosen - rejected, "reward_accuracy": sums["accuracy"] / n,
                "logp_chosen": sums["chosen_logp"] / n, "logp_rejected": sums["rejected_logp"] / n}


def pair_answers(answer_pair: torch.Tensor, answer_chosen: torch.Tensor, n_pairs: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and the rejected answer of each pair 0 .. n_pairs-1, as [P] answer indices (-1 where
    a pair has none). Each pair's largest index among its answers of that side: no boolean selection,
    whose size the host would wait on the device to learn."""
    answers = torch.arange(answer_pair.numel(), device=answer_pair.device)
    is_chosen = answer_chosen.to(torch.bool)
    none = torch.full((n_pairs,), -1, dtype=torch.long, device=answer_pair.device)
    chosen = none.scatter_reduce(0, answer_pair, torch.where(is_chosen, answers, -1), reduce="amax")
    rejected = none.scatter_reduce(0, answer_pair, torch.where(is_chosen, -1, answers), reduce="amax")
    return chosen, rejected
