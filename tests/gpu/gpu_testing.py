"""Helpers of the GPU tests: one forward + backward with named results, and the tolerance rule.

A kernel is compared with the reference computed in a higher precision (float32 for bf16 inputs,
float64 for float32 inputs), output by output and gradient by gradient, by the relative error
||a - b|| / ||b||. It passes when its error is within twice that of the reference run in the
kernel's own dtype (the error that any implementation in that dtype has), or under a small floor.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ligertune.numerics import relative_error

FLOORS = {torch.bfloat16: 2e-3, torch.float16: 2e-3, torch.float32: 1e-5}
HIGHER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}

Outputs = dict[str, torch.Tensor]


def forward_backward(fn: Callable[..., Outputs], inputs: Outputs, grad_outputs: Outputs | None = None) -> Outputs:
    """The outputs of `fn(**inputs)` (named tensors) after one backward, and `grad_NAME` for every
    input NAME that requires grad.

    Without `grad_outputs` the scalar output "loss" is backpropagated; otherwise every output that
    `grad_outputs` names, with its upstream gradient (cast to the output's dtype).
    """
    leaves = {name: t for name, t in inputs.items() if t.requires_grad}
    outputs = fn(**inputs)
    if grad_outputs is None:
        outputs["loss"].backward()
    else:
        names = list(grad_outputs)
        torch.autograd.backward([outputs[n] for n in names],
                                [grad_outputs[n].to(outputs[n].dtype) for n in names])
    results = {name: out.detach() for name, out in outputs.items()}
    for name, t in leaves.items():
        results[f"grad_{name}"] = t.grad
        t.grad = None
    return results


def upcast(inputs: Outputs, dtype: torch.dtype) -> Outputs:
    """The floating inputs in `dtype` (leaves again); integer targets stay as they are, and so do token
    weights, which the kernels take in float32 whatever the dtype of the rest."""
    def cast(name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or name == "token_weights":
            return t
        return t.detach().to(dtype).requires_grad_(t.requires_grad)

    return {name: cast(name, t) for name, t in inputs.items()}


def assert_matches_reference(
    kernel: Callable[..., Outputs],
    reference: Callable[..., Outputs],
    inputs: Outputs,
    grad_outputs: Outputs | None = None,
    *,
    counts: tuple[str, ...] = (),
) -> None:
    """Every output and gradient of `kernel` on `inputs` within the tolerance rule (module docstring);
    the integer outputs named in `counts` equal to the higher-precision reference's, give or take one
    in ten thousand (an argmax may flip on a near tie)."""
    dtype = next(t.dtype for t in inputs.values() if t.requires_grad)
    got = forward_backward(kernel, inputs, grad_outputs)
    same = forward_backward(reference, inputs, grad_outputs)
    precise = forward_backward(reference, upcast(inputs, HIGHER[dtype]), grad_outputs)
    failures = []
    for name, want in precise.items():
        if name in counts:
            n_got, n_want = int(got[name]), int(want)
            if abs(n_got - n_want) > max(1, n_want // 10_000):
                failures.append(f"{name}: {n_got}, the reference {n_want}")
            continue
        error = relative_error(got[name], want)
        yardstick = relative_error(same[name], want)
        limit = max(FLOORS[dtype], 2.0 * yardstick) if math.isfinite(yardstick) else FLOORS[dtype]
        if not error <= limit:  # a NaN error fails too
            failures.append(f"{name}: error {error:.2e} over {limit:.2e} "
                            f"(the same-dtype reference's {yardstick:.2e})")
    assert not failures, "; ".join(failures)
