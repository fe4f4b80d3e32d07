"""Lion step: both paths against the float64 formula over several steps, in every storage dtype; many
tensors of odd sizes in one call; sign(0) = 0; non-contiguous tensors; the Lion optimizer on each path.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, rel_err

import ligertune.kernels as K
from ligertune.training.lion import Lion

# Tensors of one call. With lion.BLOCK = 4096: (3, 37, 123) is 13653 elements, 3 whole blocks and a
# partial one; 4097 is a whole block and one element; (0,) is skipped; (1,) alone is one masked block.
SHAPE_SETS = [
    pytest.param([(3, 37, 123), (1,), (4097,), (0,), (7, 5)], id="B3-L37-H123+N1+N4097+N0+R7-H5"),
    pytest.param([(1,)], id="N1"),
]

# (param dtype, momentum dtype)
FP32_BF16 = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]

DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-m32"),
    pytest.param(torch.float16, torch.float32, id="fp16-m32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-m16"),
]

EVERY_OPTION = dict(lr=3e-2, beta1=0.95, beta2=0.98, weight_decay=0.1)
"""Every hyperparameter off its default at once."""

HYPER = [
    pytest.param(dict(lr=1e-2), id="defaults"),
    pytest.param(EVERY_OPTION, id="every-option"),
]

STEPS = 3


def make_tensors(shapes, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(DEVICE, dtype) for shape in shapes]


def formula64(p, g, m, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, got=None):
    """The paper's update in float64 from the stored values: (p, m) exact, before any rounding.

    Where c is zero up to float32 rounding of its terms, which low-precision inputs reach exactly
    (bf16 m = -0.03515625, g = 0.66796875 give c = 0 in exact arithmetic and 7e-18 in float64), its
    sign is ill-posed: there the expected p is the one of the three signs nearest to `got`.
    """
    p, g, m = p.double(), g.double(), m.double()
    c = beta1 * m + (1 - beta1) * g
    p_new = p - lr * (torch.sign(c) + weight_decay * p)
    if got is not None:
        candidates = torch.stack([p - lr * (u + weight_decay * p) for u in (-1.0, 0.0, 1.0)])
        nearest = candidates.gather(0, (candidates - got.double()).abs().argmin(0, keepdim=True))[0]
        p_new = torch.where(c.abs() <= 2.0**-20 * (m.abs() + g.abs()), nearest, p_new)
    return p_new, beta2 * m + (1 - beta2) * g


def assert_within_one_ulp(got, exact, scale, name):
    """Each stored element within one unit in the last place (of its dtype, at the exact value's
    magnitude) of the exact float64 result, plus float32 arithmetic error on the operands' `scale`.

    One ulp, not half: the GPU rounds float32 to the storage dtype to nearest, but Triton's
    interpreter truncates float32 to bfloat16 (measured, triton 3.9), which is within one ulp.
    """
    spacing = torch.finfo(got.dtype).eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))))
    bound = spacing + 8 * 2.0**-24 * scale
    err = (got.double() - exact).abs()
    off = err > bound
    assert not off.any(), f"{name}: {int(off.sum())} elements off, worst {float((err / bound).max()):.3g}x"


@pytest.mark.parametrize("p_dtype, m_dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPE_SETS)
def test_steps_match_float64_formula(kernel_path, shapes, p_dtype, m_dtype):
    """Each step from the stored state against the float64 formula from that same state, with a fresh
    gradient per step and every option off its default; the momentum starts at zero, as the
    optimizer's does."""
    hyper = EVERY_OPTION
    params = make_tensors(shapes, p_dtype, seed=0)
    moments = [torch.zeros_like(p, dtype=m_dtype) for p in params]
    for step in range(STEPS):
        grads = make_tensors(shapes, p_dtype, seed=1 + step)
        before = [(p.clone(), g, m.clone()) for p, g, m in zip(params, grads, moments)]
        K.lion_step(params, grads, moments, **hyper)
        for i, (p, m, (p0, g, m0)) in enumerate(zip(params, moments, before)):
            p64, m64 = formula64(p0, g, m0, **hyper, got=p)
            scale = p0.double().abs() + g.double().abs() + m0.double().abs() + hyper["lr"]
            assert p.dtype == p_dtype and m.dtype == m_dtype
            assert_within_one_ulp(p, p64, scale, f"step {step} param {i}")
            assert_within_one_ulp(m, m64, scale, f"step {step} momentum {i}")


