"""Counters of the operations a forward or backward dispatches, for the model tests."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Additions(TorchDispatchMode):
    """How many additions write a tensor whose last dimension is one of `widths`."""

    def __init__(self, widths: set[int]):
        super().__init__()
        self.widths, self.count = widths, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor) and out.shape[-1] in self.widths:
            self.count += 1
        return out
