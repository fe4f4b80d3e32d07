"""The Lion optimizer on `ligertune.kernels.lion_step`: one fused launch per device and dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ligertune.kernels import lion_step

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support has no DTensor parameters either
    DTensor = None

MOMENTUM_DTYPE = torch.float32
"""The momentum's storage, whatever the parameter's dtype: in bfloat16 (8 significant bits)
`beta2 m + (1 - beta2) g` with beta2 = 0.99 rounds back to m unless g is large against m, so the
momentum would stop averaging."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters, their gradients and their state), else `t`.

    The update is elementwise and a parameter, its gradient and its momentum are sharded alike, so
    each rank updates its own shard in place and no communication is needed. Under no_grad,
    `to_local()` is the DTensor's own local tensor, not a copy.
    """
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


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
    ):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

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
            # By device only: `lion_step` takes mixed dtypes and groups them into launches itself.
            buckets: dict[torch.device, tuple[list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=MOMENTUM_DTYPE, memory_format=torch.contiguous_format
                    )
                param = _local(p)
                params, grads, moments = buckets.setdefault(param.device, ([], [], []))
                params.append(param)
                grads.append(_local(p.grad))
                moments.append(_local(state["exp_avg"]))
            beta1, beta2 = group["betas"]
            for params, grads, moments in buckets.values():
                lion_step(
                    params, grads, moments,
                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`torch.optim.Optimizer.load_state_dict`, keeping the float32 momentum of low-precision
        parameters: the base class casts every floating-point state tensor to its parameter's dtype,
        which would round the momentum of a bfloat16 parameter to bfloat16 on resume."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {}).get("exp_avg")
            loaded = self.state[p].get("exp_avg")
            if saved is not None and loaded is not None and loaded.dtype != MOMENTUM_DTYPE:
                self.state[p]["exp_avg"] = saved.to(device=loaded.device, dtype=MOMENTUM_DTYPE, copy=True)


def _check_hyperparameters(lr: float, betas: tuple[float, float], weight_decay: float) -> None:
    if not float(lr) >= 0.0:
        raise ValueError(f"Lion: lr must be >= 0; got {lr}")
    if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
        raise ValueError(f"Lion: betas must be two numbers in [0, 1]; got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Lion: weight_decay must be >= 0; got {weight_decay}")