@pytest.mark.parametrize("hyper", HYPER)
def test_float32_trajectory_stays_on_float64(kernel_path, hyper):
    """No drift: three steps in float32 against three steps of the formula kept in float64 throughout."""
    (p,), (m,) = make_tensors([(3, 37, 123)], torch.float32, seed=2), [torch.zeros(3, 37, 123, device=DEVICE)]
    p64, m64 = p.double(), m.double()
    for step in range(STEPS):
        (g,) = make_tensors([(3, 37, 123)], torch.float32, seed=10 + step)
        p64, m64 = formula64(p64, g, m64, **hyper)
        K.lion_step([p], [g], [m], **hyper)
    assert rel_err(p, p64) < 1e-6
    assert rel_err(m, m64) < 1e-6


@pytest.mark.parametrize("dtype", FP32_BF16)
def test_zero_gradient_is_sign_zero(kernel_path, dtype):
    """A zero gradient on a zero momentum moves p by the weight decay alone (sign(0) = 0, not +-1),
    and without weight decay not at all; the momentum stays zero."""
    p0 = make_tensors([(37, 5), (1,)], dtype, seed=3)
    params = [p.clone() for p in p0]
    grads = [torch.zeros_like(p) for p in params]
    moments = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    K.lion_step(params, grads, moments, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.0)
    for p, q, m in zip(params, p0, moments):
        assert torch.equal(p, q) and not m.any()
    K.lion_step(params, grads, moments, lr=0.5, beta1=0.9, beta2=0.99, weight_decay=0.5)
    for p, q in zip(params, p0):
        # |p| shrinks by a quarter (1 - lr * wd = 0.75), and a +-lr step would have shown.
        assert_within_one_ulp(p, 0.75 * q.double(), q.double().abs(), "decay only")


# 0 * inf in the interpreter's numpy
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_non_finite_gradient_is_not_hidden(kernel_path):
    """A NaN or infinite gradient turns its parameter element NaN (torch.sign(NaN) would be 0 and
    freeze it silently), and only that element."""
    (p,) = make_tensors([(37,)], torch.float32, seed=4)
    g = torch.zeros_like(p)
    g[5], g[9] = float("nan"), float("-inf")
    m = torch.zeros_like(p)
    K.lion_step([p], [g], [m], lr=1e-2)
    bad = torch.zeros_like(p, dtype=torch.bool)
    bad[[5, 9]] = True
    assert torch.equal(p.isnan(), bad)


def test_mixed_dtypes_and_strided_tensors_in_one_call(kernel_path):
    """float32 and bfloat16 tensors in one call (one launch each), a transposed parameter, a strided
    gradient, and a parameter 4 bytes into its buffer (not 16-byte aligned: the kernel's variant
    without vector accesses): the result is that of the same call on contiguous, aligned copies."""
    (a, b) = make_tensors([(37, 5), (124,)], torch.float32, seed=5)
    b = b[1:]
    (c,) = make_tensors([(5, 37)], torch.bfloat16, seed=6)
    params = [a, b, c.t()]  # c.t(): a non-contiguous [37, 5] parameter
    grads = [t * 0.5 for t in make_tensors([(37, 5), (123,)], torch.float32, seed=7)]
    grads.append(make_tensors([(37, 10)], torch.bfloat16, seed=8)[0][:, ::2])
    moments = [torch.randn(t.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE) for t in params]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)

    want_p = [p.contiguous().clone() for p in params]
    want_m = [m.clone() for m in moments]
    K.lion_step(want_p, [g.contiguous() for g in grads], want_m, **hyper)
    K.lion_step(params, grads, moments, **hyper)
    assert torch.equal(c.t(), want_p[2])  # written through the transposed view into c
    for p, q in zip([*params, *moments], [*want_p, *want_m]):
        assert torch.equal(p, q)


def test_empty_lists_and_tensors(kernel_path):
    K.lion_step([], [], [], lr=1e-2)
    p = torch.empty(0, 3, device=DEVICE)
    K.lion_step([p], [p.clone()], [p.clone()], lr=1e-2)


