"""`gradient_checkpointing: auto`: the plan's arithmetic, the measurement of a layer's saved
activations, and a run that recomputes part of its layers computing what a run without does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

import ligertune.training.trainer as trainer_module
from ligertune.models import decoder_of
from ligertune.recipe import load_recipe
from ligertune.training.build import enable_gradient_checkpointing
from ligertune.training.checkpoint import read_metrics
from ligertune.training.memory import GIB, SavedBytes, plan_checkpointing, set_checkpointed
from ligertune.training.trainer import cleanup, setup, train_loop
from tiny_recipe import write_recipe


@pytest.mark.parametrize("budget, want", [
    (10_000, (0, True)),  # everything fits: nothing recomputed
    (1_000, (4, True)),  # P(1) = 500; each kept layer adds 90: 1 + floor(500 / 90) = 6 kept
    (590, (8, True)),  # P(1) + 90: 2 kept
    (589, (9, True)),  # just short of it: 1 kept
    (410, (10, True)),  # P(0) = 410 fits exactly
    (409, (10, False)),  # even P(0) is over the budget: recompute all, and say so
])
def test_plan_keeps_as_many_layers_as_the_budget_allows(budget, want):
    layers, activation, checkpointed_input, step_peak = 10, 100, 10, 500  # a kept layer costs 90 more
    assert plan_checkpointing(layers=layers, activation=activation, checkpointed_input=checkpointed_input,
                              step_peak=step_peak, budget=budget) == want


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    enable_gradient_checkpointing(model)
    model.train()
    return model


def layer_saved_bytes(model, tokens: int) -> SavedBytes:
    """What the last layer (not checkpointed) saves in a forward and backward of `tokens` tokens."""
    layers = decoder_of(model).layers
    set_checkpointed(layers, len(layers) - 1)
    saved = SavedBytes(layers[-1], model.parameters())
    with saved.counting():
        model(input_ids=torch.randint(0, 128, (1, tokens))).logits.sum().backward()
    return saved


def test_saved_bytes_counts_one_layers_activations():
    model = tiny_llama()
    small, large = layer_saved_bytes(model, 64), layer_saved_bytes(model, 128)
    assert [layer.gradient_checkpointing for layer in decoder_of(model).layers] == [True, True, False]
    assert (small.input, large.input) == (64 * 32 * 4, 128 * 32 * 4)  # the input: [1, T, 32] float32
    # The layer saves several tensors of its input's size (norm, projections, MLP); its weights
    # are not counted. Attention here is linear in T (sdpa saves its output and log-sum-exp).
    assert 4 * small.input < small.activation < 100 * small.input
    assert large.activation == pytest.approx(2 * small.activation, rel=0.05)


class FakeAllocator:
    """Allocator statistics made up so that the budget leaves exactly one layer un-checkpointed."""

    device = torch.device("cpu")

    def __init__(self, budget: int):
        self.budget, self.state, self.calls = budget, 1000, 0

    def reset_peak(self) -> None:
        pass

    def allocated(self) -> int:
        self.calls += 1
        return 10**6 + (self.state if self.calls > 1 else 0)  # the first update allocates `state`

    def peak(self) -> int:
        return self.budget - self.state - 10  # P(1) + S just under the budget: one layer kept


def test_auto_recomputes_what_the_budget_requires_and_computes_the_same(tmp_path: Path, monkeypatch):
    budget_gib = 1.0
    monkeypatch.setattr(trainer_module, "device_allocator", lambda device: FakeAllocator(int(budget_gib * GIB)))
    path = write_recipe(tmp_path, train={"max_steps": 3, "gradient_checkpointing": "auto",
                                         "memory_budget_gib": budget_gib})
    runs = {}
    for name, overrides in (("auto", []), ("off", ["train.gradient_checkpointing=false",
                                                     "train.memory_budget_gib=null"])):
        run = setup(load_recipe(path, [*overrides, f"output.dir={tmp_path / name}"]), Console(quiet=True))
        try:
            train_loop(run)
        finally:
            cleanup(run)
        runs[name] = run
    auto = runs["auto"]
    plan = auto.checkpointing.plan
    assert (plan.layers, plan.checkpointed) == (2, 1)
    assert [layer.gradient_checkpointing for layer in decoder_of(auto.model).layers] == [True, False]
    records = [r for r in read_metrics(tmp_path / "auto" / "metrics.jsonl") if "loss" in r]
    assert [r["checkpointed_layers"] for r in records] == [1, 1, 1]
    off = [r for r in read_metrics(tmp_path / "off" / "metrics.jsonl") if "loss" in r]
    assert "checkpointed_layers" not in off[0]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in off], rel=1e-6)
    for p, q in zip(auto.model.parameters(), runs["off"].model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_auto_on_a_cpu_recomputes_nothing(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 1, "gradient_checkpointing": "auto"})
    run = setup(load_recipe(path), Console(quiet=True))
    try:
        assert run.checkpointing == 0
        assert not any(layer.gradient_checkpointing for layer in decoder_of(run.model).layers)
    finally:
        cleanup(run)


def test_a_budget_without_auto_is_refused(tmp_path: Path):
    from ligertune.errors import UserError

    path = write_recipe(tmp_path, train={"gradient_checkpointing": True, "memory_budget_gib": 20})
    with pytest.raises(UserError, match="train.memory_budget_gib: applies to `gradient_checkpointing: auto` only"):
        load_recipe(path)
