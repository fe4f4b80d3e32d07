"""`gradient_checkpointing: auto` on the GPU at long context: the plan it makes for a budget fits it.

One conversation of 32,768 tokens a step, and one of 131,072 (the length where the planner once picked
a plan that ran out of memory), through an 8-layer model, where the layers' activations are most of
the step's memory. The step's peak with every layer kept and with every layer recomputed
bounds the budgets worth asking for; for budgets in between, the planner must keep some layers and
recompute others, and the step it plans (its peak measured over a timed step after the two planning
steps, as `bench step` measures it) must stay within the budget, and within 5% of its own prediction.

    TRITON_INTERPRET=0 python -m pytest -m gpu tests/gpu/test_gpu_planner.py -q -s
"""

from __future__ import annotations

import re

import pytest
import yaml
from tiny_recipe import QUICKSTART

from ligertune.bench.step import StepBenchConfig, run_step_bench
from ligertune.recipe import load_recipe

pytestmark = pytest.mark.gpu

LAYERS = 8


def planned_step(tmp_path, tokens: int, budget_gib: float, offload: bool | str = False) -> tuple[float, int, float]:
    """(measured peak GiB, layers recomputed, predicted peak GiB) of the step `auto` plans under
    `budget_gib` for one conversation of `tokens` tokens."""
    recipe = {
        "model": {"config": {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
                             "num_hidden_layers": LAYERS, "num_attention_heads": 16, "num_key_value_heads": 4,
                             "max_position_embeddings": tokens},
                  "tokenizer": str(QUICKSTART / "tokenizer"), "dtype": "bfloat16", "attention": "packed"},
        "data": {"path": str(QUICKSTART / "train.jsonl"), "max_seq_len": tokens},
        "train": {"micro_batch_size": 1, "gradient_checkpointing": "auto", "memory_budget_gib": budget_gib,
                  "activation_offload": offload, "device": "cuda"},
        "output": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / f"planner-{tokens}-{budget_gib:.3f}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    config = StepBenchConfig(steps=1, warmup=0, chat=False, peers=False, measure_matmul=False)
    row = run_step_bench(load_recipe(path), config).rows[0]
    assert row.status == "ok", row.detail
    plan = re.fullmatch(r"auto: (\d+) of (\d+) layers(, offloaded)? \(predicted ([\d.]+) GiB\)", row.checkpointing)
    assert plan is not None and int(plan[2]) == LAYERS, row.checkpointing
    return row.peak_mem_gib, int(plan[1]), float(plan[4])


@pytest.mark.parametrize("tokens", [32_768, 131_072])
def test_the_plan_for_a_budget_fits_it_at_long_context(tmp_path, tokens):
    kept_all, none_recomputed, _ = planned_step(tmp_path, tokens, 70.0)
    assert none_recomputed == 0
    recomputed_all, every_layer, _ = planned_step(tmp_path, tokens, 0.01)  # below anything: every layer recomputed
    assert every_layer == LAYERS and recomputed_all < kept_all / 2
    print(f"\n{tokens} tokens: every layer kept {kept_all:.2f} GiB, every layer recomputed {recomputed_all:.2f} GiB")
    for share in (0.3, 0.6):
        budget = recomputed_all + share * (kept_all - recomputed_all)
        peak, recomputed, predicted = planned_step(tmp_path, tokens, budget)
        print(f"budget {budget:.2f} GiB: {recomputed} of {LAYERS} recomputed, predicted {predicted:.2f}, "
              f"measured {peak:.2f} GiB")
        assert 0 < recomputed < LAYERS
        assert peak <= budget, f"the plan for {budget:.2f} GiB peaked at {peak:.2f}"
        assert peak <= 1.05 * predicted, f"predicted {predicted:.2f} GiB, measured {peak:.2f}"


def test_the_device_memory_cap_applies_to_cuda_without_an_index():
    """`bench step --device-memory` on `device: auto`/`cuda`: the cap lands on the current device, and
    the planner's default budget reads it back."""
    import torch

    from ligertune.devices import cap_device_memory, device_memory_bytes
    from ligertune.training.memory import default_budget_gib

    device = torch.device("cuda")
    try:
        cap_device_memory(device, 8)
        assert device_memory_bytes(device) == pytest.approx(8 * 2**30, rel=1e-6)
        assert default_budget_gib(device) == pytest.approx(0.9 * 8, rel=1e-6)  # `auto` without a budget
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
