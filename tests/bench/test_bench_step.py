"""`ligertune bench step` on a tiny Llama on the CPU, and the arithmetic behind its columns."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from ligertune.bench import step as bench_step
from ligertune.bench.caps import cap_choices
from ligertune.bench.results import StepRow
from ligertune.bench.step import StepBenchConfig, run_step_bench
from ligertune.bench.synthetic import padded_groups, synthetic_conversations, whole_micro_batches
from ligertune.cli.bench import app
from ligertune.models import decoder_of
from ligertune.recipe import DataConfig, load_recipe
from ligertune.training import build, clipping
from ligertune.training import step as training_step
from ligertune.training.memory import GIB, CheckpointPlanner

RECIPE = """\
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
  dtype: float32
data:
  path: chat.jsonl
  max_seq_len: 48
train:
  micro_batch_size: 2
  gradient_checkpointing: true
  seed: 3
"""


@pytest.fixture
def recipe_file(tmp_path):
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    path = tmp_path / "tiny.yaml"
    path.write_text(RECIPE)
    return path


def test_bench_step_runs_one_step_of_each_variant(recipe_file, tmp_path, no_peers):
    out = tmp_path / "step.json"
    args = ["step", str(recipe_file), "--steps", "1", "--warmup", "0", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert data["device_type"] == "cpu" and data["micro_batch_size"] == 2 and data["max_seq_len"] == 48
    assert data["model"]["type"] == "LlamaForCausalLM" and data["model"]["vocab_size"] == 311
    assert "rms_norm" in data["kernels"] and "fused loss: on" in data["kernels"]
    rows = {row["name"]: row for row in data["rows"]}
    assert list(rows) == ["ligertune", "HF (sdpa)", "HF + Liger",
                          "ligertune, packed chat", "ligertune, padded chat"]
    for name in ("ligertune", "HF (sdpa)"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["tokens"] == 2 * 48 and rows[name]["steps"] == 1
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["flops"] > 0
        assert rows[name]["mfu"] is None and rows[name]["peak_mem_gib"] is None  # no GPU
    assert rows["ligertune"]["vs_ligertune"] == 1.0
    assert rows["HF + Liger"]["status"] == "not installed"
    packed, padded = rows["ligertune, packed chat"], rows["ligertune, padded chat"]
    assert packed["status"] == "ok" and padded["status"] == "ok"
    assert packed["tokens"] == padded["tokens"] > 0  # the same conversations, real tokens only
    assert packed["flops"] == padded["flops"]
    assert padded["steps"] >= packed["steps"]  # padding needs at least as many micro-batches
    assert "HF + Liger: not installed" in result.output


def test_bench_step_without_chat_and_with_overrides(recipe_file, no_peers):
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--steps", "1", "--warmup", "0", "--no-chat",
                                      "--set", "train.micro_batch_size=1", "--set", "kernels.rms_norm=false"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "packed chat" not in result.output
    assert "batch: 1 x 48 tokens" in result.output


def test_bench_step_bad_recipe_is_one_clear_error(recipe_file):
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--set", "train.micro_batch_sise=1"])
    assert result.exit_code == 2
    assert "micro_batch_size" in result.output  # the did-you-mean


def test_bench_step_says_it_does_not_time_distillation(recipe_file):
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--set", "objective.name=distill",
                                      "--set", "objective.teacher=somewhere"])
    assert result.exit_code == 2
    assert "objective.name" in result.output and "bench kernels" in result.output


@pytest.mark.parametrize(
    "lengths, budget",
    [
        pytest.param([5, 3, 8, 2, 9, 1, 1, 1], 16, id="mixed"),
        pytest.param([16, 16, 1], 16, id="full-rows"),
        pytest.param([7], 100, id="one"),
    ],
)
def test_padded_groups_keep_order_and_budget(lengths, budget):
    groups = padded_groups(lengths, budget)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for group in groups:
        assert len(group) * max(lengths[i] for i in group) <= budget
    # Greedy: the next conversation would not have fitted.
    for group, nxt in zip(groups, groups[1:]):
        grown = group + [nxt[0]]
        assert len(grown) * max(lengths[i] for i in grown) > budget


def test_synthetic_conversations_are_mixed_masked_and_bounded():
    examples = synthetic_conversations(5000, max_len=300, vocab_size=97, seed=1)
    lengths = [len(e) for e in examples]
    assert sum(lengths) >= 5000 and sum(lengths) - lengths[-1] < 5000
    assert min(lengths) >= 8 and max(lengths) <= 300 and len(set(lengths)) > 10
    for e in examples:
        prompt = e.labels.index(next(x for x in e.labels if x != -100))
        assert 0.2 * len(e) - 1 <= prompt <= 0.6 * len(e)
        assert e.labels[prompt:] == e.input_ids[prompt:]
        assert all(0 <= t < 97 for t in e.input_ids)
    again = synthetic_conversations(5000, max_len=300, vocab_size=97, seed=1)
    assert [e.input_ids for e in again] == [e.input_ids for e in examples]


def test_restored_module_undoes_a_monkey_patch(monkeypatch):
    module = types.ModuleType("ligertune_bench_fake_modeling")
    module.apply = original = object()
    module.Norm = norm = object()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with bench_step._restored_module(module.__name__):
        module.apply = object()
        module.added = 1
        del module.Norm
    assert module.apply is original and module.Norm is norm
    assert not hasattr(module, "added")


def test_bench_step_builds_lora_recipes_as_train_does(tmp_path):
    """A LoRA recipe is benchmarked with its adapters: ligertune and the peers train the same
    adapters of the same frozen base."""
    from tiny_recipe import write_recipe

    recipe = load_recipe(write_recipe(tmp_path, lora={"r": 4, "alpha": 8}))
    report = run_step_bench(recipe, StepBenchConfig(steps=1, warmup=0, chat=False, measure_matmul=False))
    rows = {row.name: row for row in report.rows}
    assert rows["ligertune"].status == "ok"
    assert rows["HF (sdpa) + peft"].status == "ok"
    assert "HF + Liger + peft" in rows
    assert report.model["type"] == "LlamaForCausalLM"  # the base model, not the peft wrapper
    assert 0 < report.model["trainable_params"] < report.model["params"] / 10  # adapters only


def row(name, checkpointing, tokens_per_s, peak, status="ok"):
    return StepRow(name, "synthetic", status=status, tokens_per_s=tokens_per_s, peak_mem_gib=peak,
                   checkpointing=checkpointing)


def test_each_variant_runs_its_fastest_setting_that_fits_a_cap():
    peers = [row("HF (sdpa)", "off", 100.0, 30.0), row("HF (sdpa)", "every layer", 80.0, 12.0),
             row("HF + Liger", "off", 120.0, 20.0), row("HF + Liger", "every layer", 90.0, 9.0)]
    planned = {10.0: row("ligertune", "auto: 16 of 16 layers", 95.0, 9.5),
               24.0: row("ligertune", "auto: 4 of 16 layers", 130.0, 23.0),
               8.0: row("ligertune", "auto: 16 of 16 layers", 95.0, 9.5)}
    choices = cap_choices(peers, planned, [8.0, 10.0, 24.0])
    got = {(c.cap_gib, c.name): (c.checkpointing, c.fits) for c in choices}
    assert got == {
        (8.0, "ligertune"): ("auto: 16 of 16 layers", False),  # the policy's answer, over the cap
        (8.0, "HF (sdpa)"): (None, False), (8.0, "HF + Liger"): (None, False),
        (10.0, "ligertune"): ("auto: 16 of 16 layers", True),
        (10.0, "HF (sdpa)"): (None, False), (10.0, "HF + Liger"): ("every layer", True),
        (24.0, "ligertune"): ("auto: 4 of 16 layers", True),
        (24.0, "HF (sdpa)"): ("every layer", True), (24.0, "HF + Liger"): ("off", True),
    }
    speedups = {(c.cap_gib, c.name): c.vs_ligertune for c in choices}
    assert speedups[(24.0, "HF + Liger")] == pytest.approx(130 / 120)
    assert speedups[(10.0, "HF + Liger")] == pytest.approx(95 / 90)
    assert speedups[(8.0, "HF + Liger")] is None  # nothing fits, nothing to compare


def test_bench_step_under_memory_caps_writes_every_choice(recipe_file, tmp_path, no_peers):
    out = tmp_path / "caps.json"
    args = ["step", str(recipe_file), "--steps", "1", "--warmup", "0", "--memory-cap", "4,8", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert data["caps_gib"] == [4.0, 8.0]
    measured = [(r["name"], r["checkpointing"]) for r in data["rows"] if r["status"] == "ok"]
    # The peers with checkpointing off and on; ligertune's auto policy once per cap (on the CPU it
    # recomputes nothing: there is no allocator to measure).
    assert measured == [("HF (sdpa)", "off"), ("HF (sdpa)", "every layer"),
                        ("ligertune", "auto: 0 of 2 layers"), ("ligertune", "auto: 0 of 2 layers")]
    assert {(c["cap_gib"], c["name"]) for c in data["choices"]} == {
        (cap, name) for cap in (4.0, 8.0) for name in ("ligertune", "HF (sdpa)", "HF + Liger")}
    assert "under memory caps" in result.output


def test_plot_needs_memory_caps(recipe_file):
    result = CliRunner().invoke(app, ["step", str(recipe_file), "--plot", "x.png"])
    assert result.exit_code == 2
    assert "--plot: draws the memory frontier, so it needs --memory-cap" in result.output


def test_bench_step_without_peers_times_ligertune_only(recipe_file, tmp_path, no_peers):
    out = tmp_path / "caps.json"
    args = ["step", str(recipe_file), "--steps", "1", "--warmup", "0", "--no-chat", "--no-peers",
            "--memory-cap", "4", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())
    assert [(r["name"], r["status"]) for r in data["rows"]] == [("ligertune", "ok")]
    assert [c["name"] for c in data["choices"]] == ["ligertune"]


def test_chat_rows_keep_the_conversations_that_fill_whole_micro_batches():
    from ligertune.data.packing import pack

    examples = synthetic_conversations(4 * 2 * 512, 512, 300, seed=0)
    assert len(pack(examples, 512)) % 2 == 1  # as drawn, the last micro-batch would be a lone pack
    kept, packs = whole_micro_batches(examples, DataConfig(max_seq_len=512), 2)
    assert len(packs) == len(pack(examples, 512)) - 1 and len(packs) % 2 == 0
    assert sorted(map(len, kept)) == sorted(n for p in packs for n in p.seq_lens)
    assert all(e in examples for e in kept)


def test_bench_step_offloads_as_the_recipe_says(recipe_file, tmp_path, no_peers):
    out = tmp_path / "step.json"
    args = ["step", str(recipe_file), "--steps", "1", "--warmup", "0", "--no-chat", "--no-peers",
            "--set", "train.activation_offload=true", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["checkpointing"]) for r in rows] == [("ligertune", "every layer, offloaded")]


# --------------------------------------------------------------------------------------------------
# The ligertune rows run the trainer's step


def recording(calls: list, fn):
    """`fn`, with the arguments of each call appended to `calls`."""
    def wrapper(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)
    return wrapper


ROW_ONLY = StepBenchConfig(steps=3, warmup=2, chat=False, peers=False, measure_matmul=False)


def test_the_ligertune_row_steps_through_the_trainers_step(recipe_file, monkeypatch, no_peers):
    steps, trainer_clips, peer_clips = [], [], []
    monkeypatch.setattr(training_step, "train_step", recording(steps, training_step.train_step))
    monkeypatch.setattr(training_step, "clip_gradients", recording(trainer_clips, training_step.clip_gradients))
    monkeypatch.setattr(clipping, "clip_gradients", recording(peer_clips, clipping.clip_gradients))
    recipe = load_recipe(recipe_file, ["optim.clip=per_tensor", "optim.max_grad_norm=0.5"])
    report = run_step_bench(recipe, StepBenchConfig(steps=3, warmup=2, chat=False, measure_matmul=False))
    rows = {row.name: row for row in report.rows}
    assert rows["ligertune"].status == rows["HF (sdpa)"].status == "ok"
    assert [len(batches) for _, batches in steps] == [1] * (2 + 3)  # warm-up and timed, one micro-batch each
    assert len({id(run) for run, _ in steps}) == 1  # one run, its state carried from step to step
    assert steps[-1][0].state.step == 5
    assert [args[1:] for args in trainer_clips] == [(0.5, "per_tensor")] * 5
    assert [args[1:] for args in peer_clips] == [(0.5, "per_tensor")] * 5  # the HF row clips as the recipe says


def test_under_auto_on_a_cpu_the_row_says_what_the_trainer_decides(recipe_file, monkeypatch, no_peers):
    recipe = load_recipe(recipe_file, ["train.gradient_checkpointing=auto"])
    recomputed = []  # each step's layers, recomputed or not
    step = training_step.train_step

    def flags_then_step(run, batches):
        recomputed.append([layer.gradient_checkpointing for layer in decoder_of(run.model).layers])
        return step(run, batches)

    monkeypatch.setattr(training_step, "train_step", flags_then_step)
    report = run_step_bench(recipe, ROW_ONLY)
    cpu = torch.device("cpu")
    trainers = build.build_run(recipe, build.build_model(recipe, device=cpu, vocab_size=None).module,
                               device=cpu, total_steps=1)
    assert trainers.checkpointing == 0  # no device memory to plan with
    assert [(r.name, r.checkpointing) for r in report.rows] == [("ligertune", "auto: 0 of 2 layers")]
    assert recomputed == [[False, False]] * (2 + 3)  # nothing to plan: no untimed planning steps


class FakeAllocator:
    """Allocator statistics made up so that a 1 GiB budget leaves one of two layers un-checkpointed."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls = 0

    def reset_peak(self) -> None:
        pass

    def allocated(self) -> int:
        self.calls += 1
        return 10**6 + (1000 if self.calls > 1 else 0)  # the first update allocates 1000 bytes of state

    def peak(self) -> int:
        return GIB - 1010


