"""`train.gradient_checkpointing: auto`: recompute as few decoder layers as a memory budget allows.

Between its forward and its backward, a decoder layer keeps the tensors autograd saves for it: A
bytes when it runs normally, only its input (C bytes) when it is checkpointed (its forward runs
again in backward, one layer at a time). A step with k of its L layers left un-checkpointed peaks
at about

    P(k) = P_1 + S + (k - 1) (A - C)

where P_1 is the measured peak of a step with one layer un-checkpointed (weights, gradients, the
loss head, one recomputed layer, the workspace of every kernel) and S the optimizer state that the
first update allocates (0 when resuming: the state is there already). `auto` leaves the largest k
with P(k) <= `train.memory_budget_gib` un-checkpointed, and recomputes the first L - k layers.

Everything is measured on the run's first step, itself an ordinary training step (checkpointing
changes where activations live, not what is computed): A by counting the bytes autograd saves inside
the un-checkpointed layer (parameters excluded, each storage once), C as the bytes of that layer's
input, P_1 and S from the device's allocator. The decoder layers of one model are alike, so one
layer's A stands for all of them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

GIB = 2**30


@dataclass(frozen=True)
class CheckpointPlan:
    """Which layers `auto` recomputes, and the measurements it decided from."""

    layers: int
    checkpointed: int  # the first `checkpointed` layers are recomputed in backward
    budget_gib: float
    activation_gib: float  # A: one layer's saved activations, not checkpointed
    input_gib: float  # C: what a checkpointed layer keeps (its input)
    step_peak_gib: float  # P_1 + S
    fits: bool  # False: even with every layer recomputed the step needs more than the budget

    @property
    def predicted_peak_gib(self) -> float:
        return self.step_peak_gib + (self.layers - self.checkpointed - 1) * (self.activation_gib - self.input_gib)

    def describe(self) -> str:
        line = (f"gradient checkpointing (auto, {self.budget_gib:g} GiB budget): {self.checkpointed} of "
                f"{self.layers} layers recomputed; a layer keeps {self.activation_gib:.2f} GiB of "
                f"activations ({self.input_gib:.2f} GiB checkpointed), predicted peak "
                f"{self.predicted_peak_gib:.1f} GiB")
        if not self.fits:
            line += "; the budget is below what the step needs with every layer recomputed"
        return line


def plan_checkpointing(*, layers: int, activation: int, checkpointed_input: int, step_peak: int,
                       budget: int) -> tuple[int, bool]:
    """(layers to recompute, whether the step fits the budget) by the module docstring's formula.

    `step_peak` is P_1 + S, measured with one layer not checkpointed; all arguments in bytes.
    """
    saving = max(activation - checkpointed_input, 1)
    if step_peak - saving > budget:  # P(0) > budget: nothing fits; recompute all and say so
        return layers, False
    kept = min(layers, 1 + math.floor((budget - step_peak) / saving))
    return layers - max(kept, 0), True


def set_checkpointed(layers: Sequence[nn.Module], count: int) -> None:
    """Recompute the first `count` decoder layers in backward and run the others normally (the
    model's gradient checkpointing must be enabled, which marks every layer)."""
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < count


class SavedBytes:
    """Counts the bytes autograd saves for backward while inside `layer`: each storage once, the
    parameters (saved by reference, not new memory) left out."""

    def __init__(self, layer: nn.Module, parameters: Iterator[nn.Parameter]):
        self.layer = layer
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._seen: set[int] = set()
        self.activation = 0
        self.input = 0
        self._inside = False

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._inside:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._parameter_storages and key not in self._seen:
                self._seen.add(key)
                self.activation += storage.nbytes()
        return tensor

    def _enter(self, module, args, kwargs):
        self._inside = True
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and not self.input:
            self.input = hidden.numel() * hidden.element_size()

    def _leave(self, module, args, kwargs, output):
        self._inside = False

    @contextlib.contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        enter = self.layer.register_forward_pre_hook(self._enter, with_kwargs=True)
        leave = self.layer.register_forward_hook(self._leave, with_kwargs=True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            enter.remove()
            leave.remove()


class CudaAllocator:
    """The device's allocator statistics that the planner reads."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def device_allocator(device: torch.device) -> CudaAllocator | None:
    """The allocator to measure on; None where there is none to read (the CPU)."""
    return CudaAllocator(device) if device.type == "cuda" else None


class CheckpointPlanner:
    """Measures the run's first step and then sets which layers are recomputed (module docstring)."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], allocator: CudaAllocator, budget_gib: float):
        self.model, self.layers, self.allocator, self.budget_gib = model, list(layers), allocator, budget_gib
        self.plan: CheckpointPlan | None = None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Around the first training step: one layer un-checkpointed, its saved bytes counted, the
        allocator's peak taken; the plan is made and applied when the step is done. With several
        processes, each measures and all take the largest figures, so that they make one plan."""
        set_checkpointed(self.layers, len(self.layers))
        self.layers[-1].gradient_checkpointing = False
        saved = SavedBytes(self.layers[-1], self.model.parameters())
        self.allocator.reset_peak()
        before = self.allocator.allocated()
        with saved.counting():
            yield
        state = max(self.allocator.allocated() - before, 0)  # what the first update allocated
        figures = [saved.activation, saved.input, self.allocator.peak() + state]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            reduced = torch.tensor(figures, dtype=torch.float64, device=self.allocator_device)
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            figures = [int(x) for x in reduced.tolist()]
        activation, checkpointed_input, step_peak = figures
        self.apply(activation=activation, checkpointed_input=checkpointed_input, step_peak=step_peak)

    @property
    def allocator_device(self) -> torch.device:
        return getattr(self.allocator, "device", torch.device("cpu"))

    def apply(self, *, activation: int, checkpointed_input: int, step_peak: int) -> CheckpointPlan:
        count, fits = plan_checkpointing(layers=len(self.layers), activation=activation,
                                         checkpointed_input=checkpointed_input, step_peak=step_peak,
                                         budget=int(self.budget_gib * GIB))
        set_checkpointed(self.layers, count)
        self.plan = CheckpointPlan(
            layers=len(self.layers), checkpointed=count, budget_gib=self.budget_gib,
            activation_gib=activation / GIB, input_gib=checkpointed_input / GIB, step_peak_gib=step_peak / GIB,
            fits=fits,
        )
        return self.plan
