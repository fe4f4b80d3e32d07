"""`train.gradient_checkpointing: auto`: recompute as few decoder layers as a memory budget allows.

Between its forward and its backward, a decoder layer keeps the tensors autograd saves for it: A
bytes when it runs normally, only its input (C bytes) when it is checkpointed (its forward runs
again in backward, one layer at a time). A step with k of its L layers left un-checkpointed peaks
at about

    P(k) = P_1 + S + (k - 1) (A - C)

where P_1 is the measured peak of a step with one layer un-checkpointed (weights, gradients, the
loss head, one recomputed layer, the workspace of every kernel) and S the optimizer state that the
first update allocates (0 when resuming: the state is there already). The update itself (the
optimizer's temporaries over weights, gradients and state) peaks at U whatever k is, so the step
peaks at max(P(k), U). `auto` leaves the largest k with max(P(k), U) <= `train.memory_budget_gib`
un-checkpointed, and recomputes the first L - k layers.

Everything is measured on the run's first step, itself an ordinary training step (checkpointing
changes where activations live, not what is computed): A by counting the bytes autograd saves inside
the un-checkpointed layer (parameters excluded, each storage once), C as the bytes of that layer's
input, P_1, S and U from the device's allocator (the step split at the optimizer's step). The
decoder layers of one model are alike, so one layer's A stands for all of them.

Two refinements:

- Offload (`train.activation_offload`): the inputs of checkpointed layers 1 .. L-2 are parked in
  pinned host memory after their forward and copied back one layer ahead of their recompute, on a
  side stream overlapped with compute (`InputOffload`). With p parked layers the forward and
  backward peak falls by (p - 1) C (one input is on its way back while another is in use):

      P(k) = P_1 + S + (k - 1) (A - C) - (p(k) - 1) C,   p(k) = L - k - 1  (k >= 1; L - 2 for k = 0)

  and U does not change. `auto` offloads where that leaves more layers un-checkpointed than keeping
  the inputs would.
- Calibration: the plan's step (the second) is measured too. Where its forward and backward peak
  differs from P(k), the model is moved by the difference (P_1 + S becomes P_1 + S + measured -
  P(k)), U is taken as measured, and the plan made once more. The slope A - C stays: autograd's
  saved bytes are an upper bound on what a kept layer adds at the peak (some are freed before it),
  so from the measured point the model errs on the safe side. The intercept cannot be measured
  once for all k: with one layer kept the step peaks inside the backward, with many at the end of
  the forward.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from ligertune.devices import device_memory_bytes
from ligertune.models.patching import recomputing

GIB = 2**30


def parked_layers(layers: int, checkpointed: int) -> int:
    """How many of the first `checkpointed` layers `InputOffload` parks: those in 1 .. L-2."""
    return max(0, min(checkpointed - 1, layers - 2))


def predicted_peak(*, layers: int, checkpointed: int, offload: bool, activation: int,
                   checkpointed_input: int, step_peak: int, update_peak: int = 0) -> int:
    """P(k) of the module docstring, k = layers - checkpointed (bytes)."""
    kept = layers - checkpointed
    peak = step_peak + (kept - 1) * (activation - checkpointed_input)
    if offload:
        peak -= max(parked_layers(layers, checkpointed) - 1, 0) * checkpointed_input
    return max(peak, update_peak)


@dataclass(frozen=True)
class CheckpointPlan:
    """Which layers `auto` recomputes, whether their inputs are offloaded, and the measurements it
    decided from."""

    layers: int
    checkpointed: int  # the first `checkpointed` layers are recomputed in backward
    offload: bool  # their inputs (layers 1 .. L-2) wait in host memory
    budget_gib: float
    activation_gib: float  # A: one layer's saved activations, not checkpointed
    input_gib: float  # C: what a checkpointed layer keeps (its input)
    step_peak_gib: float  # P_1 + S
    update_peak_gib: float  # U
    fits: bool  # False: even with every layer recomputed (and offloaded) the step needs more

    @property
    def predicted_peak_gib(self) -> float:
        return predicted_peak(layers=self.layers, checkpointed=self.checkpointed, offload=self.offload,
                              activation=self.activation_gib, checkpointed_input=self.input_gib,
                              step_peak=self.step_peak_gib, update_peak=self.update_peak_gib)

    def describe(self) -> str:
        return f"gradient checkpointing (auto, {self.budget_gib:g} GiB budget): {self.summary()}"

    def summary(self) -> str:
        offloaded = (f", the inputs of {parked_layers(self.layers, self.checkpointed)} in host memory"
                     if self.offload else "")
        line = (f"{self.checkpointed} of {self.layers} layers recomputed{offloaded}; a layer keeps "
                f"{self.activation_gib:.2f} GiB of activations ({self.input_gib:.2f} GiB checkpointed), "
                f"predicted peak {self.predicted_peak_gib:.1f} GiB")
        if not self.fits:
            line += "; the budget is below what the step needs with every layer recomputed"
        return line


def plan_checkpointing(*, layers: int, activation: int, checkpointed_input: int, step_peak: int,
                       budget: int, offload: bool | str = False, update_peak: int = 0) -> tuple[int, bool, bool]:
    """(layers to recompute, whether their inputs are offloaded, whether the step fits the budget),
    by the module docstring's P(k); all sizes in bytes. `step_peak` is P_1 + S, measured with one
    layer not checkpointed and no offload. `offload`: False, True, or "auto" (offload where it
    leaves more layers un-checkpointed, or where only offloading fits)."""

    def fewest(offloaded: bool) -> int | None:
        for count in range(layers + 1):
            if predicted_peak(layers=layers, checkpointed=count, offload=offloaded, activation=activation,
                              checkpointed_input=checkpointed_input, step_peak=step_peak,
                              update_peak=update_peak) <= budget:
                return count
        return None

    resident = fewest(False) if offload is not True else None
    offloaded = fewest(True) if offload else None
    if offload is True or (offloaded is not None and (resident is None or offloaded < resident)):
        count, chosen = offloaded, True
    else:
        count, chosen = resident, False
    if count is None:  # nothing fits: recompute all (offloaded if allowed) and say so
        return layers, bool(offload) and parked_layers(layers, layers) > 0, False
    return count, chosen and parked_layers(layers, count) > 0, True


def set_checkpointed(layers: Sequence[nn.Module], count: int) -> None:
    """Recompute the first `count` decoder layers in backward and run the others normally (the
    model's gradient checkpointing must be enabled, which marks every layer)."""
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < count


@dataclass
class _Parked:
    tensor: torch.Tensor  # the layer's input, its storage emptied while parked
    host: torch.Tensor
    ready: torch.cuda.Event | None = None  # set once the copy back is queued


class InputOffload:
    """Parks the inputs of checkpointed decoder layers 1 .. L-2 in host memory (pinned on CUDA)
    between their forward and their recompute.

    After a parked layer's forward its input is copied out on a side stream and the device storage
    emptied (autograd's saved reference stays, pointing at no memory). In backward, just before a
    layer's backward begins (a pre-hook on its output's gradient node), its input is made whole again
    (waiting for its copy) and the copy of the previous layer's input is queued, so it travels while
    this layer recomputes. Layer 0's input (the embeddings, which a model may read again) and the
    last layer's (nothing runs before its backward to fetch it ahead) stay on the device.
    """

    def __init__(self, layers: Sequence[nn.Module], device: torch.device, *, enabled: bool = False):
        self.layers, self.device = list(layers), device
        self.enabled = enabled
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._parked: dict[int, _Parked] = {}
        self._hooks = [layer.register_forward_hook(functools.partial(self._after_forward, i), with_kwargs=True)
                       for i, layer in enumerate(self.layers)]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._parked.clear()

    @property
    def parked_count(self) -> int:
        """The layers whose inputs are parked, as the layers' checkpointing is set now."""
        return sum(getattr(layer, "gradient_checkpointing", False) for layer in self.layers[1:-1])

    @property
    def parked_bytes(self) -> int:
        return sum(p.host.numel() * p.host.element_size() for p in self._parked.values())

    def _after_forward(self, index: int, layer: nn.Module, args, kwargs, output) -> None:
        # Only the step's own forward: not evaluation, not the recompute (which runs in backward).
        if not (self.enabled and layer.training and torch.is_grad_enabled() and not recomputing()):
            return
        if index == 0:
            self._parked.clear()  # a new forward: the last one's are gone or restored
        out = output[0] if isinstance(output, tuple) else output
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(functools.partial(self._before_backward, index))
        hidden = args[0] if args else kwargs.get("hidden_states")
        if getattr(layer, "gradient_checkpointing", False) and 0 < index < len(self.layers) - 1:
            self._park(index, hidden)

    def _park(self, index: int, hidden: torch.Tensor) -> None:
        storage = hidden.untyped_storage()
        if not (hidden.is_contiguous() and hidden.storage_offset() == 0
                and storage.nbytes() == hidden.numel() * hidden.element_size()):
            return  # a view into something larger: not this layer's to free
        with torch.no_grad():
            host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=self.stream is not None)
            if self.stream is None:
                host.copy_(hidden)
            else:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    host.copy_(hidden, non_blocking=True)
                hidden.record_stream(self.stream)  # the block is not reused before the copy is done
        storage.resize_(0)
        self._parked[index] = _Parked(hidden, host)

    def _before_backward(self, index: int, grad_outputs) -> None:
        parked = self._parked.pop(index, None)
        if parked is not None:
            self._fetch(parked)
            if parked.ready is not None:
                main = torch.cuda.current_stream(self.device)
                main.wait_event(parked.ready)
                parked.tensor.record_stream(main)
        previous = self._parked.get(index - 1)
        if previous is not None:
            self._fetch(previous)

    def _fetch(self, parked: _Parked) -> None:
        """Queue the copy of a parked input back into its storage (at once on a CPU)."""
        if parked.ready is not None or parked.tensor.untyped_storage().nbytes():
            return
        tensor, host = parked.tensor, parked.host
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            storage = tensor.untyped_storage()
            storage.resize_(tensor.numel() * tensor.element_size())
            # A fresh tensor over the storage: copying into the saved tensor itself would count as an
            # in-place change and fail autograd's version check.
            alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, tensor.shape,
                                                                                   tensor.stride())
            with torch.no_grad():
                alias.copy_(host, non_blocking=self.stream is not None)
            if self.stream is not None:
                parked.ready = torch.cuda.Event()
                parked.ready.record(self.stream)


