"""Preference training end to end on the CPU: a tiny llama, pairs made from the quick-start data.

The chosen answer is the conversation's real last answer, the rejected one another conversation's.
DPO starts at policy == reference (the reference log-probabilities are the starting model's), so its
first loss is log 2; training raises the reward accuracy on the training pairs; one step's loss and
gradients do not depend on how the step is cut; a resumed run reads the saved reference back and
continues as the straight run. KTO (unpaired answers, each with another example's completion for its
KL estimate) starts at z0 = 0 with every example costing half its weight, and resumes bitwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_resume import TIMINGS, StopAt, finish, start
from tiny_recipe import train_losses, unpaired_records, write_preference_recipe

from ligertune.data import PreferenceBatch
from ligertune.errors import UserError
from ligertune.metrics import read_metrics
from ligertune.objectives import Preference
from ligertune.objectives.reference import REFERENCE_FILE
from ligertune.training import RunInterrupted, cleanup
from ligertune.training.checkpoint import latest_checkpoint
from ligertune.training.display import format_metrics
from ligertune.training.evaluation import evaluate
from ligertune.training.step import forward_backward, make_batch, next_batches, train_step


@torch.no_grad()
def pack_metrics(run, packs) -> dict[str, float]:
    """The objective's metrics over `packs` (eval mode, no update)."""
    run.engine.eval()
    size = run.recipe.train.micro_batch_size
    totals = forward_backward(run, [make_batch(run, packs[i:i + size]) for i in range(0, len(packs), size)],
                              backward=False)
    run.engine.train()
    return run.objective.summarize({k: float(v) for k, v in totals.items()})


def test_dpo_starts_at_log_2_and_learns_the_pairs(tmp_path: Path):
    # 12 pairs in 5 packs, all of them in every step: the whole training set, 15 times.
    path = write_preference_recipe(tmp_path, n_train=12, objective={"beta": 0.5},
                                   optim={"lr": 3e-3, "schedule": "constant"},
                                   train={"max_steps": 15, "micro_batch_size": 8, "grad_accum_steps": 1,
                                          "eval_every": 15})
    run = start(path)
    assert isinstance(run.objective, Preference) and run.objective.cfg.loss == "dpo"
    assert all(p.reference_logps is not None and len(p.reference_logps) == p.num_answers
               for p in [*run.data.train_packs, *run.data.eval_packs])
    assert (tmp_path / "run" / REFERENCE_FILE).is_file()
    before = pack_metrics(run, run.data.train_packs)
    # policy == reference: every margin is 0 (to float32 rounding), the loss log 2, no pair won.
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(before["reward_margin"]) < 1e-6
    finish(run)
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 15
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # the first step sees the starting model
    assert max(losses[-3:]) < 0.5 * math.log(2)
    after = pack_metrics(run, run.data.train_packs)
    assert after["loss"] < 0.5 * math.log(2), after
    assert after["reward_accuracy"] >= 0.9, after
    assert after["reward_margin"] > 0.5, after
    assert after["reward_chosen"] > after["reward_rejected"]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert any("eval_reward_accuracy" in r for r in records)  # the last step evaluates the held-out pairs


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_held_out_pairs_at_step_0_have_no_margin_and_no_winner(tmp_path: Path, loss: str):
    """Before the first step the policy is the reference: every held-out margin is exactly 0, so no
    pair is won, however many packs a training forward takes (the held-out packs are scored one by
    one, as the reference pass scored them)."""
    path = write_preference_recipe(tmp_path, n_eval=64, objective={"name": loss},
                                   train={"micro_batch_size": 8, "grad_accum_steps": 1})
    run = start(path)
    try:
        assert len(run.data.eval_packs) > 1
        metrics = evaluate(run)
        assert metrics["eval_reward_margin"] == 0.0 and metrics["eval_reward_accuracy"] == 0.0, metrics
    finally:
        cleanup(run)


