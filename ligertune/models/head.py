"""The loss head: decoder hidden states -> output projection -> cross-entropy, for any causal LM.

There is one head for every family. It runs the model's decoder stack (which ends with the final
norm) to get the last hidden states, then either hands them with the output projection's weight to
`ligertune.kernels.fused_linear_cross_entropy` (the [tokens, vocab] logits are never stored), or,
unfused, runs the model's own output layer and `causal_lm_loss_from_logits`, the same per-token
formula in plain torch. Both take the head's one `LossOptions` as it is and give the same `LossOutput`.

The projection is used inside `CausalLMLoss.forward`, so a sharded model (FSDP2) has its weight
gathered there, by the hooks of the module that owns it.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ligertune import kernels
from ligertune.kernels import DivergenceOptions, DivergenceOutput, LossOptions, LossOutput
from ligertune.kernels.reference import cross_entropy_rows
from ligertune.kernels.types import loss_head_output
from ligertune.models.attention import (
    PACKED_ATTENTION,
    conversations_mask,
    packed_attention_kwargs,
    preference_attention_kwargs,
)
from ligertune.models.unwrap import decoder_of, output_head_of, plain_projection, unwrap_model

if TYPE_CHECKING:
    from ligertune.models.medusa import MedusaHeads
    from ligertune.objectives.preference import AnswerLogps


@loss_head_output
@dataclass
class MedusaLossOutput:
    """The losses of one forward with Medusa heads (`CausalLMLoss.forward` with `medusa_targets`):
    the model's own next-token loss (`lm`: no gradient over a frozen model) and each head's
    (`heads[k - 1]`: head k's targets, k places after the model's own), each a `LossOutput` under the
    head's loss options and the weights given."""

    lm: LossOutput
    heads: list[LossOutput]


def causal_lm_loss_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    options: LossOptions = LossOptions(),
) -> LossOutput:
    """The loss of `fused_linear_cross_entropy`, from materialized logits [N, V] and targets [N].

    For every supervised row t (targets[t] != options.ignore_index), with z the row's logits (capped
    to c tanh(z / c) when `options.softcap` = c) and lse = logsumexp(z), in float32:

        l_t = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + zw lse^2

    (eps = `options.label_smoothing`, zw = `options.z_loss_weight`), which is
    `torch.nn.functional.cross_entropy` with `label_smoothing=eps`, plus the z-loss. Then,
    with w_t = token_weights[t] (default 1), `options.reduction`: "sum" gives sum_t w_t l_t, "mean"
    that sum over the number of supervised rows, "none" w_t l_t per row (0 at ignored rows). `z_loss`
    is the zw lse^2 part under the same weights and reduction (not differentiable), `n_correct` the
    supervised rows whose argmax equals the target, `n_tokens` the supervised rows. The per-row
    formula is the fused loss's own, `ligertune.kernels.reference.cross_entropy_rows`, here under
    autograd (the logits may come from any output layer, such as a LoRA-adapted one).
    `options.chunk_bytes` has no use here: the logits are already whole.
    """
    supervised = targets != options.ignore_index
    y = torch.where(supervised, targets, 0).long()
    loss, z_part, _, z = cross_entropy_rows(logits.float(), y, options)
    weights = supervised.float()
    if token_weights is not None:
        weights = torch.where(supervised, token_weights.float(), 0.0)
    loss, z_part = loss * weights, (z_part * weights).detach()
    n_tokens = supervised.sum()
    n_correct = (supervised & (z.argmax(dim=-1) == y)).sum()
    if options.reduction != "none":
        scale = 1.0 / n_tokens.clamp(min=1) if options.reduction == "mean" else 1.0
        loss, z_part = loss.sum() * scale, z_part.sum() * scale
    return LossOutput(loss=loss, z_loss=z_part, n_correct=n_correct, n_tokens=n_tokens)


