"""End-to-end training on a tiny model: metrics, the saved model, LoRA adapters, batching invariance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import write_recipe
from transformers import AutoModelForCausalLM

from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop


def run(recipe_path: Path, *overrides: str):
    recipe = load_recipe(recipe_path, list(overrides))
    state = setup(recipe, Console(quiet=True))
    try:
        result = train_loop(state)
    finally:
        cleanup(state)
    return state, result


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_training_writes_metrics_and_a_model_that_reloads(tiny_recipe: Path):
    state, result = run(tiny_recipe)
    out = Path(state.recipe.output.dir)
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert {"step", "loss", "z_loss", "token_accuracy", "tokens", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
        assert r["tokens"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
    assert [r["step"] for r in evals] == [0, 3]
    assert steps[0]["lr"] < steps[1]["lr"]  # warmup
    assert (out / "recipe.yaml").exists()
    assert load_recipe(out / "recipe.yaml") == state.recipe
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary dirs left
    assert not (out / "loss.png").exists()  # the tiny recipe says output.plot: false

    reloaded = AutoModelForCausalLM.from_pretrained(result.final_dir)
    ids = torch.tensor([state.eval_examples[0].input_ids])
    state.model.eval()
    assert torch.allclose(logits_of(reloaded, ids), logits_of(state.model, ids), atol=1e-5)
    assert result.sample is not None


def test_finished_run_is_not_overwritten_by_default(tiny_recipe: Path):
    run(tiny_recipe, "train.max_steps=1")
    from ligertune.errors import UserError

    with pytest.raises(UserError, match="already holds a finished run"):
        run(tiny_recipe, "train.max_steps=1")
    run(tiny_recipe, "train.max_steps=1", "output.overwrite=true")


def test_lora_run_saves_an_adapter_that_reloads_with_peft(tmp_path: Path):
    from peft import PeftModel

    path = write_recipe(tmp_path, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                        optim={"lr": 1e-2})
    state, result = run(path)
    assert (result.final_dir / "adapter_config.json").exists()
    assert (result.final_dir / "adapter_model.safetensors").exists()
    trainable = {n for n, p in state.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    from ligertune.models import build_model

    base = build_model(state.recipe.model, device="cpu", seed=state.recipe.train.seed,
                       vocab_size=len(state.tokenizer))
    reloaded = PeftModel.from_pretrained(base, result.final_dir)
    ids = torch.tensor([state.eval_examples[0].input_ids])
    state.model.eval()
    reloaded.eval()
    assert torch.allclose(logits_of(reloaded, ids), logits_of(state.model, ids), atol=1e-5)
    # The adapters moved away from their zero start, so the check above compares trained weights.
    assert any(p.abs().sum() > 0 for n, p in reloaded.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_one_micro_batch_of_eight_equals_eight_of_one(tmp_path: Path, mode: str):
    """The reported loss and the gradient norm of a step do not depend on how it is cut."""
    common = ["train.max_steps=1", "data.packing=false", f"loss.normalization={mode}",
              "loss.z_loss_weight=1e-3", "loss.label_smoothing=0.1", "train.eval_every=null",
              "train.eval_at_start=false"]
    path = write_recipe(tmp_path)
    one = run(path, *common, "train.micro_batch_size=8", "train.grad_accum_steps=1",
              f"output.dir={tmp_path / 'one'}")[0]
    eight = run(path, *common, "train.micro_batch_size=1", "train.grad_accum_steps=8",
                f"output.dir={tmp_path / 'eight'}")[0]
    a = read_metrics(Path(one.recipe.output.dir) / "metrics.jsonl")[0]
    b = read_metrics(Path(eight.recipe.output.dir) / "metrics.jsonl")[0]
    assert a["tokens"] == b["tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["z_loss"] == pytest.approx(b["z_loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_same_seed_same_run(tmp_path: Path):
    path = write_recipe(tmp_path)
    first = run(path, "train.max_steps=2", f"output.dir={tmp_path / 'a'}")[0]
    second = run(path, "train.max_steps=2", f"output.dir={tmp_path / 'b'}")[0]
    strip = ("tokens_per_s", "trained_tokens_per_s", "eval_s", "peak_mem_gib")  # timings
    a, b = ([{k: v for k, v in r.items() if k not in strip}
             for r in read_metrics(Path(s.recipe.output.dir) / "metrics.jsonl")] for s in (first, second))
    assert a == b
    for p, q in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)


def test_a_run_sends_its_metrics_to_tensorboard_and_draws_its_loss(tmp_path: Path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = write_recipe(tmp_path, output={"report_to": ["tensorboard"], "plot": True})
    state, _ = run(path)
    out = Path(state.recipe.output.dir)
    assert (out / "loss.png").stat().st_size > 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    records = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert losses == pytest.approx(records)


def test_the_next_steps_batches_are_made_ahead_from_the_same_position(tiny_recipe: Path):
    """`prefetch_batches` makes the next step's micro-batches without moving the data position;
    `next_batches` takes them where it starts from that position, and makes its own elsewhere."""
    from ligertune.training import next_batches, prefetch_batches

    def ids(batches):
        return [b.input_ids.tolist() for b in batches]

    plain = setup(load_recipe(tiny_recipe, [f"output.dir={tiny_recipe.parent / 'plain'}"]), Console(quiet=True))
    ahead = setup(load_recipe(tiny_recipe, [f"output.dir={tiny_recipe.parent / 'ahead'}"]), Console(quiet=True))
    try:
        want = [ids(next_batches(plain)) for _ in range(3)]
        assert ids(next_batches(ahead)) == want[0]
        prefetch_batches(ahead)
        position = (ahead.state.epoch, ahead.state.index)
        made = ahead.prefetched[1]
        assert (ahead.state.epoch, ahead.state.index) == position  # not moved
        taken = next_batches(ahead)
        assert taken is made and ids(taken) == want[1]
        prefetch_batches(ahead)
        ahead.state.index += 1  # elsewhere now: the batches made ahead do not apply
        assert ids(next_batches(ahead)) != want[2] and ahead.prefetched is None
    finally:
        cleanup(plain)
        cleanup(ahead)


def test_a_finished_run_leaves_no_patch_behind(tmp_path: Path):
    """The kernels are patched into the run's model only: after the run its modules run their own
    forwards, and llama's modeling module holds transformers' RoPE function again, so a model made
    later in the same process is not redirected."""
    from transformers.models.llama import modeling_llama

    from ligertune.models import is_patched
    from ligertune.models.lora import is_lora_patched

    rope = modeling_llama.apply_rotary_pos_emb
    state, _ = run(write_recipe(tmp_path, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}),
                   "train.max_steps=1")
    assert modeling_llama.apply_rotary_pos_emb is rope
    assert not is_patched(state.model) and not is_lora_patched(state.model)
