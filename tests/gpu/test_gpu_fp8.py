"""FP8 training on a float8 GPU (compute capability 8.9+), driven as a user drives it: 200 steps of the
same recipe in bf16 and in fp8 (ligertune's layers, those with the weights' gradients in float8 too,
and torchao's at either scaling) end within 1% of each other's loss, torchao's rowwise recipe within
2% (it casts the output gradients to e4m3 too, and drifts furthest: 1.49% on an H200, docs/fp8.md);
the curves are written beside the runs, and printed. LoRA over a float8 base starts where bf16
LoRA starts.

The 200 steps are one pass over the data (no pack seen twice, as a fine-tune runs) at a learning
rate the model trains well at. Over several epochs of a small set, or at 3x that rate (where the
loss ends higher), two curves apart by rounding alone drift apart by several percent, either way,
from one seed to the next: such a test measures the drift more than float8 (docs/PERF.md,
2026-11-28, sixth run).

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/gpu/test_gpu_fp8.py -q -s
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from cli_runs import ligertune, train_records
from tiny_recipe import TINY_MODEL, write_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                       reason="torchao is not installed (pip install 'ligertune[fp8]')"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a GPU with float8 tensor cores (compute capability 8.9+)"),
]

# Wide enough that the float8 GEMMs are the tensor cores' and the scales see real ranges.
MODEL = {**TINY_MODEL, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2}
STEPS = 200
ONE_PASS = 2500
"""Conversations that pack into 810 rows of 256 tokens: 202 steps of 4 rows."""


def losses(tmp_path: Path, name: str, recipe: Path, *overrides: str, packs_at_least: int = 0) -> list[float]:
    result = ligertune("train", str(recipe), "-o", str(tmp_path / name),
                       *(arg for item in overrides for arg in ("--set", item)), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    packs = re.search(r"([\d,]+)\s+packs\s+of", result.stdout)
    assert packs and int(packs[1].replace(",", "")) >= packs_at_least, result.stdout[:2000]
    return [r["loss"] for r in train_records(tmp_path / name)]


def test_200_fp8_steps_end_within_1_percent_of_bf16(tmp_path: Path):
    recipe = write_recipe(tmp_path, n_train=ONE_PASS, model={"config": MODEL, "dtype": "bfloat16"},
                          optim={"lr": 3e-4, "warmup_steps": 10},
                          train={"max_steps": STEPS, "micro_batch_size": 4, "grad_accum_steps": 1,
                                 "eval_every": None})
    torchao = "kernels.float8_linear=false"
    curves = {"bf16": losses(tmp_path, "bf16", recipe, packs_at_least=4 * STEPS),  # one pass
              "fp8": losses(tmp_path, "fp8", recipe, "train.precision=fp8"),  # ligertune's layers
              "fp8, float8 weight gradients": losses(tmp_path, "fp8-wgrad", recipe, "train.precision=fp8",
                                                     "kernels.float8_weight_grad=true"),
              "fp8 torchao tensorwise": losses(tmp_path, "fp8-torchao", recipe, "train.precision=fp8", torchao),
              "fp8 torchao rowwise": losses(tmp_path, "fp8-torchao-rowwise", recipe, "train.precision=fp8", torchao,
                                            "train.fp8_scaling=rowwise")}
    (tmp_path / "curves.json").write_text(json.dumps(curves))
    assert all(len(curve) == STEPS for curve in curves.values())
    end = {name: statistics.mean(curve[-20:]) for name, curve in curves.items()}  # the last 20 steps
    print("\nmean loss of steps 181-200:", {k: round(v, 4) for k, v in end.items()},
          "step 1:", {k: round(v[0], 4) for k, v in curves.items()})
    assert curves["bf16"][-1] < 0.5 * curves["bf16"][0]  # it learned
    for name in curves.keys() - {"bf16"}:
        bound = 0.02 if name == "fp8 torchao rowwise" else 0.01  # its e4m3 gradients: 1.49% measured
        assert abs(end[name] - end["bf16"]) <= bound * end["bf16"], (name, end)


def test_lora_over_a_float8_base_starts_as_bf16_lora(tmp_path: Path):
    recipe = write_recipe(tmp_path, model={"config": MODEL, "dtype": "bfloat16"}, lora={"r": 16, "alpha": 32},
                          train={"max_steps": 3, "micro_batch_size": 4, "grad_accum_steps": 1, "eval_every": None})
    bf16 = losses(tmp_path, "bf16", recipe)
    fp8 = losses(tmp_path, "fp8", recipe, "train.precision=fp8")
    assert fp8[0] == pytest.approx(bf16[0], rel=1e-2)  # B = 0: the base model's loss, through float8
    assert fp8[-1] < fp8[0]
