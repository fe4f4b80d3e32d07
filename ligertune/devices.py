"""Where tensors live: choosing the device and dtype, moving tensors there, giving memory back."""

from __future__ import annotations

import gc
import platform

import torch

from ligertune.errors import UserError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_device(name: str, *, key: str = "train.device") -> torch.device:
    """`auto` is CUDA when available, else the CPU; `cuda` without a GPU is the user's mistake
    (reported under `key`, the recipe key or option that asked for it)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise UserError(f"{key}: must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{key}: cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype | None, device: torch.device | str, *,
                  key: str = "model.dtype") -> torch.dtype:
    """`auto` (or None) is bfloat16 on CUDA and float32 elsewhere; other names (`bfloat16`, `bf16`,
    ...) map to their torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"{key}: must be auto, float32, bfloat16 or float16, got {name!r}")
    return DTYPES[name]


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's with the number of threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def describe_device(device: torch.device, world_size: int = 1) -> str:
    """Where a run trains, as its first line says: `cpu`, or `cuda` with the GPU's name and, for one
    process on a machine of several GPUs, that it uses one of them and how to use them all."""
    if device.type != "cuda":
        return device.type
    name = device_name(device)
    if world_size > 1:
        return f"cuda ({name}, {world_size} processes)"
    visible = torch.cuda.device_count()
    if visible > 1:
        return f"cuda ({name}: 1 of the {visible} GPUs visible; --nproc {visible} trains on all of them)"
    return f"cuda ({name})"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device | str) -> None:
    """Free what dropped objects still hold: Python garbage, then CUDA's cached blocks."""
    gc.collect()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_memory_bytes(device: torch.device) -> int:
    """What this process may take of the CUDA device's memory: all of it, or the part
    `cap_device_memory` left it."""
    index = _cuda_index(device)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    return int(torch.cuda.get_device_properties(index).total_memory * fraction)


def cap_device_memory(device: torch.device, gib: float, *, option: str = "--device-memory") -> None:
    """Let this process's CUDA allocator take at most `gib` GiB of the device, as a card of that
    size would (the CUDA context, outside the allocator, comes on top)."""
    if device.type != "cuda":
        raise UserError(f"{option}: caps a CUDA device's memory; the device here is {device.type}")
    index = _cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    if not 0 < gib * 2**30 <= total:
        raise UserError(f"{option} {gib:g}: must be above 0 and at most this device's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, index)


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, `cuda` alone naming the current one (torch's memory-fraction
    calls take only an index)."""
    return torch.cuda.current_device() if device.index is None else device.index


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; from host memory to a GPU through pinned memory, so that the copy is
    queued on the stream and the host goes on (a copy from pageable memory waits for the device)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def device_count(count: int | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A count as an int64 tensor on `device`; one from the host by a fill, not a copy: a copy from the
    host's pageable memory would wait for the work queued on the device."""
    if isinstance(count, torch.Tensor):
        return count.to(device)
    return torch.full((), count, dtype=torch.int64, device=device)
