"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before anything imports triton: tests/conftest.py sets it for the
whole suite, and this conftest again for a run of this folder alone. An explicit TRITON_INTERPRET=0
(on a GPU machine) runs the same tests on the compiled kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(params=["triton", "reference"])
def kernel_path(request, monkeypatch) -> str:
    """Run a test once per path, forced through LIGERTUNE_KERNELS; the value is the path's name."""
    monkeypatch.setenv("LIGERTUNE_KERNELS", request.param)
    return request.param


@pytest.fixture
def triton_path(monkeypatch) -> None:
    """Force the Triton path (interpreted on the CPU, compiled on CUDA)."""
    monkeypatch.setenv("LIGERTUNE_KERNELS", "triton")
