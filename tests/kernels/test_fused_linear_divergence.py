"""Fused linear divergence: both paths against the definition in float64, values and gradients.

The Triton path runs under TRITON_INTERPRET=1 on the CPU (see conftest.py), where each row's
program costs tens of milliseconds, so the shapes stay small (a dozen rows); they are odd on
purpose, the teacher's hidden size differs from the student's, and one vocabulary (4099) spans two
column blocks of the kernel. With TRITON_INTERPRET=0 on a GPU machine the same tests run on CUDA
with the compiled kernels.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kernel_testing import DEVICE, rel_err

from ligertune.kernels import DIVERGENCES, DivergenceOptions, fused_linear_divergence

IGNORE = -100

SHAPES = [
    pytest.param(13, 123, 77, 1001, id="N13-H123-Ht77-V1001"),
    pytest.param(5, 16, 16, 130, id="N5-H16-Ht16-V130"),
    pytest.param(11, 48, 64, 4099, id="N11-H48-Ht64-V4099"),
]

# (dtype, relative tolerance on the four values, on whole gradient tensors). The logits are rounded
# to the input dtype, 2^-9 of their size in bf16, and so are the gradients: against the float64
# definition of the same (rounded) inputs the bf16 rows measure up to 3e-3 on values and 1.8e-2 on
# gradients, the fp32 rows 2e-6.
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 3e-2, id="bf16"),
]

EVERY_OPTION = dict(bias=True, teacher_bias=True, weights=True, softcap=7.5, teacher_softcap=5.0,
                    temperature=2.0, ce_weight=0.3, beta=0.3, reduction="mean")
CASES = [
    pytest.param(dict(divergence="forward_kl", ignore=False), id="fkl-plain"),
    pytest.param(dict(divergence="forward_kl", reduction="mean"), id="fkl-ignored-mean"),
    pytest.param(dict(divergence="forward_kl", temperature=0.7), id="fkl-tau0.7"),
    pytest.param(dict(divergence="forward_kl", temperature=2.0, ce_weight=0.3), id="fkl-tau2-alpha0.3"),
    pytest.param(dict(divergence="forward_kl", teacher_softcap=5.0, bias=True), id="fkl-teachercap-bias"),
    pytest.param(dict(divergence="reverse_kl"), id="rkl"),
    pytest.param(dict(divergence="reverse_kl", temperature=2.0, reduction="mean"), id="rkl-tau2-mean"),
    pytest.param(dict(divergence="reverse_kl", ce_weight=1.0, weights=True), id="rkl-alpha1-weights"),
    pytest.param(dict(divergence="reverse_kl", softcap=7.5, teacher_bias=True), id="rkl-cap-teacherbias"),
    pytest.param(dict(divergence="jsd"), id="jsd-beta0.5"),
    pytest.param(dict(divergence="jsd", beta=0.1, temperature=0.7), id="jsd-beta0.1-tau0.7"),
    pytest.param(dict(divergence="jsd", beta=0.9, temperature=2.0, weights=True),
                 id="jsd-beta0.9-tau2-weights"),
    pytest.param(dict(divergence="jsd", ce_weight=0.3, softcap=7.5, teacher_softcap=5.0),
                 id="jsd-alpha0.3-caps"),
    *(pytest.param(dict(divergence=d, **EVERY_OPTION), id=f"every-option-{d}") for d in DIVERGENCES),
]
# The wide vocabulary runs the rows with every option (each divergence), not every case.
WIDE_CASES = CASES[-3:]


def plain_divergence(hidden, weight, teacher_hidden, teacher_weight, targets, *, bias=None, teacher_bias=None,
                     token_weights=None, options=DivergenceOptions()):
    """The definition, unfused, on whatever dtype it is given (float64 here); autograd differentiates it.

    Returns loss, divergence, ce, teacher_ce, and the counts n_correct, teacher_correct, n_tokens."""
    o = options
    z_s = hidden @ weight.T + (0.0 if bias is None else bias)
    z_t = teacher_hidden @ teacher_weight.T + (0.0 if teacher_bias is None else teacher_bias)
    if o.softcap is not None:
        z_s = o.softcap * torch.tanh(z_s / o.softcap)
    if o.teacher_softcap is not None:
        z_t = o.teacher_softcap * torch.tanh(z_t / o.teacher_softcap)
    log_q = torch.log_softmax(z_s / o.temperature, dim=1)
    log_p = torch.log_softmax(z_t / o.temperature, dim=1)
    q, p = log_q.exp(), log_p.exp()
    if o.divergence == "forward_kl":
        d = (p * (log_p - log_q)).sum(dim=1)
    elif o.divergence == "reverse_kl":
        d = (q * (log_q - log_p)).sum(dim=1)
    else:
        log_m = (o.beta * p + (1 - o.beta) * q).log()
        d = o.beta * (p * (log_p - log_m)).sum(dim=1) + (1 - o.beta) * (q * (log_q - log_m)).sum(dim=1)
    supervised = targets != o.ignore_index
    y = targets.clamp(min=0)[:, None]
    ce = z_s.logsumexp(dim=1) - z_s.gather(1, y).squeeze(1)
    teacher_ce = z_t.logsumexp(dim=1) - z_t.gather(1, y).squeeze(1)
    w = supervised.to(z_s.dtype)
    if token_weights is not None:
        w = w * token_weights.to(z_s.dtype)
    n_tokens = int(supervised.sum())
    scale = 1.0 / max(n_tokens, 1) if o.reduction == "mean" else 1.0
    loss = (1 - o.ce_weight) * d + o.ce_weight * ce
    sums = [(x * w).sum() * scale for x in (loss, d, ce, teacher_ce)]
    counts = [int((supervised & (z.argmax(dim=1) == targets)).sum()) for z in (z_s, z_t)]
    return (*sums, *counts, n_tokens)


def _clear(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rows whose target is the argmax by at least 0.25, or below it by at least that much: no rounding
    of bf16 logits can change whether it is the argmax."""
    z_y = z.gather(1, targets[:, None]).squeeze(1)
    rest = z.scatter(1, targets[:, None], -math.inf).amax(dim=1)
    return (z_y - rest).abs() > 0.25


