"""Optimizer precision: float32 master weights for 16-bit parameters, what they cost, and the traps
that 16-bit optimizer state falls into (docs/optim.md).

torch's optimizers keep their state in the parameter's dtype and add the update to the parameter
itself. For bfloat16 or float16 parameters that loses the update and the state:

- An update smaller than half the spacing of the 16-bit numbers around a weight rounds away:
  bfloat16 keeps 8 significant bits, so around |w| the half spacing is 2^-9 |w| to 2^-8 |w|, and an
  AdamW step of about `lr` = 2e-5 leaves every weight above ~1e-2 unchanged.
- AdamW's second moment v <- beta2 v + (1 - beta2) g^2 stored in bfloat16: beta2 v rounds back to
  v when 1 - beta2 is below 2^-8 (so v never decays) and (1 - beta2) g^2 rounds away against a
  larger v. In float16, (1 - beta2) g^2 underflows to 0 for small gradients and eps = 1e-8 rounds to
  0: the denominator sqrt(v) + eps is then too small or 0, the update huge or NaN.

ligertune's answer (`optim.master_weights: true`, the default): each 16-bit trainable parameter is
stepped through a float32 copy kept in the optimizer state (`master`), with float32 moments, and
receives the copy rounded to its dtype after every step; the arithmetic is torch's (AdamW) or the
paper's (Lion), on float32 tensors. Cost per such parameter element: 4 bytes for the master, and
AdamW's moments in 8 bytes instead of 4: 16 bytes of parameter, gradient, master and moments where
torch keeps 8. Float32 parameters (FSDP's sharded float32 weights, peft's float32 LoRA adapters) are
untouched; LoRA adapters kept in a 16-bit model's dtype by `kernels.lora` get a master like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support has no DTensor parameters either
    DTensor = None

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Parameter dtypes that get a float32 master copy under `master_weights`."""

MASTER_DTYPE = torch.float32

CHUNK_ELEMENTS = 1 << 26
"""Elements of 16-bit parameters stepped per call under master weights: their gradients are cast to
float32 a chunk at a time, so the transient copy stays under 256 MiB whatever the model's size."""


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters, their gradients and their state), else `t`.

    Optimizer updates are elementwise and a parameter, its gradient and its state are sharded alike,
    so each rank updates its own shard in place with no communication. Under no_grad, `to_local()`
    is the DTensor's own local tensor, not a copy.
    """
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


MASTER = "master"
"""The optimizer state's key of a parameter's float32 master copy."""


def wants_master(p: torch.Tensor, master_weights: bool) -> bool:
    return master_weights and p.dtype in LOW_PRECISION


def master_of(p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The float32 master copy of `p` in its optimizer `state`, made from `p` on first use."""
    if MASTER not in state:
        state[MASTER] = p.detach().to(MASTER_DTYPE, memory_format=torch.contiguous_format, copy=True)
    return state[MASTER]


def chunks(rows: Sequence[Any], numel_of_master: Any, budget: int = CHUNK_ELEMENTS) -> Iterator[list[Any]]:
    """`rows` in consecutive runs whose master elements (`numel_of_master(row)`, 0 for a row without
    a master) sum to at most `budget`; a single larger row is a run of its own."""
    run: list[Any] = []
    size = 0
    for row in rows:
        n = numel_of_master(row)
        if run and size + n > budget:
            yield run
            run, size = [], 0
        run.append(row)
        size += n
    if run:
        yield run


