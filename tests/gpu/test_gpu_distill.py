"""Distillation on a GPU: the fused divergence at a real vocabulary against the reference (values,
gradients, and a working set bounded by its chunk), and bf16 runs through `train` with the teacher in
bf16 and in 4 bits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from gpu_testing import assert_matches_reference
from tiny_recipe import STUDENT, save_tiny_model, write_distill_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.kernels import DivergenceOptions, fused_linear_divergence, reference
from ligertune.metrics import read_metrics

pytestmark = pytest.mark.gpu


def divergence_inputs(n: int, h: int, ht: int, v: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, grad=False):
        t = torch.randn(*shape, generator=gen, device="cuda") * scale
        return t.to(torch.bfloat16).requires_grad_(grad)

    targets = torch.randint(0, v, (n,), generator=gen, device="cuda")
    targets[torch.rand(n, generator=gen, device="cuda") < 0.3] = -100  # the prompts
    return {"hidden": randn(n, h, grad=True), "weight": randn(v, h, scale=h ** -0.5, grad=True),
            "teacher_hidden": randn(n, ht), "teacher_weight": randn(v, ht, scale=ht ** -0.5),
            "targets": targets}


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_the_fused_divergence_matches_the_reference_at_a_real_vocabulary(loss: str):
    """2,048 rows of a 2,048-wide student and a 4,096-wide teacher over Llama 3's 128,256 tokens, in
    several chunks (a 256 MiB budget), temperature 2 and alpha 0.3."""
    options = DivergenceOptions(divergence=loss, temperature=2.0, ce_weight=0.3, chunk_bytes=256 << 20)

    def run(fn):
        def outputs(hidden, weight, teacher_hidden, teacher_weight, targets):
            out = fn(hidden, weight, teacher_hidden, teacher_weight, targets, options=options)
            return {"loss": out.loss, "divergence": out.divergence, "ce": out.ce, "teacher_ce": out.teacher_ce,
                    "n_correct": out.n_correct, "teacher_correct": out.teacher_correct}
        return outputs

    assert_matches_reference(run(fused_linear_divergence), run(reference.fused_linear_divergence),
                             divergence_inputs(2048, 2048, 4096, 128_256),
                             counts=("n_correct", "teacher_correct"))


def test_the_fused_divergence_holds_one_chunk_of_logits_whatever_the_vocabulary():
    """Beyond its inputs and the gradients it returns, the forward + backward allocates about one chunk
    of each model's logits: the same extra bytes for 32k and for 128k tokens under one budget."""
    budget = 128 << 20
    extra = {}
    for v in (32_000, 128_256):
        inputs = divergence_inputs(4096, 2048, 2048, v)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fused_linear_divergence(*inputs.values(), options=DivergenceOptions(chunk_bytes=budget))
        out.loss.backward()
        torch.cuda.synchronize()
        returned = inputs["hidden"].numel() * 2 + inputs["weight"].numel() * 2  # their bf16 gradients
        extra[v] = torch.cuda.max_memory_allocated() - before - returned
        del inputs, out
    assert max(extra.values()) <= 2 * budget, extra
    # What the chunk loop holds is set by the budget, not the vocabulary: logits over 128k tokens
    # for 4,096 rows would be 1 GiB in bf16 for each model.
    assert abs(extra[128_256] - extra[32_000]) <= budget // 2, extra


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-teacher", "nf4-teacher"])
def test_a_bf16_distillation_run_brings_the_student_to_its_teacher(tmp_path: Path, quantized: bool):
    if quantized and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (pip install 'ligertune[qlora]')")
    teacher = save_tiny_model(tmp_path / "teacher", seed=1)
    objective = {"loss": "jsd", "teacher_quantization": "nf4"} if quantized else {"loss": "jsd"}
    path = write_distill_recipe(tmp_path, teacher=teacher, objective=objective, optim={"lr": 1e-2},
                                model={"config": dict(STUDENT), "dtype": "bfloat16"},
                                train={"max_steps": 20, "eval_every": 10, "eval_at_start": True, "device": "cuda"})
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval_loss" in r]
    assert len({r["eval_teacher_ce"] for r in evals}) == 1  # frozen
    assert evals[-1]["eval_divergence"] < 0.7 * evals[0]["eval_divergence"], evals
