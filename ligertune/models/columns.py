"""Column slices of one joined output (a joined GEMM's: q, k, v; gate and up) whose gradients come
back as one buffer without a copy where they are themselves its adjacent column slices."""

from __future__ import annotations

import itertools

import torch


def split_columns(y: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """`y.split(sizes, dim=-1)`, differentiable; see `_SplitColumns`."""
    return _SplitColumns.apply(y, sizes)


class _SplitColumns(torch.autograd.Function):
    """y split into column slices (views), as `torch.split`, whose backward takes gradients that are
    themselves adjacent column slices of one buffer (SwiGLU's, written over gate and up) as that
    buffer, where `torch.split`'s would copy them into a new one."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, sizes: list[int]):
        ctx.sizes = sizes
        return tuple(y.split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        joined = _adjacent(grads, ctx.sizes)
        if joined is None:
            like = next(g for g in grads if g is not None)
            parts = [g if g is not None else like.new_zeros(*like.shape[:-1], n) for g, n in zip(grads, ctx.sizes)]
            joined = torch.cat(parts, dim=-1)
        return joined, None


def _adjacent(grads, sizes: list[int]) -> torch.Tensor | None:
    """The one buffer whose consecutive column slices `grads` are, or None."""
    if any(g is None for g in grads):
        return None
    first, width = grads[0], sum(sizes)
    if first.dim() < 2 or first.stride(-1) != 1 or first.stride(-2) != width:
        return None
    offset = first.storage_offset()
    for g, start in zip(grads, itertools.accumulate([0, *sizes[:-1]])):
        if (g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or g.stride() != first.stride()
                or g.shape[:-1] != first.shape[:-1] or g.storage_offset() != offset + start):
            return None
    return first.as_strided((*first.shape[:-1], width), first.stride(), offset)
