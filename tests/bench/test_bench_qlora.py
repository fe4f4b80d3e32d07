"""`ligertune bench step` of a QLoRA recipe on a tiny Llama on the CPU: every variant quantized."""

from __future__ import annotations

import importlib.util

import pytest
from tiny_recipe import TINY_MODEL, write_recipe

from ligertune.bench.report import step_header
from ligertune.bench.step import StepBenchConfig, run_step_bench
from ligertune.recipe import load_recipe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed (pip install 'ligertune[qlora]')")

# Widths multiples of 64: see tests/models/test_quantize.py.
MODEL = {**TINY_MODEL, "hidden_size": 64, "intermediate_size": 128}


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bench_step_quantizes_the_base_of_every_variant(tmp_path, kind, no_peers):
    recipe = load_recipe(write_recipe(tmp_path, model={"config": dict(MODEL), "quantization": kind},
                                      lora={"r": 4, "alpha": 8}, train={"gradient_checkpointing": True}))
    report = run_step_bench(recipe, StepBenchConfig(steps=1, warmup=0, chat=True, measure_matmul=False))
    rows = {row.name: row for row in report.rows}
    for name in ("ligertune", "HF (sdpa) + peft", "ligertune, packed chat", "ligertune, padded chat"):
        assert rows[name].status == "ok", (name, rows[name].detail)
    assert rows["HF + Liger + peft"].status == "not installed"
    assert report.model["quantization"] == kind
    assert any(line.startswith(f"base quantized: the decoder's linear layers in {kind}")
               for line in step_header(report))

    # Parameters count each quantized weight as the matrix it stands for, next to the adapters of
    # rank r on each of them, the norms, the embedding and the output layer.
    hidden, inter, r = MODEL["hidden_size"], MODEL["intermediate_size"], recipe.lora.r
    kv = hidden // MODEL["num_attention_heads"] * MODEL["num_key_value_heads"]
    linears = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
               (hidden, inter), (hidden, inter), (inter, hidden)]  # (in, out): q k v o gate up down
    per_layer = sum(i * o + r * (i + o) for i, o in linears) + 2 * hidden
    vocab = report.model["vocab_size"]
    assert report.model["params"] == MODEL["num_hidden_layers"] * per_layer + hidden + 2 * vocab * hidden
