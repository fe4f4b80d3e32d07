"""Moving tensors to the device without making the host wait."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; from host memory to a GPU through pinned memory, so that the copy is
    queued on the stream and the host goes on (a copy from pageable memory waits for the device)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
