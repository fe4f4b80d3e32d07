"""What `ligertune bench kernels` returns: one row per implementation, kernel and shape, and the report
that holds the rows with what a reader needs to trust them (the schema of `--json`); and the one
line that says why a row, of either bench, failed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ligertune.bench.timing import Timing


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


def describe_error(err: BaseException) -> str:
    """One line for a row that failed: the exception's type and first line ("out of memory" for OOM)."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return "out of memory"
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first}"[:300]
