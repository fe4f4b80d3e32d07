"""4-bit weights back to 16 bits (`ligertune.kernels.dequantize_4bit`), on both paths: each weight is
its code's table value times its block's scale, against an element-by-element oracle of the layout
(two codes a byte, the high half first; double-quantized scales) and against bitsandbytes' own
`dequantize_4bit` for the weights it quantizes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from kernel_testing import DEVICE

from ligertune.kernels import BlockScales, dequantize_4bit

needs_bitsandbytes = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                        reason="bitsandbytes is not installed (pip install 'ligertune[qlora]')")


def oracle(packed: np.ndarray, table: np.ndarray, scales: dict, blocksize: int) -> np.ndarray:
    """float32 weights, one at a time, as the layout defines them."""
    weights = np.empty(2 * packed.size, dtype=np.float32)
    for i in range(weights.size):
        byte = int(packed[i // 2])
        code = byte >> 4 if i % 2 == 0 else byte & 15
        block = i // blocksize
        if "code" in scales:
            scale = np.float32(scales["code"][scales["absmax"][block]] * scales["absmax2"][block // 256])
            scale = np.float32(scale + scales["offset"])
        else:
            scale = scales["absmax"][block]
        weights[i] = np.float32(table[code] * scale)
    return weights


@pytest.mark.parametrize("nested", [False, True], ids=["scales", "double-quantized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_weight_is_its_codes_value_times_its_blocks_scale(kernel_path, nested, dtype):
    """200 rows of 96 weights: blocks of 64 straddle the rows; 300 blocks, so that the double-quantized
    scales span two blocks of 256; 10 programs of the kernel, the last partial."""
    gen = torch.Generator().manual_seed(0)
    cols, blocksize = 96, 64
    n_bytes = 300 * blocksize // 2
    rows = n_bytes * 2 // cols
    packed = torch.randint(0, 256, (n_bytes, 1), generator=gen, dtype=torch.uint8)
    table = torch.sort(torch.randn(16, generator=gen)).values
    blocks = n_bytes * 2 // blocksize
    if nested:
        parts = {"absmax": torch.randint(0, 256, (blocks,), generator=gen, dtype=torch.uint8),
                 "code": torch.sort(torch.rand(256, generator=gen)).values,
                 "absmax2": torch.rand(2, generator=gen) + 0.5, "offset": torch.tensor(0.25)}
        scales = BlockScales(parts["absmax"].to(DEVICE), blocksize, parts["code"].to(DEVICE),
                             parts["absmax2"].to(DEVICE), parts["offset"].to(DEVICE))
    else:
        parts = {"absmax": torch.rand(blocks, generator=gen) * 3}
        scales = BlockScales(parts["absmax"].to(DEVICE), blocksize)
    out = torch.full((rows, cols), float("nan"), dtype=dtype, device=DEVICE)
    dequantize_4bit(packed.to(DEVICE), table.to(DEVICE), scales, out)
    expected = oracle(packed.numpy().ravel(), table.numpy(), {k: v.numpy() for k, v in parts.items()}, blocksize)
    assert torch.equal(out.cpu(), torch.from_numpy(expected).view(rows, cols).to(dtype))


def test_the_output_must_hold_two_weights_a_byte(kernel_path):
    packed = torch.zeros(32, 1, dtype=torch.uint8, device=DEVICE)
    scales = BlockScales(torch.ones(1, device=DEVICE), 64)
    with pytest.raises(ValueError, match="2 weights a byte"):
        dequantize_4bit(packed, torch.zeros(16, device=DEVICE), scales, torch.empty(8, 4, device=DEVICE))


@needs_bitsandbytes
@pytest.mark.parametrize("nested", [False, True], ids=["scales", "double-quantized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(192, 128), (100, 64), (1408, 512)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_equals_bitsandbytes(kernel_path, shape, dtype, nested):
    """The weights bitsandbytes' own dequantization gives for what it quantized (NF4, blocks of 64,
    double quantization in blocks of 256), bit for bit; in float16 within one unit of the last place
    (Triton's interpreter truncates a float16 cast where the hardware rounds it)."""
    import bitsandbytes as bnb

    from ligertune.models.quantize import block_scales

    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(shape, generator=gen) * torch.logspace(-2, 1, shape[0])[:, None]).to(dtype).to(DEVICE)
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
    expected = bnb.functional.dequantize_4bit(packed, state)
    out = torch.empty(shape, dtype=dtype, device=DEVICE)
    dequantize_4bit(packed, state.code, block_scales(state), out)
    if dtype == torch.float16:
        assert ((out.float() - expected.float()).abs() <= expected.float().abs() * 2**-10).all()
    else:
        assert torch.equal(out, expected)