def step_grads(path: Path, micro: int, accum: int) -> tuple[dict[str, float], list[torch.Tensor]]:
    run = start(path, f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}",
                f"output.dir={path.parent / f'run-{micro}x{accum}'}")
    try:
        packs = run.stream.take(run.state, 4)
        batches = [make_batch(run, packs[i:i + micro]) for i in range(0, 4, micro)]
        totals = forward_backward(run, batches, backward=True)
        metrics = run.objective.summarize({k: float(v) for k, v in totals.items()})
        return metrics, [p.grad.clone() for p in run.model.parameters()]
    finally:
        cleanup(run)


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_one_step_is_the_same_however_it_is_cut(tmp_path: Path, loss: str):
    """4 packs in one micro-batch, or in four: the same loss, metrics and gradients (float32 CPU).
    KTO reads the pairs as two examples each, and its z0 comes from the whole step either way."""
    path = write_preference_recipe(tmp_path, n_train=4, n_eval=2, objective={"name": loss},
                                   data={"packing": False})
    whole, whole_grads = step_grads(path, 4, 1)
    cut, cut_grads = step_grads(path, 1, 4)
    for key, value in whole.items():
        assert cut[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for g, g0 in zip(cut_grads, whole_grads):
        assert (g - g0).norm() <= 1e-5 * g0.norm() + 1e-9
    assert sum(g.abs().sum() for g in whole_grads) > 0


def test_resume_reads_the_saved_reference_and_continues_as_the_straight_run(tmp_path: Path):
    path = write_preference_recipe(tmp_path, train={"max_steps": 6, "save_every": 3})
    straight = start(path, f"output.dir={tmp_path / 'straight'}")
    finish(straight)

    interrupted = start(path, f"output.dir={tmp_path / 'resumed'}")
    with pytest.raises(RunInterrupted):
        finish(interrupted, StopAt(interrupted, 3))
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000003"
    resumed = start(path, f"output.dir={tmp_path / 'resumed'}", resume="latest")
    assert resumed.state.step == 3
    assert [p.reference_logps for p in resumed.data.train_packs] == [p.reference_logps for p in
                                                                     straight.data.train_packs]
    finish(resumed)
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name

    def after(run_dir):
        return [{k: v for k, v in r.items() if k not in TIMINGS}
                for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 3 and "checkpoint" not in r]
    assert after(tmp_path / "resumed") == after(tmp_path / "straight")
    assert len(train_losses(tmp_path / "resumed")) == 6


def test_resume_refuses_a_missing_or_mismatched_reference(tmp_path: Path):
    path = write_preference_recipe(tmp_path, train={"max_steps": 2, "save_every": 1})
    finish(start(path, "train.max_steps=2"))
    saved = tmp_path / "run" / REFERENCE_FILE
    record = json.loads(saved.read_text())
    record["train"][0].append(-1.0)
    saved.write_text(json.dumps(record))
    with pytest.raises(UserError, match="the data changed"):
        start(path, "train.max_steps=3", resume="latest")
    saved.unlink()
    with pytest.raises(UserError, match="is missing"):
        start(path, "train.max_steps=3", resume="latest")


def test_simpo_is_reference_free(tmp_path: Path):
    path = write_preference_recipe(tmp_path, objective={"name": "simpo"}, train={"max_steps": 1})
    run = start(path)
    assert all(p.reference_logps is None for p in run.data.train_packs)
    result = finish(run)
    assert result.steps == 1 and math.isfinite(result.train_loss)
    assert not (tmp_path / "run" / REFERENCE_FILE).exists()
    assert result.sample is not None  # a greedy answer to the first held-out prompt


def test_dpo_with_lora_starts_from_the_base_as_reference(tmp_path: Path):
    """With LoRA the starting model is the base (B = 0): the first loss is log 2, and only the
    adapters move."""
    path = write_preference_recipe(tmp_path, lora={"r": 4, "alpha": 8}, optim={"lr": 1e-2},
                                   train={"max_steps": 2})
    run = start(path)
    base = {n: p.detach().clone() for n, p in run.model.named_parameters() if not p.requires_grad}
    finish(run)
    losses = train_losses(tmp_path / "run")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[1] != pytest.approx(math.log(2), abs=1e-6)
    for name, p in run.model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name


def test_kto_starts_at_half_of_each_weight_and_resumes_bitwise(tmp_path: Path):
    """8 unpaired examples, one per pack, all of them in every step. At the start the policy is the
    reference: z0 = 0, rewards 0, the loss (w_d n_d + w_u n_u) / n / 2. An interrupted run resumed
    from its checkpoint ends with the straight run's weights and metrics, held-out z0 included."""
    path = write_preference_recipe(
        tmp_path, n_train=8, n_eval=2, make_records=unpaired_records,
        objective={"name": "kto", "beta": 0.5, "desirable_weight": 1.2, "undesirable_weight": 0.9},
        data={"format": "unpaired", "packing": False}, optim={"lr": 1e-2},
        train={"max_steps": 4, "micro_batch_size": 4, "grad_accum_steps": 2, "eval_every": 2,
               "save_every": 2})
    straight = start(path, f"output.dir={tmp_path / 'straight'}")
    assert isinstance(straight.objective, Preference) and straight.objective.kto
    units = straight.data.prepared.train
    assert len(units) == len(straight.data.train_packs) == 8 and all(len(u.answer_lens) == 2 for u in units)
    n_d = sum(u.desirable for u in units)
    at_start = (1.2 * n_d + 0.9 * (8 - n_d)) / 8 * 0.5
    before = pack_metrics(straight, straight.data.train_packs)
    assert before["kl"] == pytest.approx(0.0, abs=1e-6)
    assert before["reward_desirable"] == pytest.approx(0.0, abs=1e-6)
    assert before["reward_undesirable"] == pytest.approx(0.0, abs=1e-6)
    assert before["loss"] == pytest.approx(at_start, abs=1e-6)
    finish(straight)
    losses = train_losses(tmp_path / "straight")
    assert losses[0] == pytest.approx(at_start, abs=1e-6) and losses[-1] < at_start
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert any(r.get("kl", 0) > 0 for r in records)  # the policy moved away from the reference
    assert any("eval_kl" in r and "eval_reward_desirable" in r for r in records)
    assert "kl 0.000  reward desirable 0.000 undesirable 0.000" in format_metrics(records[0])  # the live line

    interrupted = start(path, f"output.dir={tmp_path / 'resumed'}")
    with pytest.raises(RunInterrupted):
        finish(interrupted, StopAt(interrupted, 2))
    resumed = start(path, f"output.dir={tmp_path / 'resumed'}", resume="latest")
    assert resumed.state.step == 2
    finish(resumed)
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name

    def after(run_dir):
        return [{k: v for k, v in r.items() if k not in TIMINGS}
                for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 2 and "checkpoint" not in r]
    assert after(tmp_path / "resumed") == after(tmp_path / "straight")


def test_kto_counts_the_tokens_its_training_forward_runs(tmp_path: Path, monkeypatch):
    """tokens/s and MFU count what the forward and backward run: each unit's prompt and completion,
    not its mismatched completion, which only the pass without gradient reads. Each micro-batch is
    split into its two parts once."""
    path = write_preference_recipe(
        tmp_path, n_train=8, n_eval=2, make_records=unpaired_records, objective={"name": "kto"},
        data={"format": "unpaired", "packing": False},
        train={"max_steps": 1, "micro_batch_size": 4, "grad_accum_steps": 2})
    run = start(path, f"output.dir={tmp_path / 'run'}")
    try:
        units = run.data.prepared.train
        assert len(units) == 8 and all(len(u.answer_lens) == 2 for u in units)
        splits = []
        select = PreferenceBatch.select_answers
        monkeypatch.setattr(PreferenceBatch, "select_answers",
                            lambda batch, keep: splits.append(1) or select(batch, keep))
        stats = train_step(run, next_batches(run))  # every unit, one per pack
        assert len(splits) == 2 * 2  # two parts of each of the two micro-batches
        trained = [u.prompt_len + u.answer_lens[0] for u in units]
        assert stats.real_tokens == sum(trained) < sum(len(u) for u in units)
        assert stats.flops == run.step_flops(sum(trained), sum(n * n for n in trained))
    finally:
        cleanup(run)
