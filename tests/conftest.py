"""Fixtures shared across the suite, and the Triton mode of the whole run.

Triton's kernels run on the CPU through its interpreter (TRITON_INTERPRET=1), which must be set
before anything imports triton: peft imports bitsandbytes, which imports triton, so any test module
that imports peft would otherwise fix triton's mode before tests/kernels is collected. This conftest
is imported before every test module. An explicit TRITON_INTERPRET=0 (on a GPU machine) runs the
same tests on the compiled kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from tiny_recipe import write_recipe  # noqa: E402


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path)
