"""The Lion optimizer: the paper's update over steps with two param groups, parameters without a
gradient, and checkpoints that resume bit for bit. (Each kernel path's step is tested in
tests/kernels/test_lion.py; here the step runs on the CPU path.)
"""

from __future__ import annotations

import io

import pytest
import torch

from ligertune.numerics import relative_error
from ligertune.training.lion import Lion

GROUPS = [  # (layer index in the toy model, group options)
    (0, dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)),
    (2, dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.0)),
]


def toy_model(dtype=torch.float32, seed=0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4)).to(dtype)


def two_groups(model) -> list[dict]:
    return [dict(params=list(model[i].parameters()), **options) for i, options in GROUPS]


def loss_of(model, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, 6, generator=gen).to(next(model.parameters()).dtype)
    return (model(x) - 0.5).square().mean()


def train(model, opt, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


def test_two_groups_follow_the_formula_over_steps():
    """Five steps (through a closure) against the paper's update (Algorithm 2) kept in float64, with
    each group's own lr, betas and weight decay, and the gradients the model produced."""
    model = toy_model()
    opt = Lion(two_groups(model), lr=1.0)  # the default lr is overridden by both groups
    exact = {p: (p.detach().double(), torch.zeros_like(p, dtype=torch.float64)) for p in model.parameters()}
    for step in range(5):
        def closure():
            opt.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            return loss

        assert opt.step(closure).requires_grad  # the closure's loss comes back, computed with grad
        for i, options in GROUPS:
            lr, (beta1, beta2), wd = options["lr"], options["betas"], options["weight_decay"]
            for p in model[i].parameters():
                p64, m64 = exact[p]
                g = p.grad.double()
                c = beta1 * m64 + (1 - beta1) * g
                exact[p] = (p64 - lr * (torch.sign(c) + wd * p64), beta2 * m64 + (1 - beta2) * g)
    for p, (p64, m64) in exact.items():
        state = opt.state[p]
        assert list(state) == ["exp_avg"] and state["exp_avg"].dtype == torch.float32
        assert relative_error(p, p64) < 1e-6
        assert relative_error(state["exp_avg"], m64) < 1e-6


def test_parameters_without_a_gradient_are_skipped():
    """A frozen parameter and one the loss does not reach keep their values and get no state."""
    model = toy_model()
    model[0].bias.requires_grad_(False)
    unused = torch.nn.Parameter(torch.randn(3))
    params = [*model.parameters(), unused]
    before = [p.detach().clone() for p in params]
    opt = Lion(params, lr=1e-2, weight_decay=0.1)
    train(model, opt, range(3))
    assert unused.grad is None and model[0].bias.grad is None
    for p, p0 in zip(params, before):
        skipped = p is unused or p is model[0].bias
        assert torch.equal(p, p0) == skipped
        assert (p in opt.state) != skipped


FP32_BF16 = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", FP32_BF16)
def test_state_dict_round_trip_continues_bitwise(dtype):
    """Train 3 steps, checkpoint model and optimizer through bytes, go on 3 steps; a new model and
    optimizer loaded from the checkpoint go on the same 3 steps to the same bits. The new optimizer
    is built with other hyperparameters, which the checkpoint's replace. bf16: the float32 momentum
    must survive the load, where torch.optim.Optimizer would cast it to the parameter's bf16."""
    model = toy_model(dtype)
    opt = Lion(two_groups(model), lr=1.0)
    train(model, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    train(model, opt, range(3, 6))

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = toy_model(dtype, seed=1)
    resumed.load_state_dict(checkpoint["model"])
    groups = [dict(params=list(resumed[i].parameters())) for i, _ in GROUPS]
    resumed_opt = Lion(groups, lr=0.5, weight_decay=0.3)
    resumed_opt.load_state_dict(checkpoint["optim"])
    for p in resumed.parameters():
        assert resumed_opt.state[p]["exp_avg"].dtype == torch.float32
    train(resumed, resumed_opt, range(3, 6))

    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], resumed_opt.state[q]["exp_avg"])
    assert [g["lr"] for g in resumed_opt.param_groups] == [options["lr"] for _, options in GROUPS]


@pytest.mark.parametrize(
    "options, message",
    [
        pytest.param(dict(lr=-1e-3), "lr must be >= 0", id="negative-lr"),
        pytest.param(dict(betas=(0.9, 1.5)), "betas must be two numbers in", id="beta-above-1"),
        pytest.param(dict(betas=(0.9,)), "betas must be two numbers in", id="one-beta"),
        pytest.param(dict(weight_decay=-0.1), "weight_decay must be >= 0", id="negative-wd"),
    ],
)
def test_bad_hyperparameters_raise(options, message):
    with pytest.raises(ValueError, match=message):
        Lion(toy_model().parameters(), **options)
    with pytest.raises(ValueError, match=message):  # in a param group too
        Lion([dict(params=list(toy_model().parameters()), **options)])
