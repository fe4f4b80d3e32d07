"""What each bench returns, the schema of its `--json`: rows, and the report that holds them with
what a reader needs to trust them (device, dtype, versions, date); and the one line that says why
a row, of either bench, failed.

    bench kernels      KernelReport of KernelRow: one implementation of one kernel at one shape
    bench step         StepReport of StepRow: one way of running a recipe's training step
    bench step --memory-cap
                       CapReport: the StepReport, and a CapChoice per variant and cap
    bench step --max-context
                       StepReport whose rows are the probes (layout "context") and `context`
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ligertune.bench.timing import Timing

# --------------------------------------------------------------------------------------------------
# bench kernels


@dataclass
class KernelRow:
    """One implementation of one kernel at one shape."""

    kernel: str
    shape: str
    dims: dict[str, int]
    impl: str
    status: str  # "ok", "not installed", "skipped", "failed"
    detail: str | None = None
    timing: Timing | None = None
    tflops: float | None = None
    gbps: float | None = None
    vs_ligertune: float | None = None
    errors: dict[str, float] = field(default_factory=dict)
    of_peak_bandwidth: float | None = None  # gbps / the data-sheet memory bandwidth
    of_copy_bandwidth: float | None = None  # gbps / a device-to-device copy's, measured in the run

    def to_dict(self) -> dict[str, Any]:
        out = {
            "kernel": self.kernel,
            "shape": self.shape,
            "dims": self.dims,
            "impl": self.impl,
            "status": self.status,
            "detail": self.detail,
            "median_ms": None,
            "min_ms": None,
            "max_ms": None,
            "repeats": None,
            "extra_peak_mib": None,
            "tflops": self.tflops,
            "gbps": self.gbps,
            "of_peak_bandwidth": self.of_peak_bandwidth,
            "of_copy_bandwidth": self.of_copy_bandwidth,
            "vs_ligertune": self.vs_ligertune,
            "errors": self.errors,
        }
        if self.timing is not None:
            t = self.timing.to_dict()
            out.update({k: t[k] for k in ("median_ms", "min_ms", "max_ms", "repeats", "extra_peak_mib")})
        return out


@dataclass
class KernelReport:
    """Every row, with what a reader needs to trust them: device, dtype, path, versions, date, and
    the memory roofline the GB/s rows are held against (None where unknown, as on a CPU)."""

    device: str
    device_type: str
    kernel_path: str
    dtype: str
    reference_dtype: str
    repeats: int
    warmup: int
    note: str | None
    versions: dict[str, str | None]
    date: str
    rows: list[KernelRow]
    peak_gbps: float | None = None
    """The device's memory bandwidth from its data sheet (or `--peak-gbps`)."""
    copy_gbps: float | None = None
    """A device-to-device copy's bandwidth, measured in the same run."""

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        data["rows"] = [row.to_dict() for row in self.rows]
        return data


# --------------------------------------------------------------------------------------------------
# bench step


@dataclass
class StepRow:
    """One way of running the step; `tokens` are real (non-pad) tokens per timed pass.

    Preference rows (a preference recipe) also give `pairs` per step, the time of the reference
    pass over those pairs (`reference_ms`, None where the reference runs inside the step) and
    `pairs_per_s` = pairs / (step_ms + reference_ms / reference_epochs): the reference pass, run
    once before the first step, spread over the pairs it serves in the run's epochs. Their `tokens`
    are the pairs' tokens as ligertune lays them out (the prompt once), for every row, peers
    included, so tokens/s and MFU compare as pairs/s do.
    """

    name: str
    layout: str  # "synthetic", "chat" or "context" (a `--max-context` probe)
    status: str = "ok"  # "ok", "not installed", "skipped", "failed"
    detail: str | None = None
    steps: int = 0
    tokens: int = 0
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mem_gib: float | None = None
    peak_reserved_gib: float | None = None  # the allocator's reserved peak: what it took from the device
    flops: float | None = None
    mfu: float | None = None
    mfu_measured: float | None = None
    vs_ligertune: float | None = None
    checkpointing: str | None = None  # "off", "every layer", "auto: k of L layers"
    pairs: int | None = None
    pairs_per_s: float | None = None
    reference_ms: float | None = None
    reference_epochs: int = 1  # the epochs over which one reference pass serves every pair
    reference: str | None = None  # where the reference log-probs come from, as the table says it

    @property
    def time_ms(self) -> float:
        """The step's time with its share of the reference pass: what the row's rates divide by."""
        return self.step_ms + (self.reference_ms or 0.0) / self.reference_epochs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class StepReport:
    """Every row of a recipe's step, with the model, the device and the peak rates MFU is taken against."""

    recipe: str
    model: dict[str, Any]
    device: str
    device_type: str
    dtype: str
    micro_batch_size: int
    max_seq_len: int
    gradient_checkpointing: bool | str
    steps: int
    warmup: int
    peak_tflops: float | None
    matmul_tflops: float | None
    kernels: str
    note: str | None
    versions: dict[str, str | None]
    date: str
    rows: list[StepRow] = field(default_factory=list)
    pairs: dict[str, Any] | None = None
    """A preference recipe's synthetic pairs: `objective`, `pairs` per step, `prompt_len`,
    `answer_len`, `length_spread`, `seed`, `packs`, `micro_batches`, and with a spread the `drawn`
    lengths of each pair (prompt, then its answers; None without) (None for other objectives)."""
    context: dict[str, Any] | None = None
    """`bench step --max-context`: the `limit`, the `longest` single conversation that trained
    (None: none did), and its `tokens_per_s` and `peak_mem_gib`."""

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "rows"}
        data["rows"] = [row.to_dict() for row in self.rows]
        return data


@dataclass
class CapChoice:
    """What one variant runs at under one memory cap: its fastest setting that fits."""

    cap_gib: float
    name: str
    checkpointing: str | None
    tokens_per_s: float | None
    peak_mem_gib: float | None
    fits: bool
    vs_ligertune: float | None = None  # ligertune's tokens/s at this cap over this variant's
    pairs_per_s: float | None = None  # a preference step's rate (None for supervised fine-tuning)


@dataclass
class CapReport:
    """`bench step --memory-cap`: every measured row, and each variant's choice under each cap."""

    step: StepReport  # every measured row, each with its checkpointing
    caps: list[float]
    choices: list[CapChoice]

    def to_dict(self) -> dict[str, Any]:
        return {**self.step.to_dict(), "caps_gib": self.caps, "choices": [dataclasses.asdict(c) for c in self.choices]}


# --------------------------------------------------------------------------------------------------
# either


def describe_error(err: BaseException) -> str:
    """One line for a row that failed: the exception's type and first line ("out of memory" for OOM)."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return "out of memory"
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first}"[:300]
