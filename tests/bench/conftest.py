"""Bench tests run on the CPU at tiny shapes; the peers are made absent unless a test says otherwise."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def no_peers(monkeypatch):
    """Liger-Kernel, Cut Cross-Entropy, lion-pytorch and TRL fail to import, whether or not they are
    installed."""
    for name in ("liger_kernel", "cut_cross_entropy", "lion_pytorch", "trl"):
        monkeypatch.setitem(sys.modules, name, None)
