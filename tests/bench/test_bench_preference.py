"""`ligertune bench step` on preference recipes, on a tiny Llama on the CPU: pairs per second with the
reference pass counted in, the pair options, and the TRL rows (run when trl is installed)."""

from __future__ import annotations

import json
import sys

import pytest
from tiny_recipe import QUICKSTART
from typer.testing import CliRunner

from ligertune.bench import preference as bench_preference
from ligertune.bench.preference import REFERENCE_PASS_PACKS
from ligertune.bench.peers import Peer
from ligertune.bench.step import StepBenchConfig, run_step_bench
from ligertune.bench.synthetic import spread_lengths, synthetic_kto, synthetic_pairs
from ligertune.cli.bench import app
from ligertune.flops import StepFlops
from ligertune.models import build_model
from ligertune.objectives import reference as objective_reference
from ligertune.recipe import load_recipe
from ligertune.training import step as training_step

RECIPE = f"""\
model:
  config:
    model_type: llama
    vocab_size: 311
    hidden_size: 32
    intermediate_size: 56
    num_hidden_layers: 2
    num_attention_heads: 4
    num_key_value_heads: 2
    max_position_embeddings: 256
  tokenizer: {QUICKSTART / "tokenizer"}
  dtype: float32
  attention: packed
objective:
  name: dpo
data:
  path: {QUICKSTART / "pairs_train.jsonl"}
  format: paired
  max_seq_len: 64
train:
  micro_batch_size: 2
  gradient_checkpointing: true
  seed: 3
"""