def test_under_auto_the_planners_two_steps_run_untimed_first(recipe_file, monkeypatch, no_peers):
    monkeypatch.setattr(build, "device_allocator", lambda device: FakeAllocator())
    recipe = load_recipe(recipe_file, ["train.gradient_checkpointing=auto", "train.memory_budget_gib=1"])
    plans, runs = [], []  # the plan each step starts from, and the run
    step = training_step.train_step

    def plan_then_step(run, batches):
        plans.append(run.checkpointing.plan)
        runs.append(run)
        return step(run, batches)

    monkeypatch.setattr(training_step, "train_step", plan_then_step)
    lines = []
    report = run_step_bench(recipe, ROW_ONLY, log=lines.append)
    # Measured (no plan yet), re-planned (a new plan), then warm-up and timed under the final plan.
    assert len(plans) == 2 + 2 + 3
    assert plans[0] is None and plans[1] is not None and plans[2] is not plans[1]
    assert all(plan is plans[2] for plan in plans[2:])
    planner = runs[0].checkpointing
    assert isinstance(planner, CheckpointPlanner) and planner.plan is plans[2] and planner.plan.checkpointed == 1
    (row,) = report.rows
    assert row.steps == 3
    assert row.checkpointing == f"auto: 1 of 2 layers (predicted {planner.plan.predicted_peak_gib:.1f} GiB)"
    assert any(line.startswith("gradient checkpointing (auto, 1 GiB budget)") for line in lines)