def fixed_offload(cfg, layers: Sequence[nn.Module], device: torch.device) -> InputOffload | None:
    """`activation_offload: true` with `gradient_checkpointing: true`: every checkpointed layer's
    input, always (under `auto` the planner decides; `CheckpointPlanner.offloader`)."""
    if cfg.gradient_checkpointing is True and cfg.activation_offload is True:
        return InputOffload(layers, device, enabled=True)
    return None


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


def default_budget_gib(device: torch.device) -> float:
    """`train.memory_budget_gib` left unset: 90% of the device's memory (of what this process may
    take of it, `devices.cap_device_memory`), room for the allocator's fragmentation and the CUDA
    context."""
    return 0.9 * device_memory_bytes(device) / GIB


def device_allocator(device: torch.device) -> CudaAllocator | None:
    """The allocator to measure on; None where there is none to read (the CPU)."""
    return CudaAllocator(device) if device.type == "cuda" else None


class CheckpointPlanner:
    """Measures the run's first step and sets which layers are recomputed (and whether their inputs
    are offloaded), then corrects the plan once from the second step's peak (module docstring).

    With the `optimizer`, each measured step is split at its update (a step pre-hook): the peak of
    forward and backward, which the layers' activations make, apart from the update's, which they
    do not (the optimizer's temporaries over weights, gradients and state: at 1B full fine-tuning on
    an H100 it is the step's peak with nearly every layer recomputed)."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], allocator: CudaAllocator, budget_gib: float,
                 offload: bool | str = "auto", optimizer: torch.optim.Optimizer | None = None):
        self.model, self.layers, self.allocator, self.budget_gib = model, list(layers), allocator, budget_gib
        self.offload, self.optimizer = offload, optimizer
        self.offloader = InputOffload(self.layers, self.allocator_device) if offload else None
        self.plan: CheckpointPlan | None = None
        self.news: str | None = None  # a line for the user after `planning()` changed the plan (`pop_news`)
        self._figures: dict[str, int] = {}
        self._calibrated = False
        self.peak_seen = 0  # the highest peak of the steps it measured (it resets the allocator's)

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """Around each training step: the first is measured, the second checks the plan, later
        ones run as planned."""
        if self.plan is None:
            with self.measuring():
                yield
            self.news = self.plan.describe()
        elif not self._calibrated:
            with self.calibrating():
                yield
        else:
            yield

    def pop_news(self) -> str | None:
        """The line for the user that the last step left, once."""
        news, self.news = self.news, None
        return news

    @contextlib.contextmanager
    def _peaks(self) -> Iterator[list[int]]:
        """[peak of forward and backward, peak of the update (0 if not seen)] of the step inside."""
        peaks: list[int] = []

        def before_update(*_):
            peaks.append(self.allocator.peak())
            self.allocator.reset_peak()

        hook = self.optimizer.register_step_pre_hook(before_update) if self.optimizer is not None else None
        self.allocator.reset_peak()
        try:
            yield peaks
        finally:
            if hook is not None:
                hook.remove()
        peaks.append(self.allocator.peak())
        if len(peaks) == 1:  # no update seen: the whole step counts as forward and backward
            peaks.append(0)
        peaks[:] = [peaks[0], max(peaks[1:])]
        self.peak_seen = max(self.peak_seen, *peaks)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Around the first training step: one layer un-checkpointed, its saved bytes counted, the
        allocator's peaks taken; the plan is made and applied when the step is done. With several
        processes, each measures and all take the largest figures, so that they make one plan."""
        set_checkpointed(self.layers, len(self.layers))
        self.layers[-1].gradient_checkpointing = False
        if self.offloader is not None:
            self.offloader.enabled = False
        saved = SavedBytes(self.layers[-1], self.model.parameters())
        before = self.allocator.allocated()
        with saved.counting(), self._peaks() as peaks:
            yield
        state = max(self.allocator.allocated() - before, 0)  # what the first update allocated
        activation, checkpointed_input, step_peak, update_peak = self._largest(
            [saved.activation, saved.input, peaks[0] + state, peaks[1]])
        self.apply(activation=activation, checkpointed_input=checkpointed_input, step_peak=step_peak,
                   update_peak=update_peak)

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[None]:
        """Around the second step, the first run as planned: the model of forward and backward is
        moved to pass through their measured peak, the update's peak taken as measured, and the
        plan made again (once)."""
        with self._peaks() as peaks:
            yield
        self._calibrated = True
        measured, update_peak = self._largest(peaks)
        plan, figures = self.plan, self._figures
        predicted = predicted_peak(layers=plan.layers, checkpointed=plan.checkpointed, offload=plan.offload,
                                   activation=figures["activation"], checkpointed_input=figures["checkpointed_input"],
                                   step_peak=figures["step_peak"])
        before = plan.checkpointed, plan.offload
        plan = self.apply(activation=figures["activation"], checkpointed_input=figures["checkpointed_input"],
                          step_peak=figures["step_peak"] + measured - predicted,
                          update_peak=update_peak if update_peak else figures["update_peak"])
        if (plan.checkpointed, plan.offload) != before:
            self.news = (f"gradient checkpointing re-planned from step 2 (forward and backward peaked at "
                         f"{measured / GIB:.1f} GiB, predicted {predicted / GIB:.1f}): {plan.summary()}")

    def _largest(self, figures: list[int]) -> list[int]:
        """The figures' maxima over the processes (the figures themselves with one)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            reduced = torch.tensor(figures, dtype=torch.float64, device=self.allocator_device)
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            return [int(x) for x in reduced.tolist()]
        return figures

    @property
    def allocator_device(self) -> torch.device:
        return getattr(self.allocator, "device", torch.device("cpu"))

    def apply(self, *, activation: int, checkpointed_input: int, step_peak: int, update_peak: int = 0) -> CheckpointPlan:
        self._figures = {"activation": activation, "checkpointed_input": checkpointed_input,
                         "step_peak": step_peak, "update_peak": update_peak}
        count, offload, fits = plan_checkpointing(
            layers=len(self.layers), activation=activation, checkpointed_input=checkpointed_input,
            step_peak=step_peak, budget=int(self.budget_gib * GIB), offload=self.offload, update_peak=update_peak)
        set_checkpointed(self.layers, count)
        if self.offloader is not None:
            self.offloader.enabled = offload
        self.plan = CheckpointPlan(
            layers=len(self.layers), checkpointed=count, offload=offload, budget_gib=self.budget_gib,
            activation_gib=activation / GIB, input_gib=checkpointed_input / GIB, step_peak_gib=step_peak / GIB,
            update_peak_gib=update_peak / GIB, fits=fits,
        )
        return self.plan
