"""Medusa heads (`objective.name: medusa`): the recipe's checks, targets shifted inside each
conversation, each head's loss against a float64 loop over the conversations alone, a frozen-backbone
run (metrics, the model untouched, what final/ holds, `chat`'s loader), resume, and a LoRA run
(Medusa-2) whose heads `merge` keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runs import train_here
from rich.console import Console
from tiny_recipe import write_medusa_recipe, write_recipe

from ligertune.data import IGNORE_INDEX, Pack, collate, collate_padded
from ligertune.errors import RecipeError, UserError
from ligertune.metrics import read_metrics
from ligertune.models.medusa import (
    BASE_NOTE,
    CONFIG_FILE,
    HEADS_FILE,
    MedusaHeads,
    has_heads,
    load_heads,
    save_heads,
)
from ligertune.objectives.medusa import accepted_length, all_head_targets, head_targets
from ligertune.recipe import load_recipe


def steps_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def evals_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]


# --------------------------------------------------------------------------------------------------
# the recipe


@pytest.mark.parametrize(("objective", "sections", "key", "words"), [
    ({"backbone": "lora"}, {}, "objective.backbone", "add a `lora` section"),
    ({}, {"lora": {"r": 4}}, "lora", "remove the `lora` section"),
    ({"backbone": "full"}, {"lora": {"r": 4}}, "lora", "trains every weight"),
    ({"head_weights": [1.0, 0.5]}, {}, "objective.head_weights", "one weight per head (3)"),
    ({"head_weights": [0.0, 0.0, 0.0]}, {}, "objective.head_weights", "at least one > 0"),
    ({"head_weights": [1.0, -1.0, 0.5]}, {}, "objective.head_weights", ">= 0"),
    ({"lm_weight": 0.5}, {}, "objective.lm_weight", "backbone: lora` or `full` only"),
    ({"backbone": "full", "lm_weight": -1.0}, {}, "objective.lm_weight", ">= 0"),
    ({"heads": 0}, {}, "objective.heads", "1 to 16"),
    ({"head_layers": -1}, {}, "objective.head_layers", ">= 0"),
    ({"name": "sft", "heads": 2}, {}, "objective.heads", "medusa only"),
    ({"name": "distill", "teacher": "t", "backbone": "full"}, {}, "objective.backbone", "medusa only"),
], ids=["lora-backbone-without-lora", "lora-with-frozen", "lora-with-full", "weights-length", "weights-zero",
        "weights-negative", "lm-weight-frozen", "lm-weight-negative", "no-heads", "negative-layers", "heads-for-sft",
        "backbone-for-distill"])
def test_the_recipe_refuses_what_medusa_cannot_mean(tmp_path: Path, objective, sections, key, words):
    path = write_recipe(tmp_path, objective={"name": "medusa", "heads": 3, **objective}, **sections)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    problems = [line for line in str(err.value).splitlines() if key in line]
    assert problems and words in problems[0], str(err.value)


def test_the_default_head_weights_decay_as_the_paper_s(tmp_path: Path):
    recipe = load_recipe(write_recipe(tmp_path, objective={"name": "medusa", "heads": 5}))
    assert recipe.objective.head_weights == [0.8, 0.64, 0.512, 0.4096, 0.32768]
    assert recipe.objective.backbone == "frozen" and recipe.objective.lm_weight == 1.0
    assert not recipe.objective.trains_backbone


def test_medusa_reads_chat_data_only(tmp_path: Path):
    with pytest.raises(RecipeError, match="preference data"):
        load_recipe(write_recipe(tmp_path, objective={"name": "medusa"}, data={"format": "paired"}))


# --------------------------------------------------------------------------------------------------
# targets


def loose_pack(conversations: list[tuple[list[int], list[int]]]) -> Pack:
    ids = [t for c, _ in conversations for t in c]
    labels = [t for _, label in conversations for t in label]
    return Pack(ids, labels, [len(c) for c, _ in conversations])


CONVERSATIONS = [  # (tokens, labels: shifted already, -100 where not trained), lengths 7, 3, 1, 6, 5
    ([1, 2, 3, 4, 5, 6, 7], [-100, -100, 4, 5, -100, 7, -100]),
    ([8, 9, 10], [9, 10, -100]),
    ([11], [-100]),
    ([12, 13, 14, 15, 16, 17], [-100, 14, 15, 16, 17, -100]),
    ([18, 19, 20, 21, 22], [19, -100, 21, 22, -100]),
]


def alone(labels: list[int], k: int) -> list[int]:
    """Head k's targets of one conversation by itself: the label k places later, or nothing."""
    return [labels[t + k] if t + k < len(labels) else IGNORE_INDEX for t in range(len(labels))]


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
def test_shifted_targets_never_cross_a_packing_boundary(padded: bool):
    packs = [loose_pack(CONVERSATIONS[:3]), loose_pack(CONVERSATIONS[3:])]
    heads = 4
    if padded:  # one conversation per row, as unpacked training lays them out
        batch = collate_padded([loose_pack([c]) for c in CONVERSATIONS], pad_id=0)
        expected = [[t for c in CONVERSATIONS for t in alone(c[1], k) + [IGNORE_INDEX] * (7 - len(c[1]))]
                    for k in range(1, heads + 1)]
    else:
        batch = collate(packs)
        expected = [[t for c in CONVERSATIONS for t in alone(c[1], k)] for k in range(1, heads + 1)]
    got = all_head_targets(batch, heads)
    assert got.shape == (heads, *batch.targets.shape)
    assert got.reshape(heads, -1).tolist() == expected
    # head 1 of the first conversation: the label of t + 1 where it is trained, never the second's tokens
    assert expected[0][:7] == [-100, 4, 5, -100, 7, -100, -100]
    assert head_targets(batch.targets, torch.zeros_like(batch.targets), 0).equal(batch.targets)


