"""`ligertune bench step` on a tiny Llama on the CPU, and the arithmetic behind its columns."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from ligertune.bench import step as bench_step
from ligertune.cli.bench import app

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


@pytest.mark.parametrize(
    "lengths, budget",
    [
        pytest.param([5, 3, 8, 2, 9, 1, 1, 1], 16, id="mixed"),
        pytest.param([16, 16, 1], 16, id="full-rows"),
        pytest.param([7], 100, id="one"),
    ],
)
def test_padded_groups_keep_order_and_budget(lengths, budget):
    groups = bench_step.padded_groups(lengths, budget)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for group in groups:
        assert len(group) * max(lengths[i] for i in group) <= budget
    # Greedy: the next conversation would not have fitted.
    for group, nxt in zip(groups, groups[1:]):
        grown = group + [nxt[0]]
        assert len(grown) * max(lengths[i] for i in grown) > budget


def test_synthetic_conversations_are_mixed_masked_and_bounded():
    examples = bench_step.synthetic_conversations(5000, max_len=300, vocab_size=97, seed=1)
    lengths = [len(e) for e in examples]
    assert sum(lengths) >= 5000 and sum(lengths) - lengths[-1] < 5000
    assert min(lengths) >= 8 and max(lengths) <= 300 and len(set(lengths)) > 10
    for e in examples:
        prompt = e.labels.index(next(x for x in e.labels if x != -100))
        assert 0.2 * len(e) - 1 <= prompt <= 0.6 * len(e)
        assert e.labels[prompt:] == e.input_ids[prompt:]
        assert all(0 <= t < 97 for t in e.input_ids)
    again = bench_step.synthetic_conversations(5000, max_len=300, vocab_size=97, seed=1)
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


def test_token_mean_weights():
    targets = torch.tensor([[-100, 4, 5, -100, 7]])
    w = bench_step.token_mean_weights(targets, -100)
    assert torch.equal(w, torch.tensor([[0.0, 1 / 3, 1 / 3, 0.0, 1 / 3]]))


def test_bench_step_builds_lora_recipes_as_train_does(tmp_path):
    """A LoRA recipe is benchmarked with its adapters: ligertune and the peers train the same
    adapters of the same frozen base."""
    from ligertune.bench.step import StepBenchConfig, run_step_bench
    from ligertune.recipe import load_recipe
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
    return bench_step.StepRow(name, "synthetic", status=status, tokens_per_s=tokens_per_s, peak_mem_gib=peak,
                              checkpointing=checkpointing)


def test_each_variant_runs_its_fastest_setting_that_fits_a_cap():
    peers = [row("HF (sdpa)", "off", 100.0, 30.0), row("HF (sdpa)", "every layer", 80.0, 12.0),
             row("HF + Liger", "off", 120.0, 20.0), row("HF + Liger", "every layer", 90.0, 9.0)]
    planned = {10.0: row("ligertune", "auto: 16 of 16 layers", 95.0, 9.5),
               24.0: row("ligertune", "auto: 4 of 16 layers", 130.0, 23.0),
               8.0: row("ligertune", "auto: 16 of 16 layers", 95.0, 9.5)}
    choices = bench_step.cap_choices(peers, planned, [8.0, 10.0, 24.0])
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
    from ligertune.bench.step import synthetic_conversations, whole_micro_batches
    from ligertune.data.packing import pack

    examples = synthetic_conversations(4 * 2 * 512, 512, 300, seed=0)
    assert len(pack(examples, 512)) % 2 == 1  # as drawn, the last micro-batch would be a lone pack
    kept, packs = whole_micro_batches(examples, 512, 2)
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
