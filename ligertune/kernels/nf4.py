"""4-bit weights back to 16 bits: QLoRA's NF4 codes in bitsandbytes' layout, in one pass.

bitsandbytes stores a [N, K] weight as N K / 2 bytes, two 4-bit codes a byte (the first weight in
the high half), and a scale for each block of `blocksize` weights (64), its largest magnitude:

    w_i = table[code_i] * scale_{i // blocksize}

where `table` holds the 16 NF4 values. Double quantization stores the scales themselves as one
byte each, in blocks of 256 with a float32 scale of their own and the mean taken out:

    scale_b = code[absmax_b] * absmax2_{b // 256} + offset

bitsandbytes dequantizes in two kernels (the scales into a float32 buffer, then the weights); here
one program reads 1024 bytes of codes, their scales' bytes, and writes 2048 weights in the output's
dtype, straight into the rows of the buffer it is given (a joined one: `Nf4Siblings`). The products
are float32, rounded once to the output's dtype, as bitsandbytes' are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ligertune.kernels.types import BlockScales

BLOCK_BYTES = 1024


@triton.jit
def _round_to_bfloat16(v):
    """v (float32, finite) rounded to the nearest bfloat16, ties to even, still in float32, so that
    the cast after it is exact: for Triton's interpreter, which truncates; a GPU's conversion rounds
    to nearest even itself (`SOFTWARE_ROUNDING`)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_4bit_kernel(packed_ptr, table_ptr, absmax_ptr, code_ptr, absmax2_ptr, offset_ptr, out_ptr,
                            n_bytes, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                            NESTED_BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    inside = offsets < n_bytes
    packed = tl.load(packed_ptr + offsets, mask=inside, other=0).to(tl.int32)
    block = offsets * 2 // BLOCKSIZE
    if NESTED:
        scale_code = tl.load(absmax_ptr + block, mask=inside, other=0).to(tl.int32)
        scale = tl.load(code_ptr + scale_code) * tl.load(absmax2_ptr + block // NESTED_BLOCKSIZE, mask=inside,
                                                         other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=inside, other=0.0)
    high = tl.load(table_ptr + (packed >> 4)) * scale
    low = tl.load(table_ptr + (packed & 15)) * scale
    weights = tl.interleave(high, low)
    if SOFTWARE_ROUNDING and out_ptr.dtype.element_ty == tl.bfloat16:
        weights = _round_to_bfloat16(weights)
    out = start * 2 + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out, weights.to(out_ptr.dtype.element_ty), mask=out < n_bytes * 2)


def dequantize_4bit(packed: torch.Tensor, table: torch.Tensor, scales: BlockScales,
                    out: torch.Tensor) -> torch.Tensor:
    """`out` (contiguous, 2 weights a byte of `packed`, as `kernels.dequantize_4bit` checks) filled
    with the weights; see the module docstring."""
    nested = scales.code is not None
    grid = (triton.cdiv(packed.numel(), BLOCK_BYTES),)
    _dequantize_4bit_kernel[grid](
        packed, table, scales.absmax,
        scales.code if nested else table, scales.absmax2 if nested else table, scales.offset if nested else table,
        out, packed.numel(), BLOCKSIZE=scales.blocksize, NESTED=nested, NESTED_BLOCKSIZE=scales.nested_blocksize,
        BLOCK=BLOCK_BYTES, SOFTWARE_ROUNDING=out.device.type != "cuda",
        enable_fp_fusion=False,  # the scale's product and sum rounded apart, as bitsandbytes'
    )
    return out