def test_each_head_is_weighted_over_its_own_targets_of_the_whole_step(tmp_path: Path):
    from ligertune.objectives import build_objective

    recipe = load_recipe(write_recipe(tmp_path, objective={"name": "medusa", "heads": 2}))
    objective = build_objective(recipe)
    batches = [collate([loose_pack(CONVERSATIONS[:3])]), collate([loose_pack(CONVERSATIONS[3:])])]
    weights = objective.step_weights(batches)
    for k in range(3):  # row 0: the model's own targets; row k: head k's
        targets = [b.targets.reshape(-1) if k == 0 else all_head_targets(b, 2)[k - 1].reshape(-1) for b in batches]
        supervised = sum(int((t != IGNORE_INDEX).sum()) for t in targets)
        for w, t in zip(weights, targets):
            assert w[k].reshape(-1).tolist() == pytest.approx([(1 / supervised if y != IGNORE_INDEX else 0.0)
                                                               for y in t.tolist()])


def test_accepted_length_chains_the_heads_accuracies():
    assert accepted_length([]) == 1.0
    assert accepted_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert accepted_length([1.0, 0.0, 1.0]) == 2.0


# --------------------------------------------------------------------------------------------------
# the loss


def reference_head_losses(model, heads: MedusaHeads, conversations: list[tuple[list[int], list[int]]],
                          mode: str) -> list[torch.Tensor]:
    """Each head's step loss by definition, in float64 from the logits of each conversation alone:
    its cross-entropy at every position whose target (the label k places later, same conversation)
    is trained, normalised over that head's own targets (docs/loss.md)."""
    from ligertune.models.head import last_hidden_states

    heads64 = [(torch.nn.Sequential(*(b for b in h.blocks)).double(), h.proj.weight.double()) for h in heads.heads]
    losses = []
    for k, (blocks, weight) in enumerate(heads64, start=1):
        per_conversation = []
        for ids, labels in conversations:
            n = len(ids)
            hidden = last_hidden_states(model, torch.tensor([ids]), torch.arange(n)[None],
                                        cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n)
            targets = torch.tensor(alone(labels, k))
            rows = targets != IGNORE_INDEX
            if not rows.any():
                continue
            logits = blocks(hidden.double())[rows] @ weight.T
            per_conversation.append(torch.nn.functional.cross_entropy(logits, targets[rows], reduction="none"))
        if mode == "token":
            losses.append(torch.cat(per_conversation).sum() / sum(len(c) for c in per_conversation))
        elif mode == "sequence":
            losses.append(sum(c.mean() for c in per_conversation) / len(per_conversation))
        else:
            losses.append(torch.cat(per_conversation).sum())
    return losses


@pytest.mark.parametrize(("mode", "fused"), [("token", True), ("sequence", True), ("sum", True), ("token", False)],
                         ids=["token", "sequence", "sum", "token-unfused"])
