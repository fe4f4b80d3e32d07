"""AdamW: torch's, with float32 master weights for 16-bit parameters (`ligertune.training.precision`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

from ligertune.training.precision import (
    chunks,
    load_state_dict_keeping_dtypes,
    local,
    master_of,
    wants_master,
)


class AdamW(torch.optim.AdamW):
    """torch's AdamW (Loshchilov & Hutter 2019, decoupled weight decay). For each parameter p with
    gradient g at step t:

        m <- beta1 m + (1 - beta1) g          v <- beta2 v + (1 - beta2) g^2
        p <- p (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

    `master_weights=False` is torch's AdamW itself: moments in the parameter's dtype, the update
    added to the parameter. `master_weights=True`: a bfloat16 or float16 parameter is stepped through
    a float32 copy kept in its state (`master`), with float32 moments, by the same functional
    (`torch.optim.adamw.adamw`, fused or multi-tensor as the group says), and receives the copy
    rounded to its dtype after each step; other parameters step exactly as in torch. The state keeps
    torch's keys (`step`, `exp_avg`, `exp_avg_sq`) and loading a checkpoint keeps their dtypes.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, master_weights: bool = False,
                 **options: Any):
        if options.get("amsgrad") or options.get("differentiable"):
            raise ValueError("AdamW: amsgrad and differentiable are not supported")
        super().__init__(params, **options)
        self.master_weights = master_weights

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not self.master_weights:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rows = [self._row(p, group) for p in group["params"] if p.grad is not None]
            for chunk in chunks(rows, lambda row: row[1].numel() if row[1] is not row[0] else 0):
                targets = [target for _, target, *_ in chunk]
                grads = [p.grad.to(target.dtype) for p, target, *_ in chunk]  # a float32 copy under a master
                beta1, beta2 = group["betas"]
                adamw(
                    targets, grads, [row[2] for row in chunk], [row[3] for row in chunk], [],
                    [row[4] for row in chunk], foreach=group["foreach"], capturable=group["capturable"],
                    differentiable=False, fused=group["fused"], amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group["maximize"],
                )
                for p, target, *_ in chunk:
                    if target is not p:
                        local(p).copy_(local(target))
        return loss

    def _row(self, p: torch.Tensor, group: dict[str, Any]) -> tuple:
        """(param, what the update is applied to: its master or itself, exp_avg, exp_avg_sq, step),
        the state made on first use as torch makes it."""
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        state = self.state[p]
        target = master_of(p, state) if wants_master(p, self.master_weights) else p
        if "step" not in state:
            on_device = group["fused"] or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
        return p, target, state["exp_avg"], state["exp_avg_sq"], state["step"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`torch.optim.Optimizer.load_state_dict`, keeping the float32 master and moments of 16-bit
        parameters in float32."""
        load_state_dict_keeping_dtypes(self, state_dict, super().load_state_dict)
