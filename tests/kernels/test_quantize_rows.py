"""Rows to float8 with a scale per row (`ligertune.kernels.quantize_rows`), on both paths: each row's
scale is its largest magnitude over 448, and every element comes back within e4m3's rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE

from ligertune.kernels import quantize_rows, quantize_transposed, transpose_float8


def rows_of_many_ranges(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[0, 0] = 0.0
    return x.to(dtype).to(DEVICE)


def assert_within_rounding(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """e4m3 keeps 3 bits of mantissa: a normal value within 2^-4 of itself; below 2^-6 (in the scaled
    units) values are subnormal, spaced 2^-9 apart."""
    xf = x.double()
    amax = xf.abs().amax(dim=1)
    assert torch.allclose(scale.double(), amax.clamp_min(1e-12) / 448, rtol=1e-6, atol=0)
    back = q.double() * scale.double()[:, None]
    assert (back - xf).abs().le(2**-4 * xf.abs() + 2**-10 * scale.double()[:, None] + 1e-30).all()
    assert q.double().abs().amax(dim=1).eq(torch.where(amax > 0, 448.0, 0.0)).all()  # the largest maps to 448


@pytest.mark.parametrize("shape", [(7, 100), (3, 5000), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_row_is_its_scale_times_float8_values(kernel_path, shape, dtype):
    x = rows_of_many_ranges(*shape, dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (shape[0],)
    assert scale.dtype == torch.float32
    assert_within_rounding(x, q, scale)


def test_a_column_scale_multiplies_each_column_first(kernel_path):
    x = rows_of_many_ranges(5, 300, torch.bfloat16)
    col_scale = torch.rand(300, generator=torch.Generator().manual_seed(3)).add_(0.01).to(DEVICE)
    q, scale = quantize_rows(x, col_scale)
    assert_within_rounding(x.float() * col_scale, q, scale)


def test_strided_rows_and_zero_rows(kernel_path):
    wide = rows_of_many_ranges(6, 700, torch.bfloat16)
    wide[2] = 0
    x = wide[:, 100:600]  # rows 700 apart
    q, scale = quantize_rows(x)
    assert_within_rounding(x, q, scale)
    assert q[2].float().eq(0).all()


def test_both_paths_agree(monkeypatch):
    x = rows_of_many_ranges(9, 1000, torch.bfloat16)
    out = {}
    for path in ("triton", "reference"):
        monkeypatch.setenv("LIGERTUNE_KERNELS", path)
        out[path] = quantize_rows(x)
    (q_t, s_t), (q_r, s_r) = out["triton"], out["reference"]
    assert torch.equal(s_t, s_r)
    assert torch.equal(q_t.view(torch.uint8), q_r.view(torch.uint8))  # nearest, ties to even, on both


def test_rounding_is_to_nearest_ties_to_even_across_binades(kernel_path):
    """Values just below a power of two round up into the next binade; halfway values go to the
    even neighbour; below 2^-6 (in float8 units) the grid is 2^-9."""
    values = [448.0, 31.5, 31.0, 30.9, 17.0, 19.0, 15.5, 0.0146, 0.0107, 2**-10, 2**-10 * 3, 1.0625, 1.1875]
    x = torch.tensor([values + [-v for v in values]], dtype=torch.float32, device=DEVICE)
    q, scale = quantize_rows(x)
    assert scale.item() == 1.0  # the row's largest is 448: the values themselves are cast
    expected = torch.tensor([values + [-v for v in values]]).to(torch.float8_e4m3fn)
    assert q.float().cpu().tolist() == expected.float().tolist()
    assert expected.float()[0, :4].tolist() == [448.0, 32.0, 32.0, 30.0]  # 31 is halfway: to even


@pytest.mark.parametrize("heights", [(5, 2), (7, 3, 3), (2, 1, 4, 3)], ids=["two", "three", "four"])
def test_several_matrices_are_cast_as_their_rows_stacked(kernel_path, heights):
    """q, k and v's weights cast as one, each read from its own place (rows of any stride): the values
    and scales of their stack, bit for bit."""
    wide = rows_of_many_ranges(sum(heights), 500, torch.bfloat16)
    parts = list(wide.split(heights))
    parts[-1] = rows_of_many_ranges(heights[-1], 700, torch.bfloat16)[:, 100:600]  # rows 700 apart
    q, scale = quantize_rows(parts)
    q_stacked, scale_stacked = quantize_rows(torch.cat(parts))
    assert torch.equal(q.view(torch.uint8), q_stacked.view(torch.uint8)) and torch.equal(scale, scale_stacked)
    assert_within_rounding(torch.cat(parts), q, scale)


def test_only_matrices(kernel_path):
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.ones(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"one width, got shapes \(2, 3\), \(2, 4\)"):
        quantize_rows([torch.ones(2, 3, device=DEVICE), torch.ones(2, 4, device=DEVICE)])


@pytest.mark.parametrize("shape", [(64, 64), (100, 37), (1, 300), (130, 1), (0, 5)])
def test_the_float8_transpose_is_torchs_bit_for_bit(kernel_path, shape):
    q, _ = quantize_rows(rows_of_many_ranges(max(shape[0], 1), shape[1], torch.float32)[: shape[0]])
    out = transpose_float8(q)
    assert out.shape == shape[::-1] and out.dtype == q.dtype and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), q.t().contiguous().view(torch.uint8))


FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("shape", [(100, 48), (16, 200), (1, 64), (130, 5)])
def test_the_transposed_cast_is_one_scale_and_padded_rows(kernel_path, dtype, shape):
    """x^T in float8 with the tensor's largest magnitude at the format's largest, the token side
    padded with zeros to a multiple of 16, every element within the format's rounding."""
    x = rows_of_many_ranges(*shape, torch.bfloat16)
    q, scale = quantize_transposed(x, dtype)
    rows, cols = shape
    largest = torch.finfo(dtype).max
    assert q.dtype == dtype and q.shape == (cols, -(-rows // 16) * 16) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.dim() == 0
    xf = x.double().cpu()
    assert scale.item() == pytest.approx(xf.abs().max().item() / largest, rel=1e-6)
    back = q.double().cpu()[:, :rows].t() * scale.item()
    bits, tiny = (3, 2.0**-10) if dtype == torch.float8_e4m3fn else (2, 2.0**-17)
    assert (back - xf).abs().le(2.0 ** -(bits + 1) * xf.abs() + tiny * scale.item() + 1e-30).all()
    assert q.float().abs().max().item() == largest
    assert q[:, rows:].float().eq(0).all()


@pytest.mark.parametrize("dtype", FORMATS)
def test_both_paths_cast_transposed_alike(monkeypatch, dtype):
    """Bit for bit, subnormals, halfway values and a strided input included."""
    wide = rows_of_many_ranges(37, 300, torch.bfloat16)
    wide[5, 7] = 0.0
    x = wide[:, 20:260]
    out = {}
    for path in ("triton", "reference"):
        monkeypatch.setenv("LIGERTUNE_KERNELS", path)
        out[path] = quantize_transposed(x, dtype)
    (q_t, s_t), (q_r, s_r) = out["triton"], out["reference"]
    assert torch.equal(s_t, s_r)
    assert torch.equal(q_t.view(torch.uint8), q_r.view(torch.uint8))


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_transposed_cast_rounds_to_nearest_even(kernel_path, dtype):
    largest = torch.finfo(dtype).max
    if dtype == torch.float8_e4m3fn:
        values = [largest, 31.5, 31.0, 30.9, 17.0, 19.0, 0.0146, 2**-10, 2**-10 * 3, 1.0625, 1.1875]
    else:  # 2 bits of mantissa: 7 lies halfway between 6 and 8, 5 between 4 and 6
        values = [largest, 7.0, 5.0, 6.9, 2.0**-15, 2.0**-17 * 3, 2.0**-14 * 1.125, 1.125, 1.375]
    x = torch.tensor([values + [-v for v in values]], dtype=torch.float32, device=DEVICE).t()  # one column
    q, scale = quantize_transposed(x, dtype)
    assert scale.item() == 1.0
    expected = torch.tensor(values + [-v for v in values]).to(dtype).float()
    assert q.float().cpu()[0, : len(expected)].tolist() == expected.tolist()


def test_the_transposed_cast_refuses_other_formats():
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize_transposed(torch.ones(4, 4), torch.bfloat16)
