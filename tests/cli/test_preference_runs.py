"""A preference run works with the rest of the tool: LoRA, the spike watch, TensorBoard, the
plot, `chat` and `merge` of its result, and several processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import ligertune_here, two_processes_then_one
from tiny_recipe import write_preference_recipe

from ligertune.metrics import read_metrics

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def answer(model: Path) -> dict:
    reply = json.loads(ligertune_here("chat", model, "-p", "reverse plant", "-n", 6, "--json").stdout)
    assert reply.pop("tokens_per_s") > 0  # a timing: the one field besides the model's path that may differ
    return {k: v for k, v in reply.items() if k != "model"}


def test_a_lora_dpo_run_reports_merges_and_chats(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = write_preference_recipe(tmp_path, lora=LORA, optim={"lr": 1e-2},
                                   train={"max_steps": 4, "eval_every": 2, "spike_threshold": 6.0},
                                   output={"report_to": ["tensorboard"], "plot": True})
    ligertune_here("train", path)
    run = tmp_path / "run"
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all({"reward_margin", "reward_accuracy", "logp_chosen", "grad_norm"} <= r.keys() for r in steps)
    assert any("eval_reward_margin" in r for r in records)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/reward_margin")] == pytest.approx(
        [r["reward_margin"] for r in steps])
    assert (run / "loss.png").stat().st_size > 0

    merged = tmp_path / "merged"
    ligertune_here("merge", run, "--output", merged)
    assert answer(merged) == answer(run)


def test_two_processes_train_and_resume_a_dpo_run_as_one_process(tmp_path: Path):
    """2 processes, and their checkpoint resumed by 1 (the reference log-probabilities read back from
    the run's folder), log the losses of one straight process."""
    path = write_preference_recipe(tmp_path, optim={"schedule": "constant"},
                                   train={"max_steps": 4, "eval_every": 2, "micro_batch_size": 2,
                                          "grad_accum_steps": 1})
    two, resumed, one = two_processes_then_one(path, tmp_path, save_at=2)

    def train_records(run_dir: Path) -> list[dict]:
        return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]

    assert [r["step"] for r in train_records(two)] == [1, 2, 3, 4]
    assert [r["step"] for r in train_records(resumed)] == [1, 2, 3, 4]
    for run in (two, resumed):
        for mine, reference in zip(train_records(run), train_records(one), strict=True):
            assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5)
            assert mine["reward_margin"] == pytest.approx(reference["reward_margin"], rel=1e-4, abs=1e-6)
    assert any("eval_reward_accuracy" in r for r in read_metrics(two / "metrics.jsonl"))


def test_dpo_trains_adapters_over_a_quantized_base(tmp_path: Path):
    """QLoRA: the reference is the quantized base with the adapters at zero, so DPO starts at log 2,
    and the loss falls."""
    pytest.importorskip("bitsandbytes")
    import math

    model = {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512},
             "quantization": "nf4"}
    path = write_preference_recipe(tmp_path, n_train=8, model=model, lora={"r": 8, "alpha": 16},
                                   optim={"lr": 1e-2, "schedule": "constant"},
                                   train={"max_steps": 10, "micro_batch_size": 8, "grad_accum_steps": 1})
    ligertune_here("train", path)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert max(losses[-3:]) < 0.9 * losses[0]
