"""The GPU tests: kernels and a small model at realistic sizes, on CUDA, with compiled Triton kernels.

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/gpu -q

Every test here is marked `gpu` and skipped, with its reason, where it could not mean anything:
without CUDA (the CPU suite), or under TRITON_INTERPRET=1 (which tests/kernels/conftest.py sets when
the whole suite runs), where Triton's interpreter would run the kernels at these sizes for hours.
"""

from __future__ import annotations

import os

import pytest
import torch

from ligertune.devices import release_memory


@pytest.fixture(autouse=True)
def _on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (realistic sizes, compiled Triton kernels)")
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET=1 would run the kernels in Triton's interpreter: "
                    "run the GPU tests with TRITON_INTERPRET=0")
    yield
    # The next test's inputs are gigabytes too: give this one's back first.
    release_memory("cuda")
