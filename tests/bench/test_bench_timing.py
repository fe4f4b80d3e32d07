"""The timing helper and the error measure that every bench row relies on."""

from __future__ import annotations

import math

import pytest
import torch

from ligertune.bench.timing import measure
from ligertune.numerics import relative_error


def _matmuls(n_products: int, size: int = 96):
    a = torch.randn(size, size)

    def fn():
        x = a
        for _ in range(n_products):
            x = a @ x
        return x

    return fn


@pytest.mark.parametrize("warmup, repeats", [pytest.param(0, 1, id="w0-r1"), pytest.param(2, 5, id="w2-r5")])
def test_measure_counts_calls_and_orders_statistics(warmup, repeats):
    calls, prepared = [], []
    work = _matmuls(3)

    def fn():
        calls.append(1)
        return work()

    timing = measure(fn, device="cpu", warmup=warmup, repeats=repeats, before_each=lambda: prepared.append(1))
    assert len(calls) == warmup + repeats  # no extra memory call off CUDA
    assert len(prepared) == warmup + repeats
    assert timing.repeats == repeats
    assert 0.0 < timing.min_ms <= timing.median_ms <= timing.max_ms
    assert timing.extra_peak_mib is None
    assert timing.clock == "wall clock"


def test_measure_tells_more_work_from_less():
    # 200 times the work, in plain Python (no thread pool to stall); the fastest call of each is
    # compared, which a busy machine can only slow down, never speed up.
    light = measure(lambda: sum(range(2_000)), device="cpu", warmup=1, repeats=7)
    heavy = measure(lambda: sum(range(400_000)), device="cpu", warmup=1, repeats=7)
    assert heavy.min_ms > 5 * light.min_ms


@pytest.mark.parametrize("kwargs", [dict(repeats=0), dict(warmup=-1)], ids=["repeats0", "warmup-1"])
def test_measure_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError):
        measure(lambda: None, device="cpu", **kwargs)


def test_timing_to_dict_has_every_field():
    timing = measure(lambda: None, device="cpu", warmup=0, repeats=2)
    assert set(timing.to_dict()) == {"median_ms", "min_ms", "max_ms", "repeats", "extra_peak_mib", "clock"}


@pytest.mark.parametrize("chunk", [pytest.param(7, id="chunk7"), pytest.param(1 << 24, id="one-chunk")])
def test_relative_error_is_the_norm_ratio(chunk):
    torch.manual_seed(0)
    b = torch.randn(13, 37, dtype=torch.float64)
    a = (b + 1e-3 * torch.randn_like(b)).to(torch.bfloat16)
    want = ((a.double() - b).norm() / b.norm()).item()
    assert relative_error(a, b, chunk=chunk) == pytest.approx(want, rel=1e-9)


def test_relative_error_edge_cases():
    zero = torch.zeros(5)
    assert relative_error(zero, zero) == 0.0
    assert relative_error(torch.ones(5), zero) == math.inf
    assert math.isnan(relative_error(torch.tensor([1.0, float("nan")]), torch.ones(2)))
    assert math.isnan(relative_error(torch.tensor([float("inf"), 1.0]), torch.ones(2)))
    assert math.isnan(relative_error(None, torch.ones(2)))
    with pytest.raises(ValueError):
        relative_error(torch.ones(3), torch.ones(4))
