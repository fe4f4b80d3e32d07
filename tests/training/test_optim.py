"""The optimizers as the recipe builds them: AdamW against the float64 formula, with and without float32
master weights; the epsilon trap of 16-bit AdamW states and how the default avoids it; checkpoints
that keep float32 state; the optimizer memory a run reports; the warnings of `validate`.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from ligertune.numerics import relative_error
from ligertune.recipe import OptimConfig, recipe_from_dict
from ligertune.training.adamw import AdamW
from ligertune.training.build import build_optimizer
from ligertune.training.lion import Lion
from ligertune.training.precision import optimizer_memory, optimizer_warnings

GROUPS = [  # (layer index in the toy model, group options)
    (0, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
    (2, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)),
]


def toy_model(dtype=torch.float32, seed=0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4)).to(dtype)


def two_groups(model) -> list[dict]:
    return [dict(params=list(model[i].parameters()), **options) for i, options in GROUPS]


def backward(model, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, 6, generator=gen).to(next(model.parameters()).dtype)
    model.zero_grad()
    (model(x) - 0.5).square().mean().backward()


def adamw64(p, g, m, v, t, *, lr, betas, eps, weight_decay):
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2 with torch's bias corrections) in float64."""
    beta1, beta2 = betas
    p, g = p.double(), g.double()
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p * (1 - lr * weight_decay) - lr / (1 - beta1**t) * m / ((v / (1 - beta2**t)).sqrt() + eps)
    return p, m, v


# --------------------------------------------------------------------------------------------------
# AdamW


