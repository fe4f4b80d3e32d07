"""Fixtures shared across the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_recipe import write_recipe


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path)