def load_state_dict_keeping_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any],
                                   base_load: Any) -> None:
    """`base_load(state_dict)` (torch.optim.Optimizer.load_state_dict), then every state tensor back
    in the dtype it was saved in: the base class casts each floating-point state tensor to its
    parameter's dtype, which would round a bfloat16 parameter's float32 master and moments to
    bfloat16 on resume."""
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    base_load(state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, p in zip(saved_ids, params):
        state = optimizer.state.get(p, {})
        for key, saved in state_dict["state"].get(saved_id, {}).items():
            loaded = state.get(key)
            if isinstance(saved, torch.Tensor) and isinstance(loaded, torch.Tensor) and loaded.dtype != saved.dtype:
                state[key] = saved.to(device=loaded.device, dtype=saved.dtype, copy=True)


# --------------------------------------------------------------------------------------------------
# what the optimizer keeps


@dataclass
class OptimizerMemory:
    """Bytes the optimizer keeps beside the parameters and gradients (per-element tensors only)."""

    name: str
    states: int
    """Moments: AdamW's m and v, Lion's m."""
    master: int
    """Float32 master copies of 16-bit parameters."""
    adamw_states: int
    """What AdamW's moments would take for the same parameters and settings."""
    master_params: int
    """Elements that have a master copy."""

    @property
    def total(self) -> int:
        return self.states + self.master

    def describe(self) -> str:
        mib = 2**20
        text = f"optimizer: {self.name}, {self.total / mib:,.1f} MiB of state ({self.states / mib:,.1f} MiB moments"
        if self.name != "adamw":
            text += f", AdamW's would take {self.adamw_states / mib:,.1f} MiB"
        if self.master:
            text += f", {self.master / mib:,.1f} MiB float32 master weights of {self.master_params / 1e6:.2f}M " \
                    "16-bit parameters"
        return text + ")"


def optimizer_memory(params: Sequence[torch.Tensor], name: str, *, master_weights: bool) -> OptimizerMemory:
    """What `build_optimizer` will keep for `params` once every one has stepped: AdamW two moments in
    the parameter's dtype (float32 with a master), Lion one float32 moment, and 4 bytes per element
    of a master copy."""
    states = master = adamw = master_params = 0
    for p in params:
        n = p.numel()
        has_master = wants_master(p, master_weights)
        state_size = MASTER_DTYPE.itemsize if has_master else p.dtype.itemsize
        adamw += 2 * n * state_size
        states += 2 * n * state_size if name == "adamw" else n * MASTER_DTYPE.itemsize
        if has_master:
            master += n * MASTER_DTYPE.itemsize
            master_params += n
    return OptimizerMemory(name, states, master, adamw, master_params)


# --------------------------------------------------------------------------------------------------
# the traps of 16-bit state


def half_spacing(dtype: torch.dtype) -> float:
    """Half the relative spacing of `dtype`'s numbers at the bottom of a binade (2^-9 for bfloat16):
    a relative change below it always rounds away."""
    return torch.finfo(dtype).eps / 4


def update_rounds_away(dtype: torch.dtype, lr: float) -> float:
    """The weight magnitude above which a step of `lr` on a `dtype` parameter always rounds away:
    lr / half_spacing (1e-2 for bfloat16 and lr 2e-5)."""
    return lr / half_spacing(dtype)


def smallest_second_moment_gradient(dtype: torch.dtype, beta2: float) -> float:
    """The gradient below which (1 - beta2) g^2 underflows to 0 in `dtype`: sqrt(s / 2 / (1 - beta2)),
    s the smallest subnormal (5.5e-3 for float16 and beta2 0.999; 1e-19 for bfloat16)."""
    info = torch.finfo(dtype)
    smallest = info.tiny * info.eps
    return math.sqrt(smallest / 2 / max(1.0 - beta2, 1e-300))


def adamw_state_traps(dtype: torch.dtype, *, eps: float, beta2: float) -> list[tuple[str, str]]:
    """(key, why) for each way AdamW moments stored in `dtype` lose `eps` or the second moment.

    - eps rounds to 0 in `dtype` (float16 below 3e-8): where v is 0 the update is 0/0.
    - eps below the gradient whose second moment underflows (`smallest_second_moment_gradient`):
      there v is 0, the denominator is eps, and the update m / eps grows past lr by g / eps.
    - 1 - beta2 below half the relative spacing of `dtype` (2^-8 for bfloat16, `torch.finfo.eps / 2`):
      beta2 v rounds back to v for most v, so v does not decay and the small (1 - beta2) g^2 round
      away; the denominator sqrt(v) + eps then keeps eps only where sqrt(v) < eps / 2^-9.
    """
    if dtype not in LOW_PRECISION:
        return []
    name = str(dtype).removeprefix("torch.")
    fix = "keep optim.master_weights: true (the default) for float32 moments"
    problems = []
    floor = smallest_second_moment_gradient(dtype, beta2)
    if torch.tensor(eps, dtype=dtype).item() == 0.0:
        problems.append(("optim.eps", f"{eps:g} rounds to 0 in {name} AdamW moments (optim.master_weights: false): "
                         f"an element whose second moment is 0 steps by 0/0 = NaN, and second moments of "
                         f"gradients below {floor:.1e} underflow to 0; {fix}"))
    elif eps < floor:
        problems.append(("optim.eps", f"{eps:g} is below {floor:.1e}, the gradient whose second moment "
                         f"(1 - beta2) g^2 underflows to 0 in {name} AdamW moments (optim.master_weights: "
                         f"false): such elements step by m / eps, up to {floor / eps:.0e} x lr; {fix}"))
    if 1.0 - beta2 < torch.finfo(dtype).eps / 2:
        problems.append(("optim.eps", f"{eps:g} with {name} AdamW moments (optim.master_weights: false) is below "
                         f"what the denominator sqrt(v) + eps resolves wherever sqrt(v) > {eps / half_spacing(dtype):.1e}, "
                         f"and beta2 = {beta2:g} (optim.betas) is too close to 1 for {name}: beta2 v rounds "
                         f"back to v, so the second moment never decays and small ones round away; {fix}"))
    return problems


TYPICAL_ADAMW_LR = {"full": 2e-5, "lora": 2e-4}
"""AdamW learning rates typical of chat fine-tuning (the recipe default for full fine-tuning; LoRA
adapters take about ten times more). Lion wants 3-10x smaller ones."""


def optimizer_warnings(cfg: Any, trainable_dtypes: set[torch.dtype], *, lora: bool) -> list[tuple[str, str]]:
    """(key, message) for an optimizer recipe that runs but probably not as meant: a Lion learning
    rate of AdamW's size (not 3x below a typical AdamW lr, the Lion paper's lower bound), and 16-bit
    parameters stepped without master weights (`cfg` is the recipe's `OptimConfig`)."""
    found = []
    if cfg.name == "lion":
        kind = "lora" if lora else "full"
        typical = TYPICAL_ADAMW_LR[kind]
        if cfg.lr > typical / 3:
            what = "LoRA" if lora else "full fine-tuning"
            found.append(("optim.lr", f"{cfg.lr:g} looks AdamW-sized for Lion: Lion's update is +-lr on every "
                          f"element, so it wants a learning rate 3-10x smaller than AdamW's (about "
                          f"{typical / 10:.0e} to {typical / 3:.0e} for {what}) and a weight decay 3-10x larger "
                          "(Chen et al. 2023, section 5)"))
    if cfg.master_weights:
        return found
    for dtype in sorted(trainable_dtypes & set(LOW_PRECISION), key=str):
        name = str(dtype).removeprefix("torch.")
        found.append(("optim.master_weights", f"false with {name} trainable parameters: a step of about lr = "
                      f"{cfg.lr:g} rounds away on every weight above {update_rounds_away(dtype, cfg.lr):.2g} in "
                      f"magnitude (half of {name}'s spacing there is more than lr)"))
        if cfg.name == "adamw":
            found.extend(adamw_state_traps(dtype, eps=cfg.eps, beta2=cfg.betas[1]))
    return found
