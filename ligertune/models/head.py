"""The loss head: decoder hidden states -> output projection -> cross-entropy, for any causal LM.

There is one head for every family. It runs the model's decoder stack (which ends with the final
norm) to get the last hidden states, then either hands them with the output projection's weight to
`ligertune.kernels.fused_linear_cross_entropy` (the [tokens, vocab] logits are never stored), or,
unfused, runs the model's own output layer and `causal_lm_loss_from_logits`, the same per-token
formula in plain torch. Both give the same `LossOutput`.

The projection is used inside `CausalLMLoss.forward`, so a sharded model (FSDP2) has its weight
gathered there, by the hooks of the module that owns it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ligertune import kernels
from ligertune.kernels import LossOutput
from ligertune.kernels.chunked_loss import FLCE_REDUCTIONS
from ligertune.kernels.reference import cross_entropy_rows
from ligertune.models.attention import PACKED_ATTENTION, conversations_mask, packed_attention_kwargs
from ligertune.models.unwrap import decoder_of, output_head_of, plain_projection, unwrap_model


def causal_lm_loss_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    softcap: float | None = None,
    token_weights: torch.Tensor | None = None,
    reduction: str = "mean",
) -> LossOutput:
    """The loss of `fused_linear_cross_entropy`, from materialized logits [N, V] and targets [N].

    For every supervised row t (targets[t] != ignore_index), with z the row's logits (capped to
    c tanh(z / c) when `softcap` = c) and lse = logsumexp(z), in float32:

        l_t = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v) + z_loss_weight lse^2

    which is `torch.nn.functional.cross_entropy` with `label_smoothing=eps`, plus the z-loss. Then,
    with w_t = token_weights[t] (default 1): "sum" gives sum_t w_t l_t, "mean" that sum over the
    number of supervised rows, "none" w_t l_t per row (0 at ignored rows). `z_loss` is the
    z_loss_weight lse^2 part under the same weights and reduction (not differentiable), `n_correct`
    the supervised rows whose argmax equals the target, `n_tokens` the supervised rows. The per-row
    formula is the fused loss's own, `ligertune.kernels.reference.cross_entropy_rows`, here under
    autograd (the logits may come from any output layer, such as a LoRA-adapted one).
    """
    if reduction not in FLCE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {FLCE_REDUCTIONS}; got {reduction!r}")
    supervised = targets != ignore_index
    y = torch.where(supervised, targets, 0).long()
    loss, z_part, _, z = cross_entropy_rows(
        logits.float(), y, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, softcap=softcap
    )
    weights = supervised.float()
    if token_weights is not None:
        weights = torch.where(supervised, token_weights.float(), 0.0)
    loss, z_part = loss * weights, (z_part * weights).detach()
    n_tokens = supervised.sum()
    n_correct = (supervised & (z.argmax(dim=-1) == y)).sum()
    if reduction != "none":
        scale = 1.0 / n_tokens.clamp(min=1) if reduction == "mean" else 1.0
        loss, z_part = loss.sum() * scale, z_part.sum() * scale
    return LossOutput(loss=loss, z_loss=z_part, n_correct=n_correct, n_tokens=n_tokens)


class CausalLMLoss(nn.Module):
    """A causal LM (plain or peft-wrapped) with its loss as the forward: ids in, `LossOutput` out.

    `model` is kept as the submodule `self.model` (use it for `generate()` and `save_pretrained()`).
    With `fused=True` the output projection and the loss run in `fused_linear_cross_entropy`; an
    output layer that is not one weight matrix (a LoRA-adapted `lm_head`) falls back to the unfused
    path, with a warning. Gemma 2's final logit softcapping is applied in both paths.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        fused: bool = True,
        chunk_bytes: int | None = None,
        label_smoothing: float = 0.0,
        z_loss_weight: float = 0.0,
        ignore_index: int = -100,
    ):
        super().__init__()
        self.model = model
        self.label_smoothing = float(label_smoothing)
        self.z_loss_weight = float(z_loss_weight)
        self.ignore_index = int(ignore_index)
        self.chunk_bytes = chunk_bytes
        self.softcap = getattr(unwrap_model(model).config, "final_logit_softcapping", None)
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
        targets: torch.Tensor,
        token_weights: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        reduction: str = "sum",
    ) -> LossOutput:
        """Loss of `targets` [B, L] (already shifted: targets[t] is the token after input_ids[t];
        `ignore_index` where there is no loss) given `input_ids` [B, L].

        `cu_seqlens` (cumulative conversation lengths over the flattened B * L tokens) and
        `max_seqlen` keep the conversations of a pack apart under packed attention; `attention_mask`
        is the padding mask of an unpacked, padded batch. `token_weights` [B, L] and `reduction` as
        in `fused_linear_cross_entropy` ("sum" of w_t l_t by default).
        """
        decoder = decoder_of(self.model)
        extra = {}
        if cu_seqlens is not None:
            extra = packed_attention_kwargs(cu_seqlens, max_seqlen, total_tokens=input_ids.numel(),
                                            device=input_ids.device)
            if attention_mask is None and decoder.config._attn_implementation == PACKED_ATTENTION:
                attention_mask = conversations_mask(input_ids.device)
        out = decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            use_cache=False, **extra,
        )
        hidden = out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        if token_weights is not None:
            token_weights = token_weights.reshape(-1)
        head = output_head_of(self.model)
        options = dict(
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            z_loss_weight=self.z_loss_weight, softcap=self.softcap, token_weights=token_weights,
            reduction=reduction,
        )
        projection = plain_projection(head) if self.fused else None
        if projection is not None:
            weight, bias = projection
            return kernels.fused_linear_cross_entropy(
                hidden, weight, targets, bias=bias, chunk_bytes=self.chunk_bytes, **options
            )
        return causal_lm_loss_from_logits(head(hidden), targets, **options)

    def extra_repr(self) -> str:
        return (
            f"fused={self.fused}, label_smoothing={self.label_smoothing}, "
            f"z_loss_weight={self.z_loss_weight}, ignore_index={self.ignore_index}, softcap={self.softcap}"
        )