def write(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text(RECIPE)
    return path


def run_cli(*args: str):
    return CliRunner().invoke(app, ["step", *args])


def test_dpo_recipe_is_timed_in_pairs_with_its_reference_pass(tmp_path, no_peers, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the table at the terminal width
    steps, passes = [], []
    step, score = training_step.train_step, objective_reference.compute_reference_logps
    monkeypatch.setattr(training_step, "train_step",
                        lambda run, batches: steps.append(batches) or step(run, batches))
    monkeypatch.setattr(objective_reference, "compute_reference_logps",
                        lambda *a, **k: passes.append(a[1]) or score(*a, **k))
    out = tmp_path / "step.json"
    result = run_cli(str(write(tmp_path)), "--steps", "2", "--warmup", "1", "--json", str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    # Defaults: micro_batch_size x grad_accum_steps pairs, prompt max_seq_len / 2, answers max_seq_len / 4
    assert data["pairs"] == {"objective": "dpo", "pairs": 2, "prompt_len": 32, "answer_len": 16,
                             "length_spread": 0.0, "seed": 0, "packs": 2,
                             "micro_batches": 1, "drawn": None, "epochs": 1}
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["ligertune", "TRL DPOTrainer", "TRL DPOTrainer + Liger"]  # no chat rows, no HF rows
    ours = rows["ligertune"]
    assert ours["status"] == "ok" and ours["pairs"] == 2 and ours["tokens"] == 2 * 64 and ours["steps"] == 2
    assert ours["reference_ms"] > 0 and ours["reference"].startswith("precomputed")
    assert ours["pairs_per_s"] == pytest.approx(2 / ((ours["step_ms"] + ours["reference_ms"]) * 1e-3))
    assert ours["tokens_per_s"] == pytest.approx(ours["pairs_per_s"] * 64)
    assert ours["flops"] > 0 and ours["vs_ligertune"] == 1.0
    for name in ("TRL DPOTrainer", "TRL DPOTrainer + Liger"):
        assert rows[name]["status"] == "not installed"
    # one untimed step and two timed ones, all on the same one micro-batch of two packs; the reference pass
    # once before them over both packs (as `train` runs it), and twice timed, over both packs repeated to
    # REFERENCE_PASS_PACKS (as `train` runs it over all of its packs)
    assert len(steps) == 3 and all(len(b) == 1 and b[0].num_units == 2 for b in steps)
    assert [len(p) for p in passes] == [2, REFERENCE_PASS_PACKS, REFERENCE_PASS_PACKS]
    assert [p.input_ids for p in passes[1]] == [p.input_ids for p in passes[0]] * (REFERENCE_PASS_PACKS // 2)
    assert "2 pairs a step, each a prompt of 32 tokens and two answers of 16" in result.output
    assert "ligertune: 2 packs of at most 64 tokens in 1 micro-batch of 2" in result.output
    assert "pairs/s" in result.output and "TRL DPOTrainer: not installed" in result.output


def test_epochs_spread_the_reference_pass_over_the_pairs_of_every_epoch(tmp_path, no_peers, monkeypatch):
    """`--epochs 3`: the pass, run once before the first step, serves each pair three times: a third
    of its time (and of its flops) goes with each step; the table and the JSON say so."""
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "step.json"
    result = run_cli(str(write(tmp_path)), "--steps", "1", "--warmup", "0", "--epochs", "3", "--json", str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert data["pairs"]["epochs"] == 3
    ours = data["rows"][0]
    assert ours["reference_epochs"] == 3 and ours["reference"].endswith("spread over 3 epochs")
    assert ours["pairs_per_s"] == pytest.approx(2 / ((ours["step_ms"] + ours["reference_ms"] / 3) * 1e-3))
    assert "pairs / (step ms + reference ms / 3), the reference pass spread over the pairs it serves in 3 " \
           "epochs" in " ".join(result.output.split())
    f = StepFlops.of(build_model(load_recipe(write(tmp_path)).model, device="cpu", vocab_size=311))
    # Each pack's segments: the prompt and the chosen answer (48 queries, 48 keys), the rejected answer
    # (16 queries, 48 keys).
    squared = 2 * (48 * 48 + 16 * 48)
    reference = 2.0 * f.matmul_params * 2 * 64 + 2.0 * f.layers * f.heads * f.head_dim * squared
    assert ours["flops"] == pytest.approx(f(2 * 64, squared) + reference / 3)


def test_pair_options_shape_the_pairs_and_packing_follows_the_recipe(tmp_path, no_peers):
    recipe = load_recipe(write(tmp_path))
    config = StepBenchConfig(steps=1, warmup=0, measure_matmul=False, pairs=5, prompt_len=10, answer_len=7)
    report = run_step_bench(recipe, config)
    # 24-token pairs, best-fit into packs of 64: two a pack, five pairs in three packs, two micro-batches
    assert report.pairs == {"objective": "dpo", "pairs": 5, "prompt_len": 10, "answer_len": 7,
                            "length_spread": 0.0, "seed": 0, "packs": 3,
                            "micro_batches": 2, "drawn": None, "epochs": 1}
    ours = report.rows[0]
    assert ours.status == "ok" and ours.pairs == 5 and ours.tokens == 5 * 24


def test_live_reference_is_in_the_step_and_simpo_has_none(tmp_path, no_peers):
    path = tmp_path / "live.yaml"
    path.write_text(RECIPE.replace("name: dpo", "name: dpo\n  reference: live"))
    live = run_step_bench(load_recipe(path), StepBenchConfig(steps=1, warmup=0, measure_matmul=False)).rows[0]
    assert live.status == "ok", live.detail
    assert live.reference == "live, in the step" and live.reference_ms is None
    assert live.pairs_per_s == pytest.approx(2 / (live.step_ms * 1e-3))
    path = tmp_path / "simpo.yaml"
    path.write_text(RECIPE.replace("name: dpo", "name: simpo"))
    simpo = run_step_bench(load_recipe(path), StepBenchConfig(steps=1, warmup=0, measure_matmul=False))
    assert simpo.rows[0].reference == "none" and simpo.rows[0].reference_ms is None
    assert simpo.rows[0].flops < live.flops  # no reference forward counted


def test_trl_rows_are_skipped_for_losses_trl_trains_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_preference, "find_peer", lambda key: Peer(key, key, "1.0", None))
    path = tmp_path / "orpo.yaml"
    path.write_text(RECIPE.replace("name: dpo", "name: orpo"))
    report = run_step_bench(load_recipe(path), StepBenchConfig(steps=1, warmup=0, measure_matmul=False))
    rows = {row.name: row for row in report.rows}
    assert rows["TRL DPOTrainer"].status == "skipped"
    assert rows["TRL DPOTrainer"].detail == "TRL trains orpo with another trainer"


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--prompt-len", "40", "--answer-len", "16"], "72 tokens, more than data.max_seq_len=64",
                     id="pair-too-long"),
        pytest.param(["--pairs", "0"], "must be at least 1", id="no-pairs"),
        pytest.param(["--epochs", "0"], "--epochs must be at least 1; got 0", id="no-epochs"),
        pytest.param(["--length-spread", "1"], "--length-spread must be at least 0 and below 1; got 1.0",
                     id="spread-of-one"),
        pytest.param(["--prompt-len", "30", "--answer-len", "12", "--length-spread", "0.3"],
                     "make 71 tokens, the longest drawn at --length-spread 0.3, more than data.max_seq_len=64",
                     id="spread-too-long"),
    ],
)
def test_bad_pair_options_are_one_clear_error(tmp_path, no_peers, args, message):
    result = run_cli(str(write(tmp_path)), "--steps", "1", *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_pair_options_on_an_sft_recipe_are_refused(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(RECIPE.replace("objective:\n  name: dpo\n", "").replace("  format: paired\n", ""))
    result = run_cli(str(path), "--pairs", "2", "--answer-len", "3", "--epochs", "2")
    assert result.exit_code == 2
    assert "--pairs, --answer-len, --epochs: these are for preference pairs; the recipe's objective is sft" in (
        " ".join(result.output.split()))


def test_trl_row_runs_the_same_pairs_when_installed(tmp_path, monkeypatch):
    """TRL's DPOTrainer on the same model and pairs (CPU, float32): its steps are timed by the callback,
    two sequences a pair, its reference the frozen copy."""
    pytest.importorskip("trl")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    config = StepBenchConfig(steps=2, warmup=1, measure_matmul=False)
    report = run_step_bench(load_recipe(write(tmp_path)), config)
    rows = {row.name: row for row in report.rows}
    trl = rows["TRL DPOTrainer"]
    assert trl.status == "ok", trl.detail
    assert trl.steps == 2 and trl.pairs == 2 and trl.reference == "frozen copy, in the step"
    assert trl.tokens == rows["ligertune"].tokens and trl.flops == rows["ligertune"].flops
    assert trl.pairs_per_s == pytest.approx(2 / (trl.step_ms * 1e-3))
    assert rows["TRL DPOTrainer + Liger"].status == "not installed"
    assert rows["TRL DPOTrainer + Liger"].detail == "liger-kernel: not installed"


def test_preference_recipe_under_memory_caps_is_compared_in_pairs(tmp_path, no_peers, monkeypatch):
    """--memory-cap on a DPO recipe: the TRL rows with checkpointing off and on, ligertune planned per
    cap, and the choices in pairs/s (on the CPU no peak is measured: every row fits)."""
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "caps.json"
    result = run_cli(str(write(tmp_path)), "--steps", "1", "--warmup", "0", "--memory-cap", "4,8",
                     "--json", str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert data["caps_gib"] == [4, 8] and data["pairs"]["pairs"] == 2
    rows = [(r["name"], r["status"]) for r in data["rows"]]
    assert rows == [("TRL DPOTrainer", "not installed"), ("TRL DPOTrainer + Liger", "not installed")] * 2 + [
        ("ligertune", "ok")] * 2
    ours = [c for c in data["choices"] if c["name"] == "ligertune"]
    assert [c["cap_gib"] for c in ours] == [4, 8]
    planned = [r for r in data["rows"] if r["name"] == "ligertune"]
    for choice, row in zip(ours, planned):
        assert choice["fits"] and choice["pairs_per_s"] == row["pairs_per_s"] > 0
        assert row["checkpointing"].startswith("auto")
    assert "under memory caps" in result.output and "pairs/s" in result.output


def test_kto_recipe_is_timed_in_examples_with_its_kl_pass_counted(tmp_path, no_peers, monkeypatch):
    """A KTO recipe: synthetic examples (prompt, completion, the next one's completion as the
    mismatched one), desirable and undesirable in turn, in examples/s; the flops count the training
    forward and backward over prompt + completion, the forward over prompt + mismatched completion
    and the reference's forward over each example whole (the prompt once)."""
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "kto.yaml"
    path.write_text(RECIPE.replace("name: dpo", "name: kto"))
    out = tmp_path / "kto.json"
    result = run_cli(str(path), "--steps", "1", "--warmup", "0", "--pairs", "4", "--json", str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert data["pairs"] == {"objective": "kto", "pairs": 4, "prompt_len": 32, "answer_len": 16,
                             "length_spread": 0.0, "seed": 0, "packs": 4,
                             "micro_batches": 2, "drawn": None, "epochs": 1}
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["ligertune", "TRL KTOTrainer", "TRL KTOTrainer + Liger"]
    ours = rows["ligertune"]
    assert ours["status"] == "ok" and ours["pairs"] == 4 and ours["tokens"] == 4 * 64
    assert ours["reference_ms"] > 0 and ours["pairs_per_s"] == pytest.approx(
        4 / ((ours["step_ms"] + ours["reference_ms"]) * 1e-3))
    f = StepFlops.of(build_model(load_recipe(path).model, device="cpu", vocab_size=311))
    trained, mismatched = 4 * 48, 4 * 48  # prompt + one completion, each one causal segment

    def forward(tokens: int, squared: int) -> float:
        return 2.0 * f.matmul_params * tokens + 2.0 * f.layers * f.heads * f.head_dim * squared

    # The reference's pack: the prompt and the completion (48 queries, 48 keys), the mismatched
    # completion (16 queries, 48 keys).
    whole = 4 * (48 * 48 + 16 * 48)
    assert ours["flops"] == pytest.approx(f(trained, 48 * trained) + forward(mismatched, 48 * mismatched)
                                          + forward(4 * 64, whole))
    assert "4 examples a step, each a prompt of 32 tokens and a completion and a mismatched completion of 16" in (
        result.output)
    assert "examples/s" in result.output


def test_synthetic_kto_examples_take_the_next_ones_completion():
    units = synthetic_kto(3, 4, 2, 50, seed=1)
    completions = [u.input_ids[4:6] for u in units]
    assert [u.input_ids[6:] for u in units] == [completions[1], completions[2], completions[0]]
    assert [u.desirable for u in units] == [True, False, True]
    assert all(u.answer_lens == (2, 2) and u.scored_tokens() == [2, 2] for u in units)


def test_trl_kto_row_runs_the_same_examples_when_installed(tmp_path, monkeypatch):
    """TRL's KTOTrainer on the same model and examples (CPU, float32), the mismatched completions ours."""
    pytest.importorskip("trl")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    path = tmp_path / "kto.yaml"
    path.write_text(RECIPE.replace("name: dpo", "name: kto"))
    config = StepBenchConfig(steps=2, warmup=1, measure_matmul=False, pairs=4)
    report = run_step_bench(load_recipe(path), config)
    rows = {row.name: row for row in report.rows}
    trl = rows["TRL KTOTrainer"]
    assert trl.status == "ok", trl.detail
    assert trl.steps == 2 and trl.pairs == 4 and trl.reference == "frozen copy, in the step"
    assert trl.tokens == rows["ligertune"].tokens and trl.flops == rows["ligertune"].flops
    path.write_text(RECIPE.replace("name: dpo", "name: kto").replace("seed: 3", "seed: 3\n  grad_accum_steps: 4"))
    one = run_step_bench(load_recipe(path), config)  # 1 example a micro-batch: TRL's KL has nothing to pair
    assert {row.name: row for row in one.rows}["TRL KTOTrainer"].status == "skipped"


def test_the_trl_rows_keep_to_one_gpu_when_several_are_visible(tmp_path, monkeypatch):
    """transformers' Trainer takes every visible GPU in one process (nn.DataParallel, the micro-batch
    times the GPUs): the peer's step would not be the one ligertune's rows run."""
    import torch
    from transformers import TrainingArguments

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert args.n_gpu == 2  # what Trainer would spread each micro-batch over
    bench_preference.one_device(args)
    assert args.n_gpu == 1 and args.train_batch_size == args.per_device_train_batch_size


def test_a_trainer_that_cannot_be_kept_to_one_gpu_fails_its_row_saying_so():
    import torch

    class Spread:  # a TrainingArguments whose GPU count does not follow `_n_gpu`
        n_gpu = 4
        device = torch.device("cuda", 0)

    with pytest.raises(RuntimeError, match="spread over 4 GPUs; make one visible with CUDA_VISIBLE_DEVICES"):
        bench_preference.one_device(Spread())


def test_a_length_spread_draws_each_prompt_and_answer_within_it():
    assert spread_lengths(100, 0.5) == (50, 150) and spread_lengths(1, 0.9) == (1, 2)
    pairs = synthetic_pairs(200, 100, 40, 50, seed=4, spread=0.5)
    prompts = [u.prompt_len for u in pairs]
    answers = [n for u in pairs for n in u.answer_lens]
    assert min(prompts) >= 50 and max(prompts) <= 150 and len(set(prompts)) > 50
    assert min(answers) >= 20 and max(answers) <= 60
    assert any(chosen != rejected for chosen, rejected in (u.answer_lens for u in pairs))
    assert 95 < sum(prompts) / len(prompts) < 105 and 38 < sum(answers) / len(answers) < 42  # the middle
    assert all(len(u.input_ids) == u.prompt_len + sum(u.answer_lens) for u in pairs)
    assert [u.input_ids for u in synthetic_pairs(5, 100, 40, 50, seed=4, spread=0.5)] == [
        u.input_ids for u in pairs[:5]]  # the seed decides
    examples = synthetic_kto(20, 100, 40, 50, seed=4, spread=0.5)
    completions = [u.input_ids[u.prompt_len:u.prompt_len + u.answer_lens[0]] for u in examples]
    assert len({len(c) for c in completions}) > 5
    assert all(u.input_ids[u.prompt_len + u.answer_lens[0]:] == completions[(i + 1) % 20]
               for i, u in enumerate(examples))


def test_a_length_spread_reaches_the_pairs_and_the_header(tmp_path, no_peers, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "step.json"
    result = run_cli(str(write(tmp_path)), "--steps", "1", "--warmup", "0", "--pairs", "4", "--seed", "3",
                     "--prompt-len", "20", "--answer-len", "8", "--length-spread", "0.5", "--json", str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert data["pairs"]["length_spread"] == 0.5 and data["pairs"]["seed"] == 3
    ours = data["rows"][0]
    drawn = synthetic_pairs(4, 20, 8, data["model"]["vocab_size"], seed=3, spread=0.5)
    assert data["pairs"]["drawn"] == [[u.prompt_len, *u.answer_lens] for u in drawn]
    assert drawn != synthetic_pairs(4, 20, 8, data["model"]["vocab_size"], seed=0, spread=0.5)
    assert ours["status"] == "ok" and ours["tokens"] == sum(len(u.input_ids) for u in drawn) != 4 * 36
    listed = ", ".join(f"{u.prompt_len}+{u.answer_lens[0]}+{u.answer_lens[1]}" for u in drawn)
    output = " ".join(result.output.split())
    assert ("4 pairs a step, each a prompt of 20 tokens and two answers of 8; each length drawn within 50% "
            "of these, uniformly (36 tokens packed in the middle") in output
    assert f"drawn with seed 3, prompt+chosen+rejected: {listed}" in output


def test_trl_rows_pad_the_same_spread_pairs_when_installed(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    config = StepBenchConfig(steps=1, warmup=1, measure_matmul=False, pairs=4, prompt_len=20, answer_len=8,
                             length_spread=0.5)
    rows = {row.name: row for row in run_step_bench(load_recipe(write(tmp_path)), config).rows}
    trl = rows["TRL DPOTrainer"]
    assert trl.status == "ok", trl.detail
    assert trl.pairs == 4 and trl.tokens == rows["ligertune"].tokens and trl.flops == rows["ligertune"].flops
