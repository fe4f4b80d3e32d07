"""The Lion optimizer on `ligertune.kernels.lion_step`: one fused launch per device and dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ligertune.kernels import lion_step
from ligertune.training.precision import (
    chunks,
    load_state_dict_keeping_dtypes,
    local,
    master_of,
    wants_master,
)

MOMENTUM_DTYPE = torch.float32
"""The momentum's storage, whatever the parameter's dtype: in bfloat16 (8 significant bits)
`beta2 m + (1 - beta2) g` with beta2 = 0.99 rounds back to m unless g is large against m, so the
momentum would stop averaging."""


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2) with
    decoupled weight decay. For each parameter p with gradient g and momentum m:

        c = beta1 m + (1 - beta1) g
        p <- p - lr (sign(c) + weight_decay p)
        m <- beta2 m + (1 - beta2) g

    One state tensor per parameter, `exp_avg` (m), stored in float32: half of AdamW's optimizer
    memory for float32 parameters, the same as torch's AdamW for bfloat16 ones (whose two moments
    are bfloat16). The update has unit size per element, so Lion's usual learning rate is 3-10x
    smaller than AdamW's and its weight decay 3-10x larger (the paper's section 5).

    `master_weights=True`: a bfloat16 or float16 parameter is stepped through a float32 copy kept in
    its state (`master`; its gradient cast to float32 a chunk at a time) and receives the copy
    rounded to its dtype after each step, so that steps smaller than its spacing add up
    (`ligertune.training.precision`).

    Param groups take `lr`, `betas` and `weight_decay`. Parameters whose `grad` is None are skipped
    (no state is created for them). `step()` calls `lion_step` once per device of each group,
    which is one Triton launch per parameter dtype on CUDA. DTensor parameters (FSDP2) are updated
    through their local shards.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        master_weights: bool = False,
    ):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.master_weights = master_weights

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """`torch.optim.Optimizer.add_param_group`, checking the group's values (defaults filled in)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["weight_decay"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rows = [self._row(p) for p in group["params"] if p.grad is not None]
            for chunk in chunks(rows, lambda row: row[1].numel() if row[1] is not row[0] else 0):
                # By device only: `lion_step` takes mixed dtypes and groups them into launches itself.
                buckets: dict[torch.device, tuple[list, list, list]] = {}
                for p, target, moment in chunk:
                    params, grads, moments = buckets.setdefault(local(target).device, ([], [], []))
                    params.append(local(target))
                    grads.append(local(p.grad).to(target.dtype))  # a float32 copy under a master
                    moments.append(local(moment))
                beta1, beta2 = group["betas"]
                for params, grads, moments in buckets.values():
                    lion_step(
                        params, grads, moments,
                        lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                    )
                for p, target, _ in chunk:
                    if target is not p:
                        local(p).copy_(local(target))
        return loss

    def _row(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(param, what the update is applied to: its master or itself, momentum), made on first use."""
        if p.grad.is_sparse:
            raise RuntimeError("Lion does not support sparse gradients")
        state = self.state[p]
        target = master_of(p, state) if wants_master(p, self.master_weights) else p
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=MOMENTUM_DTYPE, memory_format=torch.contiguous_format)
        return p, target, state["exp_avg"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`torch.optim.Optimizer.load_state_dict`, keeping the float32 momentum (and master) of
        low-precision parameters: the base class casts every floating-point state tensor to its
        parameter's dtype, which would round them to bfloat16 on resume."""
        load_state_dict_keeping_dtypes(self, state_dict, super().load_state_dict)


def _check_hyperparameters(lr: float, betas: tuple[float, float], weight_decay: float) -> None:
    if not float(lr) >= 0.0:
        raise ValueError(f"Lion: lr must be >= 0; got {lr}")
    if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
        raise ValueError(f"Lion: betas must be two numbers in [0, 1]; got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Lion: weight_decay must be >= 0; got {weight_decay}")
