"""The Lion optimizer step in Triton, over many tensors per launch (Chen et al. 2023, "Symbolic
Discovery of Optimization Algorithms", Algorithm 2, with decoupled weight decay).

For each parameter p, its gradient g and its momentum m, elementwise:

    c = beta1 m + (1 - beta1) g
    p <- p - lr (sign(c) + weight_decay p)          sign(0) = 0; NaN where c is not finite
    m <- beta2 m + (1 - beta2) g

Each element of p, g and m is read once and p and m are written once, in float32 whatever the
storage; so the step costs (2 s_p + s_g + 2 s_m) bytes per element, its memory roofline (20 bytes
for float32 p, g, m; 14 for bfloat16 p and g with float32 m).

Multi-tensor apply: a model has hundreds of parameter tensors, many of them small (norms, biases),
and one launch per tensor would cost more in launch overhead than the small ones move. One launch
covers every tensor of one dtype combination. The host writes a small int64 table, one column per
tensor (addresses of p, g, m, element count, index of its first block), copied to the device in one
transfer; the grid is the flat list of all tensors' blocks, and each program finds its tensor by a
binary search of the first-block column (log2(tensors) scalar loads, from L2). This keeps the
device-side metadata to 40 bytes per tensor, whatever the tensors' sizes, where a table with one
entry per block would grow with the model and a 2-D (tensor, block) grid would launch mostly idle
programs for the small tensors beside the embedding. On an H100 the step moves 3.03 TB/s, a device
copy's bandwidth (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.devices import to_device
from ligertune.kernels.reference import check_lion_args

BLOCK = 4096
"""Elements per program: 16 per thread at 8 warps, i.e. whole 16-byte accesses in any dtype. Of the
sizes 1024 to 8192 and 4 to 16 warps measured on an H100, this one reached the copy bandwidth for
bf16 and for fp32 parameters alike."""

NUM_WARPS = 8

ALIGNMENT = 16
"""Bytes: when every address of a launch is a multiple of this, the kernel may use vector accesses."""

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

_TABLE_ROWS = 5
"""Rows of the tensor table: param, grad and momentum addresses, element count, first block."""


@triton.jit
def _lion_apply(
    p_ptr, g_ptr, m_ptr, offs, mask, lr, decay, w1, w2, P_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr
):
    """One block of the update; `mask` is None for a whole block (unmasked, vectorizable accesses)."""
    b_p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    b_g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    b_m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    # beta m + (1 - beta) g as a lerp with weight w = 1 - beta, the form of the reference's torch.lerp.
    b_c = b_m + w1 * (b_g - b_m)
    # 0 * c is NaN where c is NaN or infinite: a bad gradient must turn p NaN, not freeze it (see reference).
    b_u = tl.where(b_c > 0.0, 1.0, tl.where(b_c < 0.0, -1.0, 0.0)) + 0.0 * b_c
    tl.store(p_ptr + offs, (b_p * decay - lr * b_u).to(P_DTYPE), mask=mask)
    tl.store(m_ptr + offs, (b_m + w2 * (b_g - b_m)).to(M_DTYPE), mask=mask)


@triton.jit
def _lion_kernel(
    table_ptr,
    n_tensors,
    lr,
    decay,
    w1,
    w2,
    P_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 before multiplying by BLOCK: element offsets into one tensor may pass 2^31.
    pid = tl.program_id(0).to(tl.int64)
    first_ptr = table_ptr + 4 * n_tensors

    # This program's tensor: the last one whose first block is <= pid (the host drops empty tensors,
    # so first blocks strictly increase).
    lo = 0
    hi = n_tensors - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(first_ptr + mid) <= pid:
            lo = mid
        else:
            hi = mid - 1

    p_ptr = tl.load(table_ptr + lo).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(table_ptr + n_tensors + lo).to(tl.pointer_type(P_DTYPE))
    m_ptr = tl.load(table_ptr + 2 * n_tensors + lo).to(tl.pointer_type(M_DTYPE))
    if ALIGNED:
        # Addresses read from memory carry no alignment facts for the compiler; the host checked them.
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
    n_elements = tl.load(table_ptr + 3 * n_tensors + lo)
    start = (pid - tl.load(first_ptr + lo)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    # Element counts come from memory, so a mask would be opaque to the compiler and split every
    # access into single elements: only the last block of a tensor is masked.
    if start + BLOCK <= n_elements:
        _lion_apply(p_ptr, g_ptr, m_ptr, offs, None, lr, decay, w1, w2, P_DTYPE, M_DTYPE)
    else:
        _lion_apply(p_ptr, g_ptr, m_ptr, offs, offs < n_elements, lr, decay, w1, w2, P_DTYPE, M_DTYPE)


def _launch(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: list[torch.Tensor],
    scalars: tuple[float, float, float, float],
) -> None:
    """One launch over contiguous, non-empty tensors of one (param, momentum) dtype pair; `scalars`
    are the kernel's (lr, decay, w1, w2)."""
    # Plain integer division: triton.cdiv is a constexpr function, costly to call per tensor from the host.
    blocks = [(p.numel() + BLOCK - 1) // BLOCK for p in params]
    first_blocks = [0]
    for n in blocks[:-1]:
        first_blocks.append(first_blocks[-1] + n)
    addresses = [t.data_ptr() for ts in (params, grads, moments) for t in ts]
    table = torch.tensor(
        addresses + [p.numel() for p in params] + first_blocks, dtype=torch.int64
    ).view(_TABLE_ROWS, len(params))
    table = to_device(table, params[0].device)
    _lion_kernel[(sum(blocks),)](
        table, len(params), *scalars,
        P_DTYPE=_TL_DTYPES[params[0].dtype],
        M_DTYPE=_TL_DTYPES[moments[0].dtype],
        ALIGNED=all(a % ALIGNMENT == 0 for a in addresses),
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


@torch.no_grad()
def lion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: list[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
) -> None:
    """One Lion step in place over lists of tensors on one device: the semantics of `reference.lion_step`.

    One launch per (param dtype, momentum dtype) pair present, over all tensors of that pair. The
    kernel addresses flat memory: a non-contiguous tensor (rare: parameters and the optimizer's
    moments are contiguous) is updated through a contiguous copy that is copied back, which is
    correct at the price of that traffic.
    """
    check_lion_args(params, grads, moments, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    buckets: dict[tuple[torch.dtype, torch.dtype], tuple[list, list, list]] = {}
    write_back = []
    for p, g, m in zip(params, grads, moments):
        if p.numel() == 0:
            continue
        p_flat, m_flat = p.contiguous(), m.contiguous()
        write_back += [(t, flat) for t, flat in ((p, p_flat), (m, m_flat)) if flat is not t]
        ps, gs, ms = buckets.setdefault((p.dtype, m.dtype), ([], [], []))
        ps.append(p_flat)
        gs.append(g.contiguous())
        ms.append(m_flat)
    # Folded on the host in float64, then passed as float32.
    scalars = (lr, 1.0 - lr * weight_decay, 1.0 - beta1, 1.0 - beta2)
    for ps, gs, ms in buckets.values():
        _launch(ps, gs, ms, scalars)
    for t, flat in write_back:
        t.copy_(flat)