def divergence_from_logits(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
    options: DivergenceOptions = DivergenceOptions(),
) -> DivergenceOutput:
    """The loss of `fused_linear_divergence`, from materialized logits [N, V] of the student and the
    teacher (the teacher's taken as constants), under autograd: for any output layer (a LoRA-adapted
    `lm_head`). Every row t with targets[t] != ignore_index counts; with P = softmax(z_teacher / tau),
    Q = softmax(z / tau), in float32:

        forward_kl: D_t = KL(P || Q)      reverse_kl: D_t = KL(Q || P)
        jsd:        D_t = beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q

    and the loss sum_t w_t ((1 - alpha) D_t + alpha CE_t), CE_t the student's cross-entropy at
    temperature 1 (divided by the number of rows for reduction "mean").
    """
    supervised = targets != options.ignore_index
    rows = supervised.nonzero().squeeze(1)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = _capped(logits.index_select(0, rows).to(dtype), options.softcap)
    z_teacher = _capped(teacher_logits.detach().index_select(0, rows).to(dtype), options.teacher_softcap)
    y = targets.index_select(0, rows).long()
    tau = options.temperature
    log_q = torch.log_softmax(z / tau, dim=-1)
    log_p = torch.log_softmax(z_teacher / tau, dim=-1)
    if options.divergence == "forward_kl":
        div = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif options.divergence == "reverse_kl":
        div = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        beta = options.beta
        log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        div = (beta * (log_p.exp() * (log_p - log_m)).sum(-1)
               + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1))
    ce = nn.functional.cross_entropy(z, y, reduction="none")
    teacher_ce = nn.functional.cross_entropy(z_teacher, y, reduction="none")
    weights = torch.ones_like(ce) if token_weights is None else token_weights.index_select(0, rows).to(dtype)
    n_tokens = supervised.sum()
    scale = 1.0 / n_tokens.clamp(min=1) if options.reduction == "mean" else 1.0
    alpha = options.ce_weight
    return DivergenceOutput(
        loss=(weights * ((1 - alpha) * div + alpha * ce)).sum() * scale,
        divergence=(weights * div).detach().sum() * scale,
        ce=(weights * ce).detach().sum() * scale,
        teacher_ce=(weights * teacher_ce).sum() * scale,
        n_correct=(z.argmax(-1) == y).sum(),
        teacher_correct=(z_teacher.argmax(-1) == y).sum(),
        n_tokens=n_tokens,
    )


