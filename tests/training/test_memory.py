"""`gradient_checkpointing: auto`: the plan's arithmetic, the measurement of a layer's saved
activations, the offload of checkpointed layers' inputs, the plan's correction from the second
step, and runs that recompute or offload computing what a run without does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import TINY_MODEL, write_recipe
from transformers import LlamaConfig, LlamaForCausalLM

import ligertune.training.build as trainer_module
from ligertune.metrics import read_metrics
from ligertune.models import decoder_of
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop
from ligertune.training.build import enable_gradient_checkpointing
from ligertune.training.memory import (
    GIB,
    CheckpointPlanner,
    InputOffload,
    SavedBytes,
    plan_checkpointing,
    set_checkpointed,
)


@pytest.mark.parametrize("budget, want", [
    (10_000, (0, False, True)),  # everything fits: nothing recomputed
    (1_000, (4, False, True)),  # P(1) = 500; each kept layer adds 90: 1 + floor(500 / 90) = 6 kept
    (590, (8, False, True)),  # P(1) + 90: 2 kept
    (589, (9, False, True)),  # just short of it: 1 kept
    (410, (10, False, True)),  # P(0) = 410 fits exactly
    (409, (10, False, False)),  # even P(0) is over the budget: recompute all, and say so
])
def test_plan_keeps_as_many_layers_as_the_budget_allows(budget, want):
    layers, activation, checkpointed_input, step_peak = 10, 100, 10, 500  # a kept layer costs 90 more
    assert plan_checkpointing(layers=layers, activation=activation, checkpointed_input=checkpointed_input,
                              step_peak=step_peak, budget=budget) == want


# With offload, k kept layers park the inputs of p(k) = 9 - k layers (8 for k = 0), of which all but
# one stay off the device: P(k) = 500 + 90 (k - 1) - 10 (p(k) - 1).
@pytest.mark.parametrize("offload, budget, want", [
    ("auto", 590, (8, False, True)),  # offloaded, 3 kept would need 630: it buys no layer
    ("auto", 630, (7, True, True)),  # it buys the third kept layer
    ("auto", 409, (10, True, True)),  # P(0) = 410 without, 340 with: only offloading fits
    ("auto", 339, (10, True, False)),  # nothing fits: recompute and offload all, and say so
    (False, 630, (8, False, True)),
    (True, 590, (8, True, True)),  # offloaded though it buys nothing
    (True, 10_000, (0, False, True)),  # nothing recomputed: nothing to offload
])
def test_offload_is_chosen_where_it_keeps_more_layers(offload, budget, want):
    assert plan_checkpointing(layers=10, activation=100, checkpointed_input=10, step_peak=500, budget=budget,
                              offload=offload) == want


def tiny_llama(layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
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


def loss_and_grads(model, ids, during=lambda: None):
    loss = model(input_ids=ids, labels=ids).loss
    during()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_offload_parks_the_inputs_of_middle_checkpointed_layers_and_computes_the_same():
    model = tiny_llama(layers=5)
    layers = decoder_of(model).layers
    set_checkpointed(layers, 4)  # layers 0-3 recomputed, layer 4 not
    ids = torch.randint(0, 128, (2, 48))
    want_loss, want_grads = loss_and_grads(model, ids)

    offload = InputOffload(layers, torch.device("cpu"))
    offload.enabled = True
    parked = {}

    def after_forward():  # what is parked between the forward and the backward
        parked.update({i: p.tensor.untyped_storage().nbytes() for i, p in offload._parked.items()})
        parked["bytes"] = offload.parked_bytes

    loss, grads = loss_and_grads(model, ids, during=after_forward)
    offload.remove()
    # Layers 1-3 are parked (not 0, the embeddings; 4 is not checkpointed), their device storage empty.
    assert parked == {1: 0, 2: 0, 3: 0, "bytes": 3 * 2 * 48 * 32 * 4}
    assert offload.parked_count == 3 and not offload._parked  # all restored by the backward
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


def test_offload_leaves_evaluation_and_unparked_runs_alone():
    model = tiny_llama(layers=4)
    layers = decoder_of(model).layers
    set_checkpointed(layers, 4)
    offload = InputOffload(layers, torch.device("cpu"))
    offload.enabled = True
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 16)))
    assert not offload._parked
    offload.enabled = False
    model(input_ids=torch.randint(0, 128, (1, 16))).logits.sum().backward()
    assert not offload._parked
    offload.remove()


class StepAllocator:
    """A device whose step peaks are given in turn, allocating nothing for the optimizer."""

    device = torch.device("cpu")

    def __init__(self, peaks: list[int]):
        self.peaks = peaks

    def reset_peak(self) -> None:
        pass

    def allocated(self) -> int:
        return 0

    def peak(self) -> int:
        return self.peaks.pop(0)


def test_the_second_step_corrects_the_plan():
    model = tiny_llama(layers=10)
    layers = decoder_of(model).layers
    # Measured: P_1 + S = 500, and (as set below) A = 100, C = 10 per layer. With a budget of 860 the
    # plan keeps 1 + (860 - 500) / 90 = 5 layers and predicts 860. The second step peaks at 700: the
    # model moves down by 160, and from there, 90 a kept layer, 1 + (860 - 340) / 90 = 6 layers fit,
    # predicted at 790.
    planner = CheckpointPlanner(model, layers, StepAllocator([500, 700]), budget_gib=860 / GIB, offload=False)
    with planner.measuring():
        pass
    planner.apply(activation=100, checkpointed_input=10, step_peak=500)
    assert planner.plan.checkpointed == 5 and planner.plan.predicted_peak_gib * GIB == pytest.approx(860)
    with planner.planning():  # the second step
        pass
    assert planner.plan.checkpointed == 4
    assert planner.plan.predicted_peak_gib * GIB == pytest.approx(700 + 90)
    assert [layer.gradient_checkpointing for layer in layers] == [True] * 4 + [False] * 6
    assert planner.news.startswith("gradient checkpointing re-planned from step 2 (forward and backward "
                                   "peaked at 0.0 GiB, predicted 0.0)")
    with planner.planning():  # later steps change nothing
        pass
    assert planner.plan.checkpointed == 4


@pytest.mark.parametrize("budget, want", [
    (860, (5, False, True)),  # P(5 kept) = 860 over U = 800
    (810, (6, False, True)),  # P(4 kept) = 770, but U = 800 sets the peak
    (799, (10, False, False)),  # below the update's peak nothing fits
])
def test_the_update_peak_bounds_the_plan(budget, want):
    assert plan_checkpointing(layers=10, activation=100, checkpointed_input=10, step_peak=500, budget=budget,
                              update_peak=800) == want


def test_the_planner_measures_the_update_apart():
    model = tiny_llama(layers=10)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    # forward and backward peak at 500, the update at 800 (then 510 and 790 on the second step)
    planner = CheckpointPlanner(model, decoder_of(model).layers, StepAllocator([500, 800, 510, 790]),
                                budget_gib=860 / GIB, offload=False, optimizer=optimizer)
    with planner.planning():
        weight.grad = torch.ones(1)
        optimizer.step()
    plan = planner.plan
    assert (plan.step_peak_gib * GIB, plan.update_peak_gib * GIB) == (pytest.approx(500), pytest.approx(800))
    with planner.planning():
        optimizer.step()
    assert planner.plan.update_peak_gib * GIB == pytest.approx(790)
    assert planner.peak_seen == 800  # what the run reports as its peak, the resets notwithstanding


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


def _cuda_of(monkeypatch, total_gib: float, fraction: float) -> dict:
    """torch.cuda's memory queries for one device of `total_gib` GiB of which the process may take
    `fraction`; like torch's own, they take a device index, not `cuda` alone. Returns the fraction
    set, by index."""
    from types import SimpleNamespace

    fractions = {0: fraction}

    def index(device):
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=int(total_gib * GIB)) if index(d) == 0 else None)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: fractions[index(d)])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: fractions.__setitem__(index(d), f))
    return fractions


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_the_default_budget_is_of_what_the_process_may_take(monkeypatch, device):
    """With `bench step --device-memory` capping the allocator, the plan is made for the capped
    card, not for the whole device."""
    from ligertune.devices import cap_device_memory
    from ligertune.training.memory import default_budget_gib

    fractions = _cuda_of(monkeypatch, 140, 1.0)
    assert default_budget_gib(torch.device(device)) == pytest.approx(0.9 * 140)
    cap_device_memory(torch.device(device), 70)
    assert fractions[0] == pytest.approx(0.5)
    assert default_budget_gib(torch.device(device)) == pytest.approx(0.9 * 70)


def test_a_budget_without_auto_is_refused(tmp_path: Path):
    from ligertune.errors import UserError

    path = write_recipe(tmp_path, train={"gradient_checkpointing": True, "memory_budget_gib": 20})
    with pytest.raises(UserError, match="train.memory_budget_gib: applies to `gradient_checkpointing: auto` only"):
        load_recipe(path)


def test_a_run_with_offload_trains_as_one_without(tmp_path: Path):
    path = write_recipe(tmp_path, model={"config": {**TINY_MODEL, "num_hidden_layers": 4}},
                        train={"max_steps": 2, "gradient_checkpointing": True, "activation_offload": True})
    losses = {}
    for offload in (True, False):
        out = tmp_path / f"offload-{offload}"
        run = setup(load_recipe(path, [f"train.activation_offload={str(offload).lower()}", f"output.dir={out}"]),
                    Console(quiet=True))
        try:
            assert (run.offload is not None) == offload
            train_loop(run)
        finally:
            cleanup(run)
        records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        assert [r.get("offloaded_layers") for r in records] == ([2, 2] if offload else [None, None])
        losses[offload] = [r["loss"] for r in records]
    assert losses[True] == losses[False]


def test_offload_without_checkpointing_is_refused(tmp_path: Path):
    from ligertune.errors import UserError

    path = write_recipe(tmp_path, train={"activation_offload": True})
    with pytest.raises(UserError, match="train.activation_offload: parks the inputs of checkpointed layers"):
        load_recipe(path)