def _exact_logits(inputs: dict, prefix: str) -> torch.Tensor:
    z = inputs[f"{prefix}hidden"].double() @ inputs[f"{prefix}weight"].double().T
    if f"{prefix}bias" in inputs:
        z += inputs[f"{prefix}bias"].double()
    return z


def make_inputs(n, h, ht, v, dtype, *, ignore=True, bias=False, teacher_bias=False, weights=False, seed=0,
                teacher_scale=1.0):
    """Random student and teacher whose targets are the clear argmax of some rows, on purpose.

    Logits of spread about 1 (the teacher's `teacher_scale` times that); the student's odd rows and
    three rows in four of the teacher's get hidden += 8 W[y] / |W[y]|, which lifts z_y about 8 above
    the rest, so both argmax counts are far from 0 and differ. Every target is the argmax of the
    exact logits by at least 0.25, or below it by as much (`_clear`), for both models; every third
    row is ignored.
    """
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=gen) / math.sqrt(h)
    teacher_weight = teacher_scale * torch.randn(v, ht, generator=gen) / math.sqrt(ht)
    hidden = torch.randn(n, h, generator=gen)
    teacher_hidden = torch.randn(n, ht, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    rows = torch.arange(n)
    for x, w, lifted in ((hidden, weight, rows % 2 == 1), (teacher_hidden, teacher_weight, rows % 4 != 0)):
        x[lifted] += 8.0 * torch.nn.functional.normalize(w[targets[lifted]], dim=1)
    inputs = dict(hidden=hidden.to(dtype), weight=weight.to(dtype), teacher_hidden=teacher_hidden.to(dtype),
                  teacher_weight=teacher_weight.to(dtype), targets=targets)
    if bias:
        inputs["bias"] = (0.2 * torch.randn(v, generator=gen)).to(dtype)
    if teacher_bias:
        inputs["teacher_bias"] = (0.2 * torch.randn(v, generator=gen)).to(dtype)
    z_s, z_t = (_exact_logits(inputs, prefix) for prefix in ("", "teacher_"))
    # A target too near either model's maximum goes to a column far below both.
    unclear = ~(_clear(z_s, targets) & _clear(z_t, targets))
    targets[unclear] = torch.maximum(z_s, z_t).argmin(dim=1)[unclear]
    assert (_clear(z_s, targets) & _clear(z_t, targets)).all()
    if ignore:
        targets[rows % 3 == 0] = IGNORE
    if weights:
        inputs["token_weights"] = torch.rand(n, generator=gen) * 2
    return {k: t.to(DEVICE) for k, t in inputs.items()}


STUDENT = ("hidden", "weight", "bias")
TEACHER = ("teacher_hidden", "teacher_weight", "teacher_bias")


def run_both(inputs, options, grad_out=1.7):
    """The dispatched path's output and the gradients of grad_out * loss (the teacher's tensors
    requiring grad too, to show none reaches them), and the same from plain_divergence in float64."""
    leaves = [k for k in (*STUDENT, *TEACHER) if k in inputs]
    ours = {k: (t.clone().requires_grad_() if k in leaves else t) for k, t in inputs.items()}
    out = fused_linear_divergence(**ours, options=options)
    (out.loss * grad_out).backward()
    for k in TEACHER:
        assert k not in ours or ours[k].grad is None, k
    exact = {k: (t.double().requires_grad_() if k in leaves else t) for k, t in inputs.items()}
    want = plain_divergence(**exact, options=options)
    (want[0] * grad_out).backward()
    grads = {k: (ours[k].grad, exact[k].grad) for k in STUDENT if k in inputs}
    return out, want, grads


def split_case(case: dict) -> tuple[dict, dict]:
    """(make_inputs flags, DivergenceOptions fields) of a CASES row."""
    flags = {k: case.pop(k) for k in ("ignore", "bias", "teacher_bias", "weights") if k in case}
    return flags, case


def check_against_definition(n, h, ht, v, dtype, tol, grad_tol, case):
    flags, fields = split_case(dict(case))
    inputs = make_inputs(n, h, ht, v, dtype, **flags, seed=n * v)
    # A budget of a few rows: several chunks on both paths.
    options = DivergenceOptions(**fields, chunk_bytes=5 * 16 * v)
    out, want, grads = run_both(inputs, options)
    loss, divergence, ce, teacher_ce, n_correct, teacher_correct, n_tokens = want

    assert out.loss.dtype == torch.float32 and out.loss.shape == () and out.loss.requires_grad
    for name, value in (("loss", loss), ("divergence", divergence), ("ce", ce), ("teacher_ce", teacher_ce)):
        got = getattr(out, name)
        assert name == "loss" or not got.requires_grad, name
        assert abs(got.item() - value.item()) <= tol * abs(value.item()) + 1e-6, (name, got, value)
    assert out.n_tokens.dtype == torch.int64 and out.n_tokens.item() == n_tokens
    assert out.n_correct.dtype == torch.int64 and out.n_correct.item() == n_correct
    assert out.teacher_correct.dtype == torch.int64 and out.teacher_correct.item() == teacher_correct
    assert n_correct > 0 and teacher_correct > 0 and n_correct != teacher_correct
    for name, (got, expected) in grads.items():
        assert got.dtype == dtype, name
        assert rel_err(got, expected) < grad_tol, (name, rel_err(got, expected))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol, grad_tol", DTYPES)
@pytest.mark.parametrize("n, h, ht, v", SHAPES[:2])
def test_matches_float64_definition(kernel_path, n, h, ht, v, dtype, tol, grad_tol, case):
    check_against_definition(n, h, ht, v, dtype, tol, grad_tol, case)


@pytest.mark.parametrize("case", WIDE_CASES)
@pytest.mark.parametrize("dtype, tol, grad_tol", DTYPES)
@pytest.mark.parametrize("n, h, ht, v", SHAPES[2:])
def test_two_column_blocks_match_float64_definition(kernel_path, n, h, ht, v, dtype, tol, grad_tol, case):
    check_against_definition(n, h, ht, v, dtype, tol, grad_tol, case)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_probabilities_that_underflow_count_zero(kernel_path, divergence):
    """A peaked teacher (logits of spread ~40, /0.7) underflows most of P to 0 in float32 (exp below
    -104), not in float64: 0 log 0 must give 0, and log M must not be taken of an underflowed sum."""
    inputs = make_inputs(13, 40, 24, 300, torch.float32, bias=True, seed=5, teacher_scale=40.0)
    options = DivergenceOptions(divergence=divergence, temperature=0.7, beta=0.2, ce_weight=0.1)
    out, want, grads = run_both(inputs, options)
    for got, value in zip((out.loss, out.divergence, out.ce, out.teacher_ce), want[:4]):
        assert math.isfinite(got.item())
        assert abs(got.item() - value.item()) <= 1e-5 * abs(value.item()) + 1e-6
    for name, (got, expected) in grads.items():
        assert rel_err(got, expected) < 1e-5, name


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_teacher_equal_to_student_gives_zero_divergence_and_gradient(kernel_path, divergence):
    inputs = make_inputs(9, 32, 32, 211, torch.float32, bias=True, seed=7)
    student = {k: inputs[k] for k in STUDENT}
    options = DivergenceOptions(divergence=divergence, temperature=2.0, softcap=6.0, teacher_softcap=6.0)
    leaves = {k: t.clone().requires_grad_() for k, t in student.items()}
    teacher = {f"teacher_{k}": t for k, t in student.items()}
    out = fused_linear_divergence(**leaves, **teacher, targets=inputs["targets"], options=options)
    out.loss.backward()
    assert abs(out.divergence.item()) < 1e-6 and abs(out.loss.item()) < 1e-6
    torch.testing.assert_close(out.ce, out.teacher_ce)
    assert out.n_correct.item() == out.teacher_correct.item() > 0
    for name, t in leaves.items():
        assert t.grad.abs().max().item() < 1e-6, name


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_all_ignored_gives_zero_loss_and_zero_gradients(kernel_path, divergence):
    inputs = make_inputs(6, 20, 12, 97, torch.float32, bias=True, weights=True)
    inputs["targets"][:] = IGNORE
    leaves = {k: inputs[k].requires_grad_() for k in STUDENT}
    out = fused_linear_divergence(**inputs, options=DivergenceOptions(divergence=divergence, ce_weight=0.5,
                                                                      reduction="mean"))
    out.loss.backward()
    for name in ("loss", "divergence", "ce", "teacher_ce", "n_correct", "teacher_correct", "n_tokens"):
        assert getattr(out, name).item() == 0, name
    for name, t in leaves.items():
        assert t.grad is not None and (t.grad == 0).all(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_budget_does_not_change_the_result(kernel_path, dtype):
    inputs = make_inputs(13, 40, 24, 300, dtype, bias=True, weights=True, seed=3)
    results = []
    for chunk_bytes in (1, 5 * 16 * 300, None):  # one row per chunk, a few rows, everything at once
        options = DivergenceOptions(divergence="jsd", ce_weight=0.2, temperature=2.0, chunk_bytes=chunk_bytes)
        leaves = {k: inputs[k].clone().requires_grad_() for k in STUDENT}
        out = fused_linear_divergence(**{**inputs, **leaves}, options=options)
        out.loss.backward()
        results.append((out, {k: t.grad for k, t in leaves.items()}))
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        # Only the order of float32 (or bf16) accumulation across chunks differs.
        for name in ("loss", "divergence", "ce", "teacher_ce"):
            torch.testing.assert_close(getattr(out, name), getattr(out0, name), rtol=1e-5, atol=1e-6)
        assert out.n_correct == out0.n_correct and out.teacher_correct == out0.teacher_correct
        for k in grads0:
            assert rel_err(grads[k], grads0[k]) < (1e-6 if dtype == torch.float32 else 1e-2), k


@pytest.mark.parametrize("case", WIDE_CASES)
def test_many_column_blocks_match_float64_definition(triton_path, monkeypatch, case):
    """Blocks of 64 columns over a vocabulary of 1001: a row's maximum is found in a later block for
    most rows, so every running sum is rescaled on the way (at the vocabulary of 4099 above, the
    second block holds 3 columns and rarely the maximum)."""
    import ligertune.kernels.divergence as triton_divergence

    config = triton_divergence._row_kernel_config
    monkeypatch.setattr(triton_divergence, "_row_kernel_config",
                        lambda vocab: (64, config(vocab)[1]))
    check_against_definition(13, 123, 77, 1001, torch.float32, 1e-5, 1e-5, case)


def test_argmax_ties_go_to_the_lowest_index(kernel_path):
    # Integer-valued operands make every logit exact, so the ties below are exact on any path.
    v, h = 4099, 4
    weight = torch.zeros(v, h)
    weight[:, 0] = torch.arange(v) % 3  # logits 0..2 from hidden[:, 0]
    teacher_weight = weight.clone()
    weight[[7, 4000, 4097], 1] = 5.0  # tied maxima in both column blocks of the kernel (4096 columns)
    weight[[20, 30], 2] = 5.0  # tied maxima inside one block
    teacher_weight[[4000, 4098], 1] = 5.0  # the teacher's first maximum is another target
    teacher_weight[[20, 30], 2] = 5.0
    teacher_weight[25, 2] = 6.0  # and above both targets of rows 3 and 4
    hidden = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3 + [[0.0, 0.0, 1.0, 0.0]] * 2 + [[1.0, 0.0, 0.0, 0.0]])
    targets = torch.tensor([7, 4000, 4097, 20, 30, 2])  # the last row: logits 0,1,2,0,1,2...; first max at 2
    out = fused_linear_divergence(hidden.to(DEVICE), weight.to(DEVICE), hidden.to(DEVICE),
                                  teacher_weight.to(DEVICE), targets.to(DEVICE))
    assert out.n_correct.item() == 3  # rows 0, 3 and 5
    assert out.teacher_correct.item() == 2  # rows 1 and 5


def test_weight_without_grad_and_no_grad_mode(kernel_path):
    # LoRA freezes the output layer: only the hidden gradient is asked for.
    inputs = make_inputs(9, 17, 21, 211, torch.float32, seed=5)
    options = DivergenceOptions(divergence="reverse_kl", ce_weight=0.2)
    hidden = inputs["hidden"].clone().requires_grad_()
    out = fused_linear_divergence(**{**inputs, "hidden": hidden}, options=options)
    out.loss.backward()
    exact_h = inputs["hidden"].double().requires_grad_()
    loss, *_ = plain_divergence(**{k: t.double() if t.is_floating_point() else t for k, t in inputs.items()
                                   if k != "hidden"}, hidden=exact_h, options=options)
    loss.backward()
    assert inputs["weight"].grad is None
    assert rel_err(hidden.grad, exact_h.grad) < 1e-5
    with torch.no_grad():
        again = fused_linear_divergence(**{**inputs, "hidden": hidden}, options=options)
    assert not again.loss.requires_grad
    torch.testing.assert_close(again.loss, out.loss.detach())


def test_one_backward_per_forward(kernel_path):
    inputs = make_inputs(4, 8, 8, 33, torch.float32)
    inputs["hidden"].requires_grad_()
    out = fused_linear_divergence(**inputs)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        out.loss.backward()


def test_teacher_in_another_dtype(kernel_path):
    """A float32 student against a bf16 teacher: each logits buffer in its own dtype."""
    inputs = make_inputs(11, 24, 40, 257, torch.float32, bias=True, teacher_bias=True, seed=2)
    for k in TEACHER:
        inputs[k] = inputs[k].to(torch.bfloat16)
    options = DivergenceOptions(divergence="jsd", ce_weight=0.5)
    out, want, grads = run_both(inputs, options)
    for got, value in zip((out.loss, out.divergence, out.ce, out.teacher_ce), want[:4]):
        # The teacher's logits are rounded to bf16 before the divergence; the definition's are not.
        assert abs(got.item() - value.item()) <= 2e-2 * abs(value.item()) + 1e-4
    for name, (got, expected) in grads.items():
        assert got.dtype == torch.float32 and rel_err(got, expected) < 2e-2, name


def test_autocast_runs_in_the_autocast_dtype(kernel_path):
    inputs = make_inputs(7, 32, 16, 150, torch.float32, bias=True)
    weight = inputs["weight"].requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fused_linear_divergence(**inputs, options=DivergenceOptions(divergence="jsd"))
    out.loss.backward()
    want, *_ = plain_divergence(**{k: t.to(torch.bfloat16).double() if t.is_floating_point() else t
                                   for k, t in inputs.items()}, options=DivergenceOptions(divergence="jsd"))
    assert out.loss.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert abs(out.loss.item() - want.item()) <= 3e-2 * abs(want.item())


def test_float64_runs_on_the_reference_path_only(kernel_path):
    inputs = make_inputs(7, 8, 12, 33, torch.float64, bias=True)
    options = DivergenceOptions(divergence="reverse_kl", temperature=1.5, ce_weight=0.4, chunk_bytes=1)
    if kernel_path == "triton":
        with pytest.raises(ValueError, match="Triton path takes"):
            fused_linear_divergence(**inputs, options=options)
        return
    out = fused_linear_divergence(**inputs, options=options)
    want, *_ = plain_divergence(**inputs, options=options)
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "field, value",
    [
        pytest.param("divergence", "kl", id="divergence"),
        pytest.param("beta", 0.0, id="beta-0"),
        pytest.param("beta", 1.0, id="beta-1"),
        pytest.param("temperature", 0.0, id="temperature-0"),
        pytest.param("temperature", math.inf, id="temperature-inf"),
        pytest.param("ce_weight", 1.5, id="ce-weight-above-1"),
        pytest.param("ce_weight", -0.1, id="ce-weight-negative"),
        pytest.param("softcap", 0.0, id="softcap"),
        pytest.param("teacher_softcap", -1.0, id="teacher-softcap"),
        pytest.param("reduction", "none", id="reduction-none"),
        pytest.param("chunk_bytes", 0, id="chunk-bytes"),
    ],
)
def test_bad_options_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        DivergenceOptions(**{field: value})