def test_bad_arguments_raise(kernel_path):
    (p,) = make_tensors([(4, 8)], torch.float32, seed=0)
    g, m = p.clone(), torch.zeros_like(p)
    with pytest.raises(ValueError, match="lists of one length"):
        K.lion_step([p], [g, g], [m], lr=1e-2)
    with pytest.raises(ValueError, match="share a shape"):
        K.lion_step([p], [g[:, :7]], [m], lr=1e-2)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        K.lion_step([p.double()], [g.double()], [m.double()], lr=1e-2)
    with pytest.raises(ValueError, match="moments\\[0\\] float32 or torch.bfloat16"):
        K.lion_step([p.bfloat16()], [g.bfloat16()], [m.half()], lr=1e-2)
    with pytest.raises(ValueError, match="beta1 and beta2"):
        K.lion_step([p], [g], [m], lr=1e-2, beta2=1.5)
    with pytest.raises(ValueError, match="weight_decay"):
        K.lion_step([p], [g], [m], lr=1e-2, weight_decay=-1.0)


@pytest.mark.parametrize("dtype", FP32_BF16)
def test_optimizer_steps_follow_the_formula(kernel_path, dtype):
    """`Lion` on this path, three steps of a small MLP (a bias-free layer among them): every parameter
    and its float32 momentum follow the float64 formula from the state before each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 5, bias=False))
    model.to(DEVICE, dtype)
    opt = Lion(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
    x = torch.randn(8, 13).to(DEVICE, dtype)
    for step in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
        before = {}
        for p in model.parameters():
            m0 = opt.state[p]["exp_avg"].clone() if p in opt.state else torch.zeros(p.shape, device=DEVICE)
            before[p] = (p.detach().clone(), p.grad.clone(), m0)
        opt.step()
        for i, (p, (p0, g, m0)) in enumerate(before.items()):
            m = opt.state[p]["exp_avg"]
            assert m.dtype == torch.float32
            p64, m64 = formula64(p0, g, m0, **hyper, got=p)
            scale = p0.double().abs() + g.double().abs() + m0.double().abs() + hyper["lr"]
            assert_within_one_ulp(p.detach(), p64, scale, f"step {step} param {i}")
            assert_within_one_ulp(m, m64, scale, f"step {step} momentum {i}")


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")])
def test_master_weights_follow_the_formula_and_let_small_steps_add_up(kernel_path, dtype):
    """`Lion(master_weights=True)` on this path, 16-bit parameters: the float32 master and momentum
    follow the float64 formula from the master before each step, and the parameter is its master
    rounded. The learning rate is a step below half the dtype's spacing for weights above 0.1,
    which the parameter alone, rounded to nearest, would not take; over 30 steps those move too."""
    hyper = dict(lr=0.1 * torch.finfo(dtype).eps / 4, beta1=0.9, beta2=0.99, weight_decay=0.1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 5))
    model.to(DEVICE, dtype)
    start = [p.detach().clone() for p in model.parameters()]
    opt = Lion(model.parameters(), lr=hyper["lr"], betas=(0.9, 0.99), weight_decay=0.1, master_weights=True)
    x = torch.randn(8, 13).to(DEVICE, dtype)
    for step in range(30):
        model.zero_grad()
        model(x).square().mean().backward()
        before = {}
        for p in model.parameters():
            state = opt.state.get(p, {})
            master = state["master"].clone() if "master" in state else p.detach().float()
            m0 = state["exp_avg"].clone() if "exp_avg" in state else torch.zeros(p.shape, device=DEVICE)
            before[p] = (master, p.grad.clone(), m0)
        opt.step()
        for i, (p, (master0, g, m0)) in enumerate(before.items()):
            master, m = opt.state[p]["master"], opt.state[p]["exp_avg"]
            assert master.dtype == m.dtype == torch.float32
            p64, m64 = formula64(master0, g, m0, **hyper, got=master)
            scale = master0.double().abs() + g.double().abs() + m0.double().abs() + hyper["lr"]
            assert_within_one_ulp(master, p64, scale, f"step {step} master {i}")
            assert_within_one_ulp(m, m64, scale, f"step {step} momentum {i}")
            assert torch.equal(p.detach(), master.to(dtype))
    # Where |p| > lr / (eps / 4), a step of lr is below half a spacing of the dtype.
    large = [p0.abs() > 1.01 * hyper["lr"] / (torch.finfo(dtype).eps / 4) for p0 in start]
    moved = sum(int((p.detach() != p0)[big].sum()) for p, p0, big in zip(model.parameters(), start, large))
    assert sum(int(big.sum()) for big in large) > 0
    assert moved > 0.9 * sum(int(big.sum()) for big in large)
