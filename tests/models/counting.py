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


class DownProducts(TorchDispatchMode):
    """How many GEMMs compute down_proj's product h W^T: [T, intermediate] x [intermediate, hidden],
    W^T a transposed view (gate's and up's input gradients, of the same shapes, multiply W itself)."""

    def __init__(self, intermediate: int, hidden: int):
        super().__init__()
        self.shape, self.count = (intermediate, hidden), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            b = args[-1]
            self.count += tuple(b.shape) == self.shape and b.stride() == (1, self.shape[0])
        return func(*args, **(kwargs or {}))
