"""Fixtures of the model tests; the tiny models themselves are in `tiny_models`."""

from __future__ import annotations

import pytest
from tiny_models import PackedBatch, make_packed_batch


@pytest.fixture
def packed_batch() -> PackedBatch:
    """Four conversations of 7, 3, 9 and 5 tokens in one row."""
    return make_packed_batch([7, 3, 9, 5])