@pytest.mark.parametrize(
    "change, message",
    [
        pytest.param(dict(teacher_weight=torch.randn(34, 5)), "vocabulary", id="vocabulary-mismatch"),
        pytest.param(dict(teacher_hidden=torch.randn(4, 5)), "rows", id="teacher-rows"),
        pytest.param(dict(teacher_hidden=torch.randn(3, 6)), "teacher_hidden", id="teacher-hidden-size"),
        pytest.param(dict(teacher_bias=torch.zeros(32)), "teacher_bias", id="teacher-bias-shape"),
        pytest.param(dict(bias=torch.zeros(32)), "bias", id="bias-shape"),
        pytest.param(dict(targets=torch.tensor([0, 1, 33])), "outside", id="target-out-of-range"),
    ],
)
def test_rejects_bad_arguments(kernel_path, change, message):
    args = dict(hidden=torch.randn(3, 8), weight=torch.randn(33, 8), teacher_hidden=torch.randn(3, 5),
                teacher_weight=torch.randn(33, 5), targets=torch.tensor([0, 1, IGNORE]))
    args.update(change)
    args = {k: t.to(DEVICE) for k, t in args.items()}
    with pytest.raises(ValueError, match=message):
        fused_linear_divergence(**args)


def test_options_defaults_are_the_documented_ones():
    """The training objective is written against these defaults."""
    assert dataclasses.asdict(DivergenceOptions()) == dict(
        divergence="forward_kl", beta=0.5, temperature=1.0, ce_weight=0.0, ignore_index=-100, softcap=None,
        teacher_softcap=None, reduction="sum", chunk_bytes=None,
    )
