"""The optimizers on CUDA: fused AdamW and the compiled Lion kernel step bf16 parameters through
float32 master weights as the float64 formula says; a bf16 run with Lion, per-tensor clipping and the
spike watch trains. The tests/training and tests/kernels tests check the same on the CPU paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import write_recipe

from ligertune.metrics import read_metrics
from ligertune.numerics import relative_error
from ligertune.recipe import OptimConfig, load_recipe
from ligertune.training import cleanup, setup, train_loop
from ligertune.training.adamw import AdamW
from ligertune.training.build import build_optimizer
from ligertune.training.lion import Lion

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 1024), (1024,), (3, 37, 123), (1,)]


def params_and_grads(seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((0.05 * torch.randn(s, generator=gen)).to("cuda", torch.bfloat16))
              for s in SHAPES]
    grads = [[(1e-3 * torch.randn(s, generator=gen)).to("cuda", torch.bfloat16) for s in SHAPES]
             for _ in range(4)]
    return params, grads


def test_fused_adamw_with_master_weights_follows_the_formula():
    params, grads = params_and_grads(0)
    opt = build_optimizer(torch.nn.ParameterList(params), OptimConfig(lr=1e-3, weight_decay=0.1))
    assert isinstance(opt, AdamW) and opt.param_groups[0]["fused"]
    exact = [(p.detach().double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64))
             for p in params]
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            p.grad = g
            wd = 0.1 if p.ndim >= 2 else 0.0
            p64, m, v = exact[i]
            g64 = g.double()
            m = 0.9 * m + 0.1 * g64
            v = 0.999 * v + 0.001 * g64 * g64
            p64 = p64 * (1 - 1e-3 * wd) - 1e-3 / (1 - 0.9**t) * m / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
            exact[i] = (p64, m, v)
        opt.step()
    for p, (p64, _, v64) in zip(params, exact):
        state = opt.state[p]
        assert relative_error(state["master"], p64) < 1e-6
        assert relative_error(state["exp_avg_sq"], v64) < 1e-4  # torch's fused kernel: 1.3e-5 measured
        assert torch.equal(p.detach(), state["master"].bfloat16())


def test_compiled_lion_with_master_weights_follows_the_formula():
    """Within float32 rounding, except where c is 0 up to float32 rounding of its terms (bf16
    gradients reach exact zeros: g2 = -9 g1 / 10 up to bf16 rounding) and its sign is ill-posed."""
    params, grads = params_and_grads(1)
    opt = Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, master_weights=True)
    exact = [(p.detach().double(), torch.zeros_like(p, dtype=torch.float64)) for p in params]
    ill_posed = [torch.zeros_like(p, dtype=torch.bool) for p in params]
    for step_grads in grads:
        for i, (p, g) in enumerate(zip(params, step_grads)):
            p.grad = g
            p64, m = exact[i]
            c = 0.9 * m + 0.1 * g.double()
            ill_posed[i] |= c.abs() <= 2.0**-20 * (0.9 * m.abs() + 0.1 * g.double().abs())
            exact[i] = (p64 - 1e-4 * (torch.sign(c) + 0.1 * p64), 0.99 * m + 0.01 * g.double())
        opt.step()
    for p, (p64, m64), ambiguous in zip(params, exact, ill_posed):
        state = opt.state[p]
        # Float32 rounding of four steps, at the size of the weight and of a step (lr).
        off = (state["master"].double() - p64).abs() > 2.0**-20 * (p64.abs() + 1e-4)
        assert not (off & ~ambiguous).any(), int((off & ~ambiguous).sum())
        assert ambiguous.double().mean() < 1e-3
        assert relative_error(state["exp_avg"], m64) < 1e-6
        assert torch.equal(p.detach(), state["master"].bfloat16())


def test_a_bf16_lion_run_with_per_tensor_clipping_and_a_spike(tmp_path: Path):
    path = write_recipe(tmp_path, model={"dtype": "bfloat16"}, optim={"name": "lion", "lr": 1e-4, "clip": "per_tensor"},
                        train={"max_steps": 8, "eval_every": None, "spike_window": 4, "device": "cuda"})
    run = setup(load_recipe(path), Console(quiet=True))
    forward = run.head.forward

    def spiking(*args, **kwargs):
        out = forward(*args, **kwargs)
        if run.state.step + 1 == 6:
            out.loss = out.loss * 20
        return out

    run.head.forward = spiking
    try:
        train_loop(run)
    finally:
        cleanup(run)
    assert {p.dtype for p in run.trainable} == {torch.bfloat16}
    assert all("master" in run.optimizer.state[p] for p in run.trainable)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["clipped_tensors"] >= 0 and r["spikes"] == (r["step"] >= 6) for r in records)
    spikes = [json.loads(line) for line in (tmp_path / "run" / "spikes.jsonl").read_text().splitlines()]
    assert [s["step"] for s in spikes] == [6] and spikes[0]["conversations"]
