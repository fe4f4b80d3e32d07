"""Fused linear cross-entropy: both paths against the plain formula in float64, values and gradients.

The Triton path runs under TRITON_INTERPRET=1 on the CPU (see conftest.py), so the shapes stay
small; they are odd on purpose, and one vocabulary (9001) spans two column blocks of the kernel.
With TRITON_INTERPRET=0 on a GPU machine the same tests run on CUDA with the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from kernel_testing import DEVICE, rel_err

from ligertune.kernels import LossOptions, fused_linear_cross_entropy
from ligertune.kernels.chunked_loss import _chunk_rows

IGNORE = -100

SHAPES = [
    pytest.param(37, 123, 1001, id="N37-H123-V1001"),
    pytest.param(5, 16, 130, id="N5-H16-V130"),
    pytest.param(11, 96, 9001, id="N11-H96-V9001"),
]

# (dtype, tolerance on values, relative tolerance on whole gradient tensors)
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 2e-2, id="bf16"),
]

KERNEL_OPTIONS = dict(softcap=7.5, label_smoothing=0.1, z_loss_weight=1e-3)
ALL_OPTIONS = dict(bias=True, weights=True, **KERNEL_OPTIONS)  # bias/weights: make_inputs flags
CASES = [
    pytest.param(dict(reduction="mean", ignore=False), id="plain-mean"),
    pytest.param(dict(reduction="mean"), id="ignored-mean"),
    pytest.param(dict(reduction="sum"), id="ignored-sum"),
    pytest.param(dict(reduction="none"), id="ignored-none"),
    pytest.param(dict(reduction="sum", weights=True), id="weights-sum"),
    pytest.param(dict(reduction="mean", bias=True), id="bias-mean"),
    pytest.param(dict(reduction="mean", softcap=7.5), id="softcap-mean"),
    pytest.param(dict(reduction="mean", label_smoothing=0.1), id="smoothing-mean"),
    pytest.param(dict(reduction="sum", z_loss_weight=1e-3), id="zloss-sum"),
    pytest.param(dict(reduction="mean", **ALL_OPTIONS), id="all-mean"),
    pytest.param(dict(reduction="none", **ALL_OPTIONS), id="all-none"),
]


def plain_flce(hidden, weight, targets, *, bias=None, ignore_index=IGNORE, label_smoothing=0.0,
               z_loss_weight=0.0, softcap=None, token_weights=None, reduction="mean"):
    """The definition, unchunked, on whatever dtype it is given (float64 here); autograd differentiates it."""
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    supervised = targets != ignore_index
    lse = z.logsumexp(dim=1)
    z_y = z.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    z_part = z_loss_weight * lse**2
    loss = (1 - label_smoothing) * (lse - z_y) + label_smoothing * (lse - z.mean(dim=1)) + z_part
    w = supervised.to(z.dtype) if token_weights is None else supervised * token_weights.to(z.dtype)
    loss, z_part = loss * w, z_part * w
    n_tokens = int(supervised.sum())
    n_correct = int((supervised & (z.argmax(dim=1) == targets)).sum())
    if reduction == "none":
        return loss, z_part, n_correct, n_tokens
    loss, z_part = loss.sum(), z_part.sum()
    if reduction == "mean":
        loss, z_part = loss / max(n_tokens, 1), z_part / max(n_tokens, 1)
    return loss, z_part, n_correct, n_tokens


def make_inputs(n, h, v, dtype, *, ignore=True, bias=False, weights=False, seed=0):
    """Random inputs where most odd rows have their target as a clear argmax; every third row is ignored.

    Odd rows get hidden += 8 W[y] / |W[y]|, which lifts z_y about 8 above logits of spread 1, so
    n_correct is far from 0. Their target then becomes the argmax of the exact logits if it leads
    the runner-up by 0.25 (no bf16 rounding of the logits can flip that), else the argmin.
    """
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=gen) / math.sqrt(h)
    hidden = torch.randn(n, h, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    lifted = torch.arange(n) % 2 == 1
    hidden[lifted] += 8.0 * torch.nn.functional.normalize(weight[targets[lifted]], dim=1)
    inputs = dict(hidden=hidden.to(dtype), weight=weight.to(dtype), targets=targets)
    if bias:
        inputs["bias"] = (0.2 * torch.randn(v, generator=gen)).to(dtype)
    z = inputs["hidden"].double() @ inputs["weight"].double().T
    if bias:
        z += inputs["bias"].double()
    top2 = z.topk(2, dim=1)
    clear = top2.values[:, 0] - top2.values[:, 1] > 0.25
    targets[lifted] = torch.where(clear, top2.indices[:, 0], z.argmin(dim=1))[lifted]
    if ignore:
        targets[torch.arange(n) % 3 == 0] = IGNORE
    if weights:
        inputs["token_weights"] = torch.rand(n, generator=gen) * 2
    return {k: t.to(DEVICE) for k, t in inputs.items()}


def run_both(inputs, options, grad_out, chunk_bytes=None):
    """Loss output and gradients of (loss * grad_out).sum(): dispatched path (given the options as one
    `LossOptions`, as the loss head gives them), and plain_flce in float64."""
    diff_names = [k for k in ("hidden", "weight", "bias") if k in inputs]
    ours = {k: (t.clone().requires_grad_() if k in diff_names else t) for k, t in inputs.items()}
    out = fused_linear_cross_entropy(**ours, options=LossOptions(**options, chunk_bytes=chunk_bytes))
    (out.loss * grad_out).sum().backward()
    exact = {k: (t.double().requires_grad_() if k in diff_names else t) for k, t in inputs.items()}
    loss, z_part, n_correct, n_tokens = plain_flce(**exact, **options)
    (loss * grad_out.double()).sum().backward()
    grads = {k: (ours[k].grad, exact[k].grad) for k in diff_names}
    return out, (loss, z_part, n_correct, n_tokens), grads


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol, grad_tol", DTYPES)
@pytest.mark.parametrize("n, h, v", SHAPES)
def test_matches_float64_definition(kernel_path, n, h, v, dtype, tol, grad_tol, case):
    case = dict(case)
    inputs = make_inputs(n, h, v, dtype, ignore=case.pop("ignore", True), bias=case.pop("bias", False),
                         weights=case.pop("weights", False), seed=n * v)
    grad_out = (torch.randn(n) if case["reduction"] == "none" else torch.tensor(1.7)).to(DEVICE)
    # A budget of a few rows: several chunks on both paths.
    out, (loss, z_part, n_correct, n_tokens), grads = run_both(inputs, case, grad_out, chunk_bytes=7 * 16 * v)

    assert out.loss.dtype == torch.float32 and out.loss.shape == loss.shape
    torch.testing.assert_close(out.loss.double(), loss.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.z_loss.double(), z_part.detach(), rtol=tol, atol=tol * 1e-2)
    assert out.n_tokens.item() == n_tokens and out.n_tokens.dtype == torch.int64
    assert out.n_correct.item() == n_correct and out.n_correct.dtype == torch.int64
    assert n_correct > 0
    for name, (got, want) in grads.items():
        assert got.dtype == dtype, name
        assert rel_err(got, want) < grad_tol, name
    if case["reduction"] == "none":
        assert (out.loss[inputs["targets"] == IGNORE] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_gradients(kernel_path, reduction):
    inputs = make_inputs(6, 20, 97, torch.float32, bias=True, weights=True)
    inputs["targets"][:] = IGNORE
    hidden, weight, bias = (inputs[k].requires_grad_() for k in ("hidden", "weight", "bias"))
    out = fused_linear_cross_entropy(**inputs, z_loss_weight=1e-2, label_smoothing=0.1, reduction=reduction)
    out.loss.sum().backward()
    assert (out.loss == 0).all() and (out.z_loss == 0).all()
    assert out.n_tokens.item() == 0 and out.n_correct.item() == 0
    for t in (hidden, weight, bias):
        assert t.grad is not None and (t.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_budget_does_not_change_the_result(kernel_path, dtype):
    inputs = make_inputs(13, 40, 300, dtype, bias=True, weights=True, seed=3)
    results = []
    for chunk_bytes in (1, 5 * 16 * 300, None):  # one row per chunk, a few rows, everything at once
        options = dict(reduction="sum", **KERNEL_OPTIONS)
        out, _, grads = run_both(inputs, options, torch.tensor(1.0, device=DEVICE), chunk_bytes)
        results.append((out.loss, {k: g for k, (g, _) in grads.items()}))
    (loss0, grads0) = results[0]
    for loss, grads in results[1:]:
        # Only the order of float32 (or bf16) accumulation across chunks differs.
        torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-5)
        for k in grads0:
            assert rel_err(grads[k], grads0[k]) < (1e-6 if dtype == torch.float32 else 1e-2), k


def test_argmax_ties_go_to_the_lowest_index(kernel_path):
    # Integer-valued operands make every logit exact, so the ties below are exact on any path.
    v, h = 9001, 4
    weight = torch.zeros(v, h)
    weight[:, 0] = torch.arange(v) % 3  # logits 0..2 from hidden[:, 0]
    weight[[7, 8500, 8600], 1] = 5.0  # tied maxima in both column blocks of the kernel
    weight[[20, 30], 2] = 5.0  # tied maxima inside one block
    hidden = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3 + [[0.0, 0.0, 1.0, 0.0]] * 2 + [[1.0, 0.0, 0.0, 0.0]])
    targets = torch.tensor([7, 8500, 8600, 20, 30, 2])  # the last row: logits 0,1,2,0,1,2...; first max at 2
    out = fused_linear_cross_entropy(hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE))
    assert out.n_correct.item() == 3  # rows 0, 3 and 5


def test_weight_without_grad_and_no_grad_mode(kernel_path):
    # LoRA freezes the output layer: only the hidden gradient is asked for.
    inputs = make_inputs(9, 17, 211, torch.float32, seed=5)
    hidden = inputs["hidden"].clone().requires_grad_()
    out = fused_linear_cross_entropy(hidden, inputs["weight"], inputs["targets"], label_smoothing=0.2)
    out.loss.backward()
    exact_h = inputs["hidden"].double().requires_grad_()
    loss, *_ = plain_flce(exact_h, inputs["weight"].double(), inputs["targets"], label_smoothing=0.2)
    loss.backward()
    assert inputs["weight"].grad is None
    assert rel_err(hidden.grad, exact_h.grad) < 1e-5
    with torch.no_grad():
        again = fused_linear_cross_entropy(hidden, inputs["weight"], inputs["targets"], label_smoothing=0.2)
    assert not again.loss.requires_grad
    torch.testing.assert_close(again.loss, out.loss.detach())


def test_one_backward_per_scalar_forward(kernel_path):
    inputs = make_inputs(4, 8, 33, torch.float32)
    hidden = inputs["hidden"].requires_grad_()
    out = fused_linear_cross_entropy(hidden, inputs["weight"], inputs["targets"])
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        out.loss.backward()


def test_autocast_runs_in_the_autocast_dtype(kernel_path):
    inputs = make_inputs(7, 32, 150, torch.float32, bias=True)
    inputs["hidden"].requires_grad_()
    weight = inputs["weight"].requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(**inputs)
    out.loss.backward()
    want, *_ = plain_flce(**{k: t.to(torch.bfloat16).double() if t.is_floating_point() else t
                             for k, t in inputs.items()})
    assert out.loss.dtype == torch.float32 and weight.grad.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        pytest.param(dict(reduction="avg"), "reduction", id="reduction"),
        pytest.param(dict(label_smoothing=1.5), "label_smoothing", id="smoothing"),
        pytest.param(dict(z_loss_weight=-1e-3), "z_loss_weight", id="zloss"),
        pytest.param(dict(softcap=0.0), "softcap", id="softcap"),
        pytest.param(dict(chunk_bytes=0), "chunk_bytes", id="chunk-bytes"),
        pytest.param(dict(targets=torch.tensor([0, 1, 33])), "outside", id="target-out-of-range"),
        pytest.param(dict(targets=torch.tensor([0, 1])), "targets", id="targets-shape"),
        pytest.param(dict(bias=torch.zeros(32)), "bias", id="bias-shape"),
    ],
)
def test_rejects_bad_arguments(kernel_path, change, message):
    args = dict(hidden=torch.randn(3, 8), weight=torch.randn(33, 8), targets=torch.tensor([0, 1, IGNORE]))
    args.update(change)
    args = {k: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for k, t in args.items()}
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(**args)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options_object_equals_the_keywords(kernel_path, reduction):
    inputs = make_inputs(13, 40, 300, torch.float32, bias=True, weights=True, seed=4)
    keywords = dict(reduction=reduction, chunk_bytes=5 * 16 * 300, **KERNEL_OPTIONS)
    grad_out = (torch.linspace(0.5, 1.5, 13) if reduction == "none" else torch.tensor(1.7)).to(DEVICE)
    results = []
    for how in (keywords, dict(options=LossOptions(**keywords))):
        leaves = {k: inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
        out = fused_linear_cross_entropy(**{**inputs, **leaves}, **how)
        (out.loss * grad_out).sum().backward()
        results.append([out.loss, out.z_loss, out.n_correct, *(t.grad for t in leaves.values())])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_options_go_as_keywords_or_as_one_object_not_both(kernel_path):
    inputs = make_inputs(4, 8, 33, torch.float32)
    with pytest.raises(TypeError, match="not both"):
        fused_linear_cross_entropy(**inputs, label_smoothing=0.1, options=LossOptions(reduction="sum"))


def test_keyword_defaults_are_the_options_defaults():
    """`options=` is checked against `LossOptions()`: the keywords must default to its fields."""
    parameters = inspect.signature(fused_linear_cross_entropy).parameters
    fields = dataclasses.asdict(LossOptions())
    assert {name: parameters[name].default for name in fields} == fields


def test_float64_runs_on_the_reference_path_only(kernel_path):
    inputs = make_inputs(7, 8, 33, torch.float64, bias=True)
    if kernel_path == "triton":
        with pytest.raises(ValueError, match="Triton path takes"):
            fused_linear_cross_entropy(**inputs)
        return
    out = fused_linear_cross_entropy(**inputs, label_smoothing=0.1, chunk_bytes=1)
    want, *_ = plain_flce(**inputs, label_smoothing=0.1)
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "n, v, elem, budget",
    [
        pytest.param(8192, 128256, 2, 1 << 30, id="llama3-1GiB"),
        pytest.param(8192, 128256, 2, 96 << 20, id="llama3-96MiB"),
        pytest.param(16384, 152064, 4, 1 << 30, id="qwen-fp32"),
        pytest.param(37, 1001, 4, 1, id="one-row"),
        pytest.param(0, 1001, 4, 1 << 30, id="empty"),
    ],
)
def test_chunk_rows_respect_the_budget(n, v, elem, budget):
    rows = _chunk_rows(n, v, elem, budget)
    assert rows >= 1
    assert rows * v * elem <= max(budget, v * elem)
    n_chunks = math.ceil(n / rows)
    # As few chunks as the budget allows.
    assert n_chunks == math.ceil(n / max(1, budget // (v * elem)))
