"""Gradient clipping, global and per tensor, computed by hand on a toy model; and what a run logs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import write_recipe

from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop
from ligertune.training.clipping import clip_gradients

# Gradients chosen so that the norms are exact: ||(3, 4)|| = 5, ||(1, 2, 2)|| = 3, ||(0.6, 0.8)|| = 1,
# and over all of them sqrt(25 + 9 + 1) = sqrt(35).
GRADS = [[[3.0], [4.0]], [1.0, 2.0, 2.0], [0.6, 0.8]]


def toy_model() -> list[torch.nn.Parameter]:
    """Three parameters with the gradients above, and a frozen one without a gradient."""
    params = [torch.nn.Parameter(torch.zeros(torch.tensor(g).shape)) for g in GRADS]
    for p, g in zip(params, GRADS):
        p.grad = torch.tensor(g)
    return [*params, torch.nn.Parameter(torch.ones(2), requires_grad=False)]


def flat(params) -> list[list[float]]:
    return [p.grad.flatten().tolist() for p in params if p.grad is not None]


def scaled(factor: float, g) -> list[float]:
    return [factor * x for x in torch.tensor(g).flatten().tolist()]


@pytest.mark.parametrize("max_norm", [2.0, 4.0, 10.0, None])
def test_global_clipping_by_hand(max_norm):
    """One factor min(1, c / (sqrt(35) + 1e-6)) for every gradient; the norm before clipping is
    sqrt(35); clipping acts on all three tensors when sqrt(35) > c, on none otherwise."""
    params = toy_model()
    clipped = clip_gradients(params, max_norm, "global")
    total = math.sqrt(35)
    factor = 1.0 if max_norm is None else min(1.0, max_norm / (total + 1e-6))
    assert clipped.norm.item() == pytest.approx(total, rel=1e-6)
    assert clipped.tensors.item() == (3 if factor < 1 else 0)
    for got, g in zip(flat(params), GRADS):
        assert got == pytest.approx(scaled(factor, g), rel=1e-6)


@pytest.mark.parametrize("max_norm, acted", [(2.0, 2), (4.0, 1), (0.5, 3), (10.0, 0), (None, 0)])
def test_per_tensor_clipping_by_hand(max_norm, acted):
    """Each gradient on its own: norms 5, 3 and 1, each scaled by min(1, c / (n + 1e-6)); the norm
    reported is still the one over all gradients before clipping."""
    params = toy_model()
    clipped = clip_gradients(params, max_norm, "per_tensor")
    assert clipped.norm.item() == pytest.approx(math.sqrt(35), rel=1e-6)
    assert clipped.tensors.item() == acted
    for got, g, n in zip(flat(params), GRADS, (5.0, 3.0, 1.0)):
        factor = 1.0 if max_norm is None else min(1.0, max_norm / (n + 1e-6))
        assert got == pytest.approx(scaled(factor, g), rel=1e-6)
        if max_norm is not None:
            assert torch.tensor(got).norm().item() <= max_norm * (1 + 1e-6)


def test_a_run_logs_the_norm_before_clipping_and_whether_it_acted(tmp_path: Path):
    """Per-tensor clipping at a limit below every gradient's norm, in a run: each record carries the
    norm before clipping (far above the limit), and that every tensor was clipped."""
    path = write_recipe(tmp_path, train={"max_steps": 2, "eval_every": None},
                        optim={"clip": "per_tensor", "max_grad_norm": 1e-6})
    run = setup(load_recipe(path), Console(quiet=True))
    try:
        train_loop(run)
    finally:
        cleanup(run)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["grad_norm"] > 1e-3 and record["clipped"] is True
        assert record["clipped_tensors"] == len(run.trainable)