def test_each_head_loss_is_the_float64_loss_of_the_conversations_one_by_one(tmp_path: Path, mode: str, fused: bool):
    """Packed, cut into two micro-batches, fused (or through the heads' logits): each head's loss and
    the gradient of its weights are those of a float64 loop over the conversations alone."""
    from ligertune.data import pack
    from ligertune.data.packing import shift_labels
    from ligertune.models import load_tokenizer
    from ligertune.objectives import build_objective
    from ligertune.training.build import build_data, build_run

    recipe = load_recipe(write_recipe(tmp_path, n_train=10, objective={"name": "medusa", "heads": 3,
                                                                       "head_layers": 2},
                                      loss={"normalization": mode}, data={"max_seq_len": 128},
                                      kernels={"fused_linear_cross_entropy": fused}))
    tokenizer = load_tokenizer(recipe.model)
    examples = build_data(recipe, tokenizer, show_progress=False).train_examples
    from ligertune.training.build import build_model

    model = build_model(recipe, device=torch.device("cpu"), vocab_size=len(tokenizer)).module
    run = build_run(recipe, model, device=torch.device("cpu"), total_steps=1)
    heads = run.head.medusa
    assert run.head.fused_heads == fused
    torch.manual_seed(0)
    with torch.no_grad():  # blocks that do something, so that their gradients are compared too
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    packs = pack(examples, recipe.data.max_seq_len, packing=True)
    assert any(len(p.seq_lens) > 1 for p in packs)
    batches = [collate(packs[: len(packs) // 2]), collate(packs[len(packs) // 2:])]
    objective = build_objective(recipe)
    weights = objective.step_weights(batches)
    sums = {}
    for batch, w in zip(batches, weights):
        out = objective.forward(run.head, batch, w)
        out.loss.backward()
        for name, value in out.sums.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    got_grads = [p.grad.clone() for p in heads.parameters()]
    assert all(p.grad is None for p in model.parameters())  # the frozen model gets none

    conversations = [(e.input_ids, shift_labels(e.labels)) for e in examples]
    for p in heads.parameters():
        p.grad = None
    expected = reference_head_losses(model, heads, conversations, mode)
    total = sum(lam * loss for lam, loss in zip(recipe.objective.head_weights, expected))
    total.backward()
    for k, loss in enumerate(expected, start=1):
        assert sums[f"head{k}_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert sums["loss"] == pytest.approx(total.item(), rel=1e-5)
    for got, p in zip(got_grads, heads.parameters()):
        assert (got.double() - p.grad.double()).norm() <= 1e-4 * p.grad.double().norm()


@pytest.mark.parametrize("backbone", ["frozen", "lora"])
def test_verify_loss_holds_for_medusa(tmp_path: Path, backbone: str):
    """Packed, unpacked, one micro-batch or one per conversation: the heads' (and, under LoRA, the
    model's) loss and gradients are the float64 definition's; without isolation or with a mean per
    micro-batch they are not."""
    from ligertune.verify import verify_loss

    lora = {"lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}} if backbone == "lora" else {}
    path = write_medusa_recipe(tmp_path, objective={"backbone": backbone}, **lora)
    report = verify_loss(load_recipe(path), samples=6, modes=["token", "sequence"])
    ours = [c for c in report.cases if c.kind == "ligertune"]
    assert len(ours) == 8 and report.passed, [c for c in ours if not c.passed]
    naive = {(c.name, c.mode): c for c in report.cases if c.kind == "naive"}
    assert not naive[("no attention isolation", "token")].passed
    assert not naive[("mean per micro-batch, 6x1", "token")].passed
    assert not naive[("token mean for sequence", "sequence")].passed


# --------------------------------------------------------------------------------------------------
# runs


def test_a_frozen_backbone_run_trains_the_heads_alone(tmp_path: Path):
    """Per-head loss and accuracy and the accepted length, on the steps and the held-out data; the
    heads' held-out losses fall; the optimizer holds the heads only and the model ends bit for bit as
    it started; final/ holds the heads and names the base, which `chat`'s loader builds under them."""
    from ligertune.inference import load_for_inference
    from ligertune.training.trainer import cleanup, setup, train_loop

    path = write_medusa_recipe(tmp_path, train={"max_steps": 6, "eval_every": 3, "eval_at_start": True},
                               optim={"lr": 1e-2})
    run = setup(load_recipe(path), Console(quiet=True))
    try:
        start = {name: t.clone() for name, t in run.model.state_dict().items()}
        optimized = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for p in run.head.medusa.parameters()}
        train_loop(run)
        end = run.model.state_dict()
        assert start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)
        trained = {k: v.clone() for k, v in run.head.medusa.state_dict().items()}
    finally:
        cleanup(run)

    out = tmp_path / "run"
    steps, evals = steps_of(out), evals_of(out)
    assert [r["step"] for r in steps] == list(range(1, 7)) and [r["step"] for r in evals] == [0, 3, 6]
    heads = [f"head{k}" for k in (1, 2, 3)]
    for record, prefix in [*((r, "") for r in steps), *((r, "eval_") for r in evals)]:
        for name in ("lm_loss", "lm_accuracy", "accepted_length", *(f"{h}_{m}" for h in heads for m in ("loss", "accuracy"))):
            assert prefix + name in record, (prefix + name, record)
        accuracies = [record[f"{prefix}{h}_accuracy"] for h in heads]
        assert record[prefix + "accepted_length"] == pytest.approx(accepted_length(accuracies))
        # the loss is the heads' alone, weighted 0.8^k
        weighted = sum(0.8 ** k * record[f"{prefix}head{k}_loss"] for k in (1, 2, 3))
        assert record[prefix + "loss"] == pytest.approx(weighted, rel=1e-5)
    assert len({r["eval_lm_loss"] for r in evals}) == 1  # the model's own answers do not move
    for h in heads:
        assert evals[-1][f"eval_{h}_loss"] < evals[0][f"eval_{h}_loss"] - 0.1, h

    final = out / "final"
    assert has_heads(final) and (final / BASE_NOTE).is_file() and (final / "tokenizer_config.json").is_file()
    assert not (final / "config.json").exists() and not list(final.glob("model*.safetensors"))
    assert json.loads((final / BASE_NOTE).read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    saved = load_heads(final)
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in trained.items())

    loaded = load_for_inference(out, device="cpu", dtype="float32")
    assert loaded.source.frozen_base and loaded.source.model_dir == final
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, start[name]), name
    with pytest.raises(UserError, match="no LoRA adapters to merge"):
        from ligertune.merge import merge_adapters

        merge_adapters(out)


def test_a_frozen_backbone_run_resumes_to_the_bit(tmp_path: Path):
    from cli_runs import assert_resume_continues_the_run

    path = write_medusa_recipe(tmp_path, optim={"lr": 1e-2})
    assert_resume_continues_the_run(path, tmp_path / "run", processes=1, steps=4, save_at=2,
                                    loss_rtol=0.0, grad_norm_rtol=0.0)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    assert has_heads(checkpoint) and not list(checkpoint.glob("model*.safetensors"))
    straight = load_heads(tmp_path / "run-straight-final").state_dict()
    resumed = load_heads(tmp_path / "run" / "final").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_lora_medusa_2_run_trains_both_and_merge_keeps_the_heads(tmp_path: Path):
    from ligertune.merge import merge_adapters

    path = write_medusa_recipe(tmp_path, objective={"backbone": "lora", "lm_weight": 0.5},
                               lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, optim={"lr": 1e-2},
                               train={"max_steps": 3, "eval_every": 3, "eval_at_start": True})
    train_here(path)
    out = tmp_path / "run"
    steps, evals = steps_of(out), evals_of(out)
    for r in steps:  # the model's own loss is trained beside the heads'
        weighted = 0.5 * r["lm_loss"] + sum(0.8 ** k * r[f"head{k}_loss"] for k in (1, 2, 3))
        assert r["loss"] == pytest.approx(weighted, rel=1e-5)
    assert evals[-1]["eval_lm_loss"] != evals[0]["eval_lm_loss"]
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and has_heads(final) and not (final / BASE_NOTE).exists()
    report = merge_adapters(out, device="cpu")
    merged = report.output_dir
    assert (merged / "config.json").is_file() and has_heads(merged)
    assert (merged / HEADS_FILE).read_bytes() == (final / HEADS_FILE).read_bytes()
    assert (merged / CONFIG_FILE).read_text() == (final / CONFIG_FILE).read_text()


# --------------------------------------------------------------------------------------------------
# the heads' files


def test_heads_load_back_and_bad_files_are_one_line_naming_the_file(tmp_path: Path):
    heads = MedusaHeads.from_output_layer(torch.randn(11, 6), heads=2, layers=1)
    save_heads(heads, tmp_path)
    loaded = load_heads(tmp_path)
    assert loaded.config == heads.config
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in heads.state_dict().items())
    assert loaded(torch.randn(3, 6)).shape == (3, 2, 11)  # [rows, heads, vocab], what a drafter takes

    config = tmp_path / CONFIG_FILE
    config.write_text(json.dumps({"heads": 2, "layers": 1, "hidden_size": 6}))
    with pytest.raises(UserError, match=f"{config}: not a Medusa heads' config"):
        load_heads(tmp_path)
    config.write_text(json.dumps({"heads": 2, "layers": 1, "hidden_size": 6, "vocab_size": "x"}))
    with pytest.raises(UserError, match="vocab_size must be a whole number"):
        load_heads(tmp_path)
    config.write_text(json.dumps({"heads": 3, "layers": 1, "hidden_size": 6, "vocab_size": 11}))
    with pytest.raises(UserError, match="do not fit medusa_config.json"):
        load_heads(tmp_path)
    config.write_text(json.dumps({"heads": 2, "layers": 1, "hidden_size": 6, "vocab_size": 11}))
    weights = tmp_path / HEADS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match=f"{weights}.*truncated"):
        load_heads(tmp_path)