def test_float32_parameters_step_as_torch_adamw_and_the_formula():
    """Float32 parameters take torch's own AdamW step with master weights on (there is nothing to
    copy): bit for bit torch.optim.AdamW over five steps of two groups, and within float32 rounding of
    the formula kept in float64."""
    ours, theirs = toy_model(), toy_model()
    opt = AdamW(two_groups(ours), master_weights=True)
    ref = torch.optim.AdamW(two_groups(theirs))
    exact = {p: (p.detach().double(), torch.zeros_like(p, dtype=torch.float64),
                 torch.zeros_like(p, dtype=torch.float64)) for p in ours.parameters()}
    for step in range(5):
        backward(ours, step)
        backward(theirs, step)
        for i, options in GROUPS:
            for p in ours[i].parameters():
                exact[p] = adamw64(*exact[p][:1], p.grad, *exact[p][1:], step + 1, **options)
        opt.step()
        ref.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
        assert "master" not in opt.state[p] and opt.state[p]["exp_avg"].dtype == torch.float32
        p64, _, v64 = exact[p]
        assert relative_error(p, p64) < 1e-6
        assert relative_error(opt.state[p]["exp_avg_sq"], v64) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_master_weights_follow_the_formula_and_round_into_the_parameter(dtype):
    """16-bit parameters: the float32 master and moments follow the float64 formula from the
    gradients the model produced (float32 rounding only), and the parameter is its master rounded."""
    model = toy_model(dtype)
    opt = AdamW(two_groups(model), master_weights=True)
    exact = {p: (p.detach().double(), torch.zeros_like(p, dtype=torch.float64),
                 torch.zeros_like(p, dtype=torch.float64)) for p in model.parameters()}
    for step in range(5):
        backward(model, step)
        for i, options in GROUPS:
            for p in model[i].parameters():
                exact[p] = adamw64(*exact[p][:1], p.grad, *exact[p][1:], step + 1, **options)
        opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert {state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
        p64, m64, v64 = exact[p]
        assert relative_error(state["master"], p64) < 1e-6
        assert relative_error(state["exp_avg"], m64) < 1e-6
        assert relative_error(state["exp_avg_sq"], v64) < 1e-6
        assert torch.equal(p.detach(), state["master"].to(dtype))


def test_master_weights_in_small_chunks_give_the_same_step(monkeypatch):
    """The 16-bit gradients are cast to float32 a chunk at a time: one element per chunk gives the
    bits of one chunk for everything."""
    from ligertune.training import precision

    whole, chunked = toy_model(torch.bfloat16), toy_model(torch.bfloat16)
    opt_whole = AdamW(two_groups(whole), master_weights=True)
    opt_chunked = AdamW(two_groups(chunked), master_weights=True)
    for step in range(3):
        backward(whole, step)
        opt_whole.step()
    monkeypatch.setattr(precision, "CHUNK_ELEMENTS", 1)
    for step in range(3):
        backward(chunked, step)
        opt_chunked.step()
    for p, q in zip(whole.parameters(), chunked.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("make", [
    pytest.param(lambda groups: AdamW(groups, master_weights=True), id="adamw"),
    pytest.param(lambda groups: Lion([{k: v for k, v in g.items() if k != "eps"} for g in groups],
                                     master_weights=True), id="lion"),
])
def test_state_dict_round_trip_keeps_float32_state_and_continues_bitwise(make):
    """bf16 model: train 3 steps, checkpoint through bytes, go on 3 steps; a fresh model and optimizer
    loaded from the checkpoint go on to the same bits. torch.optim.Optimizer would cast the float32
    master and moments to the parameter's bf16 on load."""
    model = toy_model(torch.bfloat16)
    opt = make(two_groups(model))
    for step in range(3):
        backward(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    for step in range(3, 6):
        backward(model, step)
        opt.step()

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = toy_model(torch.bfloat16, seed=1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = make(two_groups(resumed))
    resumed_opt.load_state_dict(checkpoint["optim"])
    for p in resumed.parameters():
        assert {t.dtype for t in resumed_opt.state[p].values() if t.ndim} == {torch.float32}
    for step in range(3, 6):
        backward(resumed, step)
        resumed_opt.step()
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master"], resumed_opt.state[q]["master"])


# --------------------------------------------------------------------------------------------------
# the epsilon trap


def linear(dtype, d=16) -> torch.nn.Linear:
    layer = torch.nn.Linear(d, 1, bias=False).to(dtype)
    torch.nn.init.zeros_(layer.weight)
    return layer


def regression(d=16, n=64):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
    return x, w


def fit(layer, opt, x, w, steps=1000) -> torch.Tensor:
    dtype = layer.weight.dtype
    for _ in range(steps):
        opt.zero_grad()
        (layer(x.to(dtype)).squeeze(1) - (x @ w).to(dtype)).square().mean().backward()
        opt.step()
    return layer.weight.detach().double().squeeze(0)


def test_the_trap_changes_the_result_and_the_default_avoids_it():
    """Least squares from zero weights, AdamW lr 1e-3, 1000 steps. With a bf16 model, torch's AdamW
    (bf16 moments, updates added to bf16 weights) ends 20% away from where the float32 model gets
    (0.1% from the solution); the recipe's default optimizer ends within bf16's rounding of it."""
    x, w = regression()
    cfg = OptimConfig(lr=1e-3)
    reached = fit(layer := linear(torch.float32), build_optimizer(layer, cfg), x, w)
    assert relative_error(reached, w) < 1e-2

    trapped = fit(layer := linear(torch.bfloat16), torch.optim.AdamW(layer.parameters(), lr=1e-3), x, w)
    default = fit(layer := linear(torch.bfloat16), build_optimizer(layer, cfg), x, w)
    assert relative_error(trapped, reached) > 0.1
    assert relative_error(default, reached) < 2**-8


def test_bf16_moments_stop_decaying_and_the_default_keeps_them():
    """A gradient of 1 for 20 steps, then 1e-2 for 2000: in float64 the second moment decays to
    2.8e-3; in torch's bf16 state beta2 v rounds back to v and it stays at its peak, 7x too large.
    The default's float32 moments follow the formula."""
    schedule = [1.0] * 20 + [1e-2] * 2000
    v64 = 0.0
    for g in schedule:
        v64 = 0.999 * v64 + 0.001 * g * g

    def second_moment(opt_of) -> float:
        layer = linear(torch.bfloat16, d=1)
        opt = opt_of(layer)
        for g in schedule:
            layer.weight.grad = torch.full_like(layer.weight, g)
            opt.step()
        return opt.state[layer.weight]["exp_avg_sq"].item()

    trapped = second_moment(lambda layer: torch.optim.AdamW(layer.parameters(), lr=1e-3))
    default = second_moment(lambda layer: build_optimizer(layer, OptimConfig(lr=1e-3)))
    assert trapped > 5 * v64
    assert default == pytest.approx(v64, rel=1e-4)


def test_fp16_epsilon_rounds_to_zero_and_the_default_stays_finite():
    """float16 parameters, one AdamW step with gradients 0, 1e-3 and 1e-5: eps = 1e-8 rounds to 0 and
    (1 - beta2) g^2 underflows in torch's fp16 state, giving 0/0 and m/0; the default's float32
    state steps as the formula says (by lr where the gradient is not 0)."""
    grad = torch.tensor([[0.0, 1e-3, 1e-5]], dtype=torch.float16)

    def one_step(opt_of) -> torch.Tensor:
        layer = linear(torch.float16, d=3)
        torch.nn.init.ones_(layer.weight)
        opt = opt_of(layer)
        layer.weight.grad = grad.clone()
        opt.step()
        return layer.weight.detach()

    trapped = one_step(lambda layer: torch.optim.AdamW(layer.parameters(), lr=1e-2))
    default = one_step(lambda layer: build_optimizer(layer, OptimConfig(lr=1e-2)))
    assert not trapped.isfinite().all()
    expected = torch.tensor([[1.0, 1 - 1e-2, 1 - 1e-2]], dtype=torch.float64)  # m / sqrt(v) = sign(g) at step 1
    assert torch.allclose(default.double(), expected, atol=1e-3)


# --------------------------------------------------------------------------------------------------
# what the run reports


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["adamw", "lion"])
@pytest.mark.parametrize("master_weights", [True, False], ids=["master", "no-master"])
def test_reported_memory_is_the_state_kept(dtype, name, master_weights):
    """The optimizer memory printed at the start of a run equals the bytes of the per-element state
    tensors after a step; Lion keeps half of AdamW's for float32 parameters."""
    model = toy_model(dtype)
    opt = build_optimizer(model, OptimConfig(name=name, master_weights=master_weights))
    backward(model, 0)
    opt.step()
    kept = {"master": 0, "moments": 0}
    for state in opt.state.values():
        for key, t in state.items():
            if t.ndim:
                kept["master" if key == "master" else "moments"] += t.numel() * t.element_size()
    report = optimizer_memory(list(model.parameters()), name, master_weights=master_weights)
    assert (report.states, report.master) == (kept["moments"], kept["master"])
    assert (report.master > 0) == (master_weights and dtype == torch.bfloat16)
    if dtype == torch.float32 and name == "lion":
        assert 2 * report.states == report.adamw_states


def test_build_optimizer_takes_lion_with_its_betas_and_groups():
    recipe = recipe_from_dict({"model": {"config": "llama-tiny"}, "data": {"path": "x.jsonl"},
                               "optim": {"name": "lion", "lr": 3e-6, "weight_decay": 0.3}})
    assert recipe.optim.betas == [0.9, 0.99]
    opt = build_optimizer(toy_model(), recipe.optim)
    assert isinstance(opt, Lion) and opt.master_weights
    assert [(g["betas"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
        ((0.9, 0.99), 0.3, 2), ((0.9, 0.99), 0.0, 2)]  # matrices decay, biases do not


def test_lion_trains_lora_adapters_only(tmp_path: Path):
    """A LoRA run with Lion: the adapters get a float32 momentum and move; the frozen base has no
    state and stays as it was."""
    from rich.console import Console
    from tiny_recipe import write_recipe

    from ligertune.recipe import load_recipe
    from ligertune.training import cleanup, setup, train_loop

    path = write_recipe(tmp_path, lora={"r": 4, "alpha": 8}, optim={"name": "lion", "lr": 3e-4},
                        train={"max_steps": 2, "eval_every": None})
    run = setup(load_recipe(path), Console(quiet=True))
    before = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    try:
        train_loop(run)
    finally:
        cleanup(run)
    assert isinstance(run.optimizer, Lion)
    for name, p in run.model.named_parameters():
        state = run.optimizer.state.get(p, {})
        if "lora_" in name:
            assert p.requires_grad and state["exp_avg"].dtype == torch.float32, name
            assert not torch.equal(p, before[name]), name
        else:
            assert not p.requires_grad and not state and torch.equal(p, before[name]), name


# --------------------------------------------------------------------------------------------------
# warnings


def keys(cfg: OptimConfig, dtype: torch.dtype, lora: bool = False) -> list[str]:
    return [key for key, _ in optimizer_warnings(cfg, {dtype}, lora=lora)]


def test_lion_learning_rates_of_adamw_size_are_flagged():
    assert keys(OptimConfig(name="lion", lr=2e-5), torch.float32) == ["optim.lr"]
    assert keys(OptimConfig(name="lion", lr=3e-6), torch.float32) == []
    assert keys(OptimConfig(name="lion", lr=2e-4), torch.float32, lora=True) == ["optim.lr"]
    assert keys(OptimConfig(name="lion", lr=3e-5), torch.float32, lora=True) == []
    assert keys(OptimConfig(name="adamw", lr=2e-5), torch.float32) == []


def test_the_epsilon_trap_is_flagged_only_without_master_weights():
    """bf16 AdamW states: the second moment cannot decay (beta2 0.999), named at optim.eps; fp16: eps
    1e-8 rounds to 0, and an eps above the underflow floor (5.5e-3 for beta2 0.999) is not flagged
    there; with master weights (the default) or float32 parameters nothing is."""
    off = dict(master_weights=False)
    bf16 = optimizer_warnings(OptimConfig(**off), {torch.bfloat16}, lora=False)
    assert [k for k, _ in bf16] == ["optim.master_weights", "optim.eps"]
    assert "1e-08" in bf16[1][1] and "never decays" in bf16[1][1]
    fp16 = optimizer_warnings(OptimConfig(**off), {torch.float16}, lora=False)
    assert [k for k, _ in fp16] == ["optim.master_weights", "optim.eps"] and "rounds to 0" in fp16[1][1]
    assert keys(OptimConfig(eps=1e-5, **off), torch.float16)[1:] == ["optim.eps"]  # below the floor
    assert keys(OptimConfig(eps=1e-2, **off), torch.float16) == ["optim.master_weights"]
    assert keys(OptimConfig(betas=[0.9, 0.99], **off), torch.bfloat16) == ["optim.master_weights"]
    assert keys(OptimConfig(name="lion", lr=1e-6, **off), torch.bfloat16) == ["optim.master_weights"]
    assert keys(OptimConfig(), torch.bfloat16) == keys(OptimConfig(), torch.float16) == []
    assert keys(OptimConfig(**off), torch.float32) == []


def test_the_trap_floor_is_where_fp16_second_moments_underflow():
    """The float16 floor of the eps check: the gradient whose (1 - beta2) g^2 rounds to 0 in float16."""
    from ligertune.training.precision import smallest_second_moment_gradient

    floor = smallest_second_moment_gradient(torch.float16, 0.999)
    as_fp16 = lambda g: torch.tensor(0.001 * g * g, dtype=torch.float16).item()
    assert as_fp16(floor * 0.99) == 0.0 and as_fp16(floor * 1.01) > 0.0
    assert math.isclose(floor, 5.46e-3, rel_tol=1e-2)
