"""The learning-rate schedule: warmup in steps or as a share of the run, a warmup longer than the run
cut to it (with the warning a run prints), and the decay shapes against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from ligertune.errors import RecipeError
from ligertune.recipe import recipe_from_dict
from ligertune.training.build import build_scheduler, schedule_warnings
from ligertune.training.optim import warmup_length


def optim(**values):
    return recipe_from_dict({"model": {"config": "tiny-llama"}, "data": {"path": "x.jsonl"}, "optim": values}).optim


def lrs(cfg, total_steps: int, lr: float = 1.0) -> list[float]:
    """The learning rate of every step of a run, as the built scheduler gives it."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    scheduler = build_scheduler(optimizer, cfg, total_steps=total_steps)
    rates = []
    for _ in range(total_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    ("values", "total_steps", "expected"),
    [
        pytest.param({"warmup_steps": 4}, 100, 4, id="steps"),
        pytest.param({"warmup_steps": 50}, 10, 10, id="steps-cut-to-the-run"),
        pytest.param({"warmup_ratio": 0.05}, 1000, 50, id="ratio"),
        pytest.param({"warmup_ratio": 0.05}, 10, 1, id="ratio-rounded-up"),
        pytest.param({"warmup_ratio": 0.1}, 30, 3, id="ratio-float-noise"),  # 0.1 x 30 = 3.0000000000000004
        pytest.param({"warmup_ratio": 0.5}, 1, 1, id="ratio-of-one-step"),
        pytest.param({}, 10, 0, id="none"),
    ],
)
def test_warmup_length(values, total_steps, expected):
    assert warmup_length(optim(**values), total_steps) == expected


def test_warmup_then_cosine_follows_the_formula():
    cfg = optim(warmup_steps=3, schedule="cosine", min_lr_ratio=0.1)
    expected = [1 / 4, 2 / 4, 3 / 4] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(7)]
    assert lrs(cfg, 10, lr=2.0) == pytest.approx([2.0 * e for e in expected], rel=1e-12)


def test_a_warmup_longer_than_the_run_is_cut_to_it_and_said():
    """A smoke run of 10 steps of a recipe with 50 warmup steps: the learning rate rises over the run
    as a 10-step warmup would make it (not 1/51 of the way per step), and a warning says so."""
    cut, ten = optim(warmup_steps=50), optim(warmup_steps=10)
    assert lrs(cut, 10) == lrs(ten, 10) == pytest.approx([(k + 1) / 11 for k in range(10)])
    (warning,) = schedule_warnings(cut, 10)
    assert warning.startswith("optim.warmup_steps: 50 warmup steps is longer than the run (10 steps): "
                              "the warmup is cut to 10")
    assert schedule_warnings(ten, 10) == []  # as long as the run: as asked


def test_a_warmup_ratio_scales_with_the_run_and_never_warns():
    cfg = optim(warmup_ratio=0.2, schedule="linear")
    long, short = lrs(cfg, 100), lrs(cfg, 10)
    assert long[:21] == pytest.approx([(k + 1) / 21 for k in range(20)] + [1.0])
    assert short[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert schedule_warnings(cfg, 10) == schedule_warnings(cfg, 1) == []


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param({"warmup_ratio": 1.0}, "optim.warmup_ratio: must be in [0, 1), got 1.0", id="ratio-one"),
        pytest.param({"warmup_ratio": -0.1}, "optim.warmup_ratio: must be in [0, 1), got -0.1", id="negative"),
        pytest.param({"warmup_ratio": 0.1, "warmup_steps": 5},
                     "optim.warmup_ratio: give `warmup_steps` (5) or `warmup_ratio` (0.1), not both: set the "
                     "other to 0", id="both"),
    ],
)
def test_warmup_ratio_is_validated(values, expected):
    with pytest.raises(RecipeError) as info:
        optim(**values)
    assert info.value.problems == [expected]


def test_a_warmup_longer_than_max_steps_is_a_valid_recipe():
    recipe = recipe_from_dict({"model": {"config": "tiny-llama"}, "data": {"path": "x.jsonl"},
                               "optim": {"warmup_steps": 50}, "train": {"max_steps": 10}})
    assert recipe.optim.warmup_steps == 50