def _capped(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def final_logit_softcap(model: nn.Module) -> float | None:
    """The cap c that the model puts on its logits, c tanh(z / c) (Gemma 2's `final_logit_softcapping`),
    or None: the loss options of its head must carry the same."""
    return getattr(unwrap_model(model).config, "final_logit_softcapping", None)


class CausalLMLoss(nn.Module):
    """A causal LM (plain or peft-wrapped) with its loss as the forward: ids in, `LossOutput` out.

    `model` is kept as the submodule `self.model` (use it for `generate()` and `save_pretrained()`).
    With `fused=True` the output projection and the loss run in `fused_linear_cross_entropy`; an
    output layer that is not one weight matrix (a LoRA-adapted `lm_head`) falls back to the unfused
    path, with a warning. Both paths get `options` as they are. Without `options`: the defaults with
    the "sum" reduction (the trainer's normalization is in its token weights; docs/loss.md) and the
    model's own logit softcap. `options`, when given, must carry that softcap (Gemma 2 caps its
    logits; `final_logit_softcap`): the loss is that of the model's own logits.
    """

    def __init__(self, model: nn.Module, *, fused: bool = True, options: LossOptions | None = None):
        super().__init__()
        self.model = model
        self.medusa: MedusaHeads | None = None
        """Medusa heads trained with the model (`attach_medusa`): a submodule, so that a sharded run
        gathers their weights in this module's forward, where their losses run."""
        self.frozen_backbone = False
        """Whether the decoder runs without gradient under the heads (Medusa-1)."""
        self.fused_heads = bool(fused)
        softcap = final_logit_softcap(model)
        if options is None:
            options = LossOptions(reduction="sum", softcap=softcap)
        elif options.softcap != softcap:
            raise ValueError(f"the loss options cap the logits at softcap={options.softcap}, the model at "
                             f"final_logit_softcapping={softcap}; they must agree")
        self.options = options
        self.fused = bool(fused)
        if self.fused and plain_projection(output_head_of(model)) is None:
            warnings.warn(
                f"the output layer ({type(output_head_of(model)).__name__}) is not a plain linear layer; "
                "the loss materializes the logits instead of using the fused kernel",
                stacklevel=2,
            )
            self.fused = False

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        targets: torch.Tensor | None = None,
        token_weights: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
        key_index: torch.Tensor | None = None,
        score_rows: torch.Tensor | None = None,
        score_targets: torch.Tensor | None = None,
        score_answers: torch.Tensor | None = None,
        num_answers: int | None = None,
        teacher_hidden: torch.Tensor | None = None,
        teacher_weight: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        divergence: DivergenceOptions | None = None,
        medusa_targets: torch.Tensor | None = None,
        medusa_weights: torch.Tensor | None = None,
    ) -> LossOutput | AnswerLogps | DivergenceOutput | MedusaLossOutput:
        """Loss of `targets` [B, L] (already shifted: targets[t] is the token after input_ids[t];
        `options.ignore_index` where there is no loss) given `input_ids` [B, L].

        `cu_seqlens` (cumulative conversation lengths over the flattened B * L tokens) and
        `max_seqlen` keep the conversations of a pack apart under packed attention; `attention_mask`
        is the padding mask of an unpacked, padded batch. `token_weights` [B, L] as in
        `fused_linear_cross_entropy`, reduced by `options.reduction`.

        With `score_rows` (and `score_targets`, `score_answers`, `num_answers`) instead of `targets`,
        the forward scores answers (`answer_logps`, preference training): each answer's sum of log p
        over its scored (row, target, answer) triples, as `AnswerLogps`; `cu_seqlens_k`,
        `max_seqlen_k` and `key_index` as in `hidden_states`. It runs here, in the module's forward,
        so that a sharded output projection is gathered by the hooks of FSDP2 as for the SFT loss.

        With `teacher_hidden` (a teacher's last hidden states of the same tokens, [B * L, Ht]),
        `teacher_weight`, `teacher_bias` (its output layer) and `divergence` (the options), the loss
        is distillation's (`divergence`: a `DivergenceOutput`) instead of the cross-entropy.

        With `medusa_targets` [K, B, L] (head k's targets in row k - 1: `objectives.medusa.head_targets`)
        and `medusa_weights` (their token weights, same shape), the model's own loss and each Medusa
        head's (`attach_medusa`), as `MedusaLossOutput`; over a frozen model the decoder and its own
        loss run without gradient.
        """
        if score_rows is not None:
            if targets is not None or token_weights is not None:
                raise ValueError("score answers (score_rows ...) or a loss of targets, not both")
            return self.answer_logps(input_ids, position_ids, score_rows, score_targets, score_answers,
                                     num_answers, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                                     key_index=key_index, attention_mask=attention_mask)
        if targets is None:
            raise ValueError("the loss needs targets (or score_rows to score answers)")
        if key_index is not None or cu_seqlens_k is not None:
            raise ValueError("separate key ranges (key_index, cu_seqlens_k) are for scoring answers")
        if medusa_targets is not None:
            if self.medusa is None:
                raise ValueError("medusa_targets need Medusa heads: attach_medusa() first")
            frozen = torch.no_grad() if self.frozen_backbone else contextlib.nullcontext()
            with frozen:
                hidden = self.hidden_states(input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                            attention_mask=attention_mask)
                lm = self.next_token_loss(hidden, targets.reshape(-1), token_weights)
            return MedusaLossOutput(lm=lm, heads=self.medusa_losses(hidden, medusa_targets, medusa_weights))
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                    attention_mask=attention_mask)
        targets = targets.reshape(-1)
        if teacher_hidden is not None:
            if token_weights is not None:
                token_weights = token_weights.reshape(-1)
            return self.divergence(hidden, targets, token_weights, teacher_hidden, teacher_weight, teacher_bias,
                                   divergence)
        return self.next_token_loss(hidden, targets, token_weights)

    def next_token_loss(self, hidden: torch.Tensor, targets: torch.Tensor,
                        token_weights: torch.Tensor | None) -> LossOutput:
        """The model's loss of `targets` [N] from its last hidden states `hidden` [N, H]: fused, or
        through its own output layer's logits."""
        if token_weights is not None:
            token_weights = token_weights.reshape(-1)
        head = output_head_of(self.model)
        projection = plain_projection(head) if self.fused else None
        if projection is not None:
            weight, bias = projection
            return kernels.fused_linear_cross_entropy(
                hidden, weight, targets, bias=bias, token_weights=token_weights, options=self.options
            )
        logits = head(hidden)
        return causal_lm_loss_from_logits(logits, targets, token_weights=token_weights, options=self.options)

    def attach_medusa(self, heads: MedusaHeads, *, frozen_backbone: bool) -> None:
        """Train `heads` with this loss (`objective.name: medusa`), over a frozen model when
        `frozen_backbone` (its decoder then runs without gradient and keeps no activations)."""
        self.medusa = heads
        self.frozen_backbone = bool(frozen_backbone)

    def medusa_losses(self, hidden: torch.Tensor, targets: torch.Tensor,
                      token_weights: torch.Tensor | None) -> list[LossOutput]:
        """Each Medusa head's loss of its targets (`targets[k - 1]`, [N] each once flattened) from the
        decoder's last hidden states [N, H]: the head's residual blocks, then its output layer and the
        cross-entropy fused (no [N, V] logits), with the head's loss options."""
        outputs = []
        for k, head in enumerate(self.medusa.heads):
            features = head.features(hidden)
            y = targets[k].reshape(-1)
            w = None if token_weights is None else token_weights[k].reshape(-1)
            if self.fused_heads:
                outputs.append(kernels.fused_linear_cross_entropy(features, head.proj.weight, y, token_weights=w,
                                                                  options=self.options))
            else:
                outputs.append(causal_lm_loss_from_logits(head.proj(features), y, token_weights=w,
                                                          options=self.options))
        return outputs

    def divergence(self, hidden: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor | None,
                   teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                   options: DivergenceOptions) -> DivergenceOutput:
        """Distillation's loss of the student's `hidden` [N, H] against the teacher's `teacher_hidden`
        [N, Ht] and output layer (`fused_linear_divergence`); the vocabulary is the teacher's rows
        (a student layer padded past them is cut to them). Unfused (a LoRA-adapted `lm_head`,
        `fused=False`): the logits of the supervised rows only and `divergence_from_logits`."""
        vocab = teacher_weight.shape[0]
        projection = self.output_projection() if self.fused else None
        if projection is not None:
            weight, bias = projection
            return kernels.fused_linear_divergence(
                hidden, weight[:vocab], teacher_hidden, teacher_weight, targets,
                bias=None if bias is None else bias[:vocab], teacher_bias=teacher_bias,
                token_weights=token_weights, options=options,
            )
        rows = (targets != options.ignore_index).nonzero().squeeze(1)
        teacher_logits = nn.functional.linear(teacher_hidden.index_select(0, rows), teacher_weight, teacher_bias)
        logits = self.output_layer(hidden.index_select(0, rows))[:, :vocab]
        weights = None if token_weights is None else token_weights.index_select(0, rows)
        out = divergence_from_logits(logits, teacher_logits, targets.index_select(0, rows),
                                     token_weights=weights, options=options)
        if rows.numel() == 0:  # no supervised row: a zero that still reaches every trainable weight
            out.loss = out.loss + hidden.sum().float() * 0.0
        return out

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, **attention) -> torch.Tensor:
        """The decoder's last hidden states (after the final norm) of `input_ids` [B, L]: [B * L, H],
        under the attention of `last_hidden_states`' keywords.

        For a loss that scores rows of its own choosing (preference training): it gathers the rows
        and projects them with `output_projection()`, so no [tokens, vocab] logits are formed.
        `cu_seqlens` and `max_seqlen` as in `forward`; with `key_index`, they are the query
        boundaries of segments whose key rows are `key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`
        (`preference_attention_kwargs`; `PreferenceBatch.attention()` gives all five).

        Under FSDP2 the output projection is gathered by its module's hooks only in a forward of
        that module: call it within one (as `forward` does), not on a weight read outside.
        """
        return last_hidden_states(self.model, input_ids, position_ids, **attention)

    def answer_logps(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        score_rows: torch.Tensor,
        score_targets: torch.Tensor,
        score_answers: torch.Tensor,
        num_answers: int,
        **attention,
    ) -> AnswerLogps:
        """Every answer's sum of log p over its scored triples (`objectives.preference.answer_logps`),
        from the decoder's hidden states of `input_ids` under `attention` (`hidden_states`' keywords).

        Call it through the module (`engine(ids, positions, score_rows=..., ...)`, which lands here
        from `forward`) where the model is sharded. Fused: the scored rows go through the fused
        linear cross-entropy with the head's options (softcap, chunk budget); otherwise (a LoRA-adapted
        `lm_head`, `fused=False`) the output layer's logits of the scored rows only, [S, V], and the
        same per-row formula without smoothing or z-loss.
        """
        from ligertune.objectives.preference import AnswerLogps, answer_logps

        hidden = self.hidden_states(input_ids, position_ids, **attention)
        projection = self.output_projection() if self.fused else None
        if projection is not None:
            weight, bias = projection
            return answer_logps(hidden, weight, score_rows, score_targets, score_answers, num_answers,
                                bias=bias, options=self.options)
        device = hidden.device
        rows, targets, answers = (t.to(device=device, dtype=torch.long)
                                  for t in (score_rows, score_targets, score_answers))
        n_tokens = torch.bincount(answers, minlength=num_answers)
        logits = self.output_layer(hidden.index_select(0, rows)).float()
        if self.options.softcap is not None:
            logits = self.options.softcap * torch.tanh(logits / self.options.softcap)
        logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        logp_sum = torch.zeros(num_answers, dtype=torch.float32, device=device).index_add(0, answers, logp)
        if rows.numel() == 0:
            logp_sum = logp_sum + hidden.sum().float() * 0.0
        return AnswerLogps(logp_sum, n_tokens)

    def output_projection(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The output layer as `(weight [V, H], bias [V] or None)`, or None when it is not one weight
        matrix (a LoRA-adapted `lm_head`: call `output_layer` on the rows instead)."""
        return plain_projection(output_head_of(self.model))

    @property
    def output_layer(self) -> nn.Module:
        """The model's output layer (hidden states -> logits)."""
        return output_head_of(self.model)

    def extra_repr(self) -> str:
        """The loss that runs: the fused kernel and its path on the projection's device, or the
        output layer's logits and the plain formula."""
        head = output_head_of(self.model)
        if self.fused:
            weight, _ = plain_projection(head)
            kernel = f"fused_linear_cross_entropy ({kernels.active_path(weight.device)})"
        else:
            kernel = f"causal_lm_loss_from_logits (torch, logits of the {type(head).__name__})"
        medusa = ""
        if self.medusa is not None:
            medusa = (f", medusa heads: {'fused_linear_cross_entropy' if self.fused_heads else 'logits'}"
                      f"{' over a frozen model' if self.frozen_backbone else ''}")
        return f"kernel={kernel}, options={self.options}{medusa}"


def last_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    key_index: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`model`'s decoder's last hidden states (after the final norm) of `input_ids` [B, L], as
    [B * L, H], under the attention that the keywords give (`CausalLMLoss.hidden_states`)."""
    decoder = decoder_of(model)
    extra = {}
    if key_index is not None:
        if cu_seqlens is None or cu_seqlens_k is None:
            raise ValueError("key_index needs the query and key boundaries, cu_seqlens and cu_seqlens_k")
        if attention_mask is not None:
            raise ValueError("key_index gives the whole attention: pass no attention_mask beside it")
        if decoder.config._attn_implementation != PACKED_ATTENTION:
            raise ValueError(f"segments with their own key rows need attn_implementation="
                             f"{PACKED_ATTENTION!r}; the model has "
                             f"{decoder.config._attn_implementation!r}")
        extra = preference_attention_kwargs(cu_seqlens, cu_seqlens_k, key_index, max_seqlen, max_seqlen_k,
                                            total_tokens=input_ids.numel(), device=input_ids.device)
    elif cu_seqlens is not None:
        extra = packed_attention_kwargs(cu_seqlens, max_seqlen, total_tokens=input_ids.numel(),
                                        device=input_ids.device)
    if extra and attention_mask is None and decoder.config._attn_implementation == PACKED_ATTENTION:
        attention_mask = conversations_mask(input_ids.device)
    out = decoder(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
        use_cache=False, **extra,
    )
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


class TeacherStates(nn.Module):
    """A frozen model as a module whose forward gives its last hidden states ([B * L, H], no logits):
    a distillation teacher. Its output layer is read by `output_projection` (under FSDP2, between
    the module's `unshard()` and `reshard()`); the loss that joins both runs in the student's head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, **attention) -> torch.Tensor:
        return last_hidden_states(self.model, input_ids, position_ids, **attention)

    def output_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        projection = plain_projection(output_head_of(self.model))
        if projection is None:
            raise ValueError(f"the teacher's output layer ({type(output_head_of(self.model)).__name__}) is not "
                             "one weight matrix")
        return projection
