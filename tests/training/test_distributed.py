"""Several processes (2 gloo processes on the CPU) compute what one process computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runs import failed_launch, ligertune, torchrun, two_processes_then_one
from distributed_lora_dtypes import one_step
from distributed_step import MODES, step_gradients
from rich.console import Console
from tiny_recipe import TINY_MODEL, write_recipe
from transformers import AutoModelForCausalLM

from ligertune.distributed import split_packs
from ligertune.metrics import read_metrics
from ligertune.numerics import relative_error
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop
from ligertune.training.build import FsdpDtypes, fsdp_dtypes

HERE = Path(__file__).resolve().parent
# Every option of the loss on, so that each term goes through the ranks.
LOSS = ["loss.z_loss_weight=1e-3", "loss.label_smoothing=0.1"]


def train_in_one_process(path: Path, *overrides: str, resume=None):
    """A whole run in this process; the finished run."""
    run = setup(load_recipe(path, list(overrides)), Console(quiet=True), resume=resume)
    try:
        train_loop(run)
    finally:
        cleanup(run)
    return run


def test_split_packs_gives_each_rank_as_many_packs_with_balanced_tokens():
    lengths = [100, 90, 80, 10, 10, 5, 3, 2]
    shares = split_packs(lengths, 2, length=lambda n: n)
    assert [len(s) for s in shares] == [4, 4]
    assert sorted(sum(shares, [])) == sorted(lengths)
    assert {sum(s) for s in shares} == {125, 175}  # the best split of these with 4 packs a rank
    even = split_packs([8, 7, 6, 5, 4, 3, 2, 1], 2, length=lambda n: n)
    assert [sum(s) for s in even] == [18, 18]
    assert split_packs(lengths, 2, length=lambda n: n) == shares  # deterministic
    with pytest.raises(ValueError):
        split_packs(lengths[:3], 2, length=lambda n: n)


@pytest.mark.parametrize("setting, accumulation", [
    pytest.param([], 2, id="full-fsdp"),
    pytest.param(["distributed.strategy=ddp"], 2, id="full-ddp"),
    pytest.param(["distributed.strategy=ddp"], 4, id="full-ddp-accumulating"),
    pytest.param(["lora.r=4", "lora.alpha=8"], 2, id="lora-fsdp"),
    pytest.param(["kernels.mlp_chunk_tokens=16", "train.gradient_checkpointing=true"], 2, id="mlp-chunks-fsdp"),
    pytest.param(["distributed.reshard_after_forward=false", "train.gradient_checkpointing=true"], 2,
                 id="fsdp-kept-after-forward"),
])
def test_two_processes_give_the_loss_and_gradients_of_one(tmp_path: Path, setting: list[str], accumulation: int):
    """1 process x accumulation A == 2 processes x A/2, for every normalization (z-loss and label
    smoothing on): the loss and every gradient within 1e-5."""
    path = write_recipe(tmp_path, train={"micro_batch_size": 2, "grad_accum_steps": accumulation},
                        model={"config": {**TINY_MODEL, "tie_word_embeddings": True}})
    overrides = [*LOSS, *setting]
    result = torchrun(HERE / "distributed_step.py", str(path), str(tmp_path / "two.pt"),
                      *overrides, f"train.grad_accum_steps={accumulation // 2}")
    assert result.returncode == 0, failed_launch(result)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    one = step_gradients(str(path), overrides, tmp_path / "one")
    for mode in MODES:
        loss_one, grads_one = one[mode]
        loss_two, grads_two = two[mode]
        assert loss_two == pytest.approx(loss_one, rel=1e-5), mode
        assert grads_one.keys() == grads_two.keys()
        for name, g in grads_one.items():
            assert relative_error(grads_two[name], g) < 1e-5, (mode, name)


@pytest.mark.parametrize("keep", [True, False])
def test_each_decoder_layer_is_sharded_as_the_recipe_says(monkeypatch, keep):
    """`distributed.reshard_after_forward` reaches every decoder layer's `fully_shard`; the root (the
    loss head, which gathers the output layer around the loss) keeps FSDP's default."""
    import torch.distributed.fsdp as fsdp

    from ligertune.distributed import shard

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)))
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    head = torch.nn.Sequential(*layers)
    shard(head, layers, strategy="fsdp", device=torch.device("cpu"), mixed_precision=None,
          reshard_after_forward=not keep)
    assert [m for m, _ in calls] == [*layers, head]
    assert all(kwargs["reshard_after_forward"] is (not keep) for _, kwargs in calls[:3])
    assert "reshard_after_forward" not in calls[3][1]


def test_keeping_the_gathered_weights_is_refused_under_ddp(tmp_path: Path):
    result = ligertune("train", str(write_recipe(tmp_path)), "--set", "distributed.strategy=ddp",
                       "--set", "distributed.reshard_after_forward=false")
    assert result.returncode == 2 and "distributed.reshard_after_forward" in result.stderr
    assert "Traceback" not in result.stderr


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("overrides, device_type, sharded, expected", [
    pytest.param(["model.dtype=bfloat16"], "cuda", True, FsdpDtypes(BF16, FP32, None), id="full-bf16"),
    pytest.param(["model.dtype=auto"], "cuda", True, FsdpDtypes(BF16, FP32, None), id="full-auto"),
    pytest.param(["model.dtype=bfloat16", "lora.r=4"], "cuda", True, FsdpDtypes(BF16, BF16, FP32), id="lora-bf16"),
    pytest.param(["model.dtype=float16", "lora.r=4", "lora.dropout=0.1", "lora.modules_to_save=[lm_head]",
                  "kernels.lora=false"], "cuda", True, FsdpDtypes(FP16, FP16, FP32), id="lora-fp16-peft"),
    pytest.param(["model.dtype=float32", "lora.r=4"], "cuda", True, FsdpDtypes(), id="lora-fp32"),
    pytest.param(["model.dtype=bfloat16", "lora.r=4"], "cuda", False, FsdpDtypes(), id="lora-one-process-or-ddp"),
    pytest.param(["model.dtype=bfloat16", "lora.r=4"], "cpu", True, FsdpDtypes(), id="lora-cpu"),
])
def test_fsdp_builds_a_lora_base_in_16_bits_and_a_full_model_in_float32(tmp_path: Path, overrides, device_type,
                                                                       sharded, expected):
    """(gathered dtype, model dtype, trainable dtype) under FSDP: float32 masters for whatever
    trains, the frozen LoRA base in the 16-bit compute dtype; nothing changes off CUDA FSDP."""
    recipe = load_recipe(write_recipe(tmp_path), overrides)
    assert fsdp_dtypes(recipe, device_type, sharded=sharded) == expected


def test_lora_under_fsdp_shards_a_bf16_base_beside_float32_adapters(tmp_path: Path):
    """LoRA with a bf16 model under FSDP's mixed precision (CUDA's policy, run on 2 CPU processes):
    every frozen local shard is bf16, every trainable one (adapters, the lm_head copy of
    `lora.modules_to_save`) float32; the step's loss is one bf16 process's within 1e-5 and its
    gradients within bf16's rounding (one process accumulates them in bf16, FSDP in float32)."""
    path = write_recipe(tmp_path, model={"dtype": "bfloat16"}, train={"micro_batch_size": 2, "grad_accum_steps": 2},
                        lora={"r": 4, "alpha": 8, "modules_to_save": ["lm_head"]})
    result = torchrun(HERE / "distributed_lora_dtypes.py", str(path), str(tmp_path / "two.pt"),
                      "train.grad_accum_steps=1")
    assert result.returncode == 0, failed_launch(result)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    one = one_step(str(path), [], tmp_path / "one")
    frozen = {name for name, (_, trainable) in two["dtypes"].items() if not trainable}
    assert {name for name in two["dtypes"] if "lora_" in name or "modules_to_save" in name} == set(two["grads"])
    assert any("embed_tokens" in name for name in frozen) and any("q_proj.base_layer" in name for name in frozen)
    for name, (dtype, trainable) in two["dtypes"].items():
        assert dtype == (torch.float32 if trainable else torch.bfloat16), name
    # One process: the same model in bf16, adapters and lm_head copy too (kernels.lora).
    assert {dtype for dtype, _ in one["dtypes"].values()} == {torch.bfloat16}
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        if g.abs().max() > 0:  # B starts at zero, so A's first gradient is zero everywhere
            assert relative_error(two["grads"][name], g) < 1e-2, name
        else:
            assert two["grads"][name].abs().max() == 0, name


def test_two_process_runs_train_save_resume_and_reload_as_one(tmp_path: Path):
    """Metrics and the final model of a 2-process run equal one process's, and so do those of its
    checkpoint resumed by 1 process with twice the accumulation (2 processes resuming 2 processes'
    checkpoint: tests/training/test_distributed_resume.py)."""
    path = write_recipe(tmp_path, train={"max_steps": 4, "eval_every": 2, "micro_batch_size": 2,
                                         "grad_accum_steps": 1},
                        optim={"schedule": "constant"})
    two, resumed, one = two_processes_then_one(path, tmp_path, save_at=2)
    assert (two / "checkpoints" / "step-000002" / "optimizer" / ".metadata").exists()

    def train_records(run_dir: Path) -> list[dict]:
        return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]

    assert [r["step"] for r in train_records(two)] == [1, 2, 3, 4]
    assert [r["step"] for r in train_records(resumed)] == [1, 2, 3, 4]
    for records in (train_records(two), train_records(resumed)):
        for mine, reference in zip(records, train_records(one), strict=True):
            assert mine["tokens"] == reference["tokens"]
            assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5)
            assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    # The final models, the first gathered from the shards, reload in Hugging Face format and match.
    ids = torch.arange(3, 40).unsqueeze(0)
    expected = AutoModelForCausalLM.from_pretrained(one / "final")(input_ids=ids).logits
    for final in (two / "final", resumed / "final"):
        logits = AutoModelForCausalLM.from_pretrained(final)(input_ids=ids).logits
        assert relative_error(logits, expected) < 1e-4, final


def test_lora_adapters_of_a_two_process_run_reload_with_peft(tmp_path: Path):
    from peft import PeftModel

    from ligertune.models import build_model

    path = write_recipe(tmp_path, train={"max_steps": 2, "micro_batch_size": 2, "grad_accum_steps": 1,
                                         "eval_every": None},
                        lora={"r": 4, "alpha": 8}, optim={"lr": 1e-2})
    result = ligertune("train", str(path), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    final = tmp_path / "run" / "final"
    assert (final / "adapter_model.safetensors").exists()
    straight = train_in_one_process(path, f"output.dir={tmp_path / 'one'}", "train.grad_accum_steps=2")
    ids = torch.tensor([straight.eval_examples[0].input_ids])
    logits = {}
    for name, folder in (("two", final), ("one", tmp_path / "one" / "final")):
        base = build_model(straight.recipe.model, device="cpu", seed=straight.recipe.train.seed,
                           vocab_size=len(straight.tokenizer))
        model = PeftModel.from_pretrained(base, folder).eval()
        logits[name] = model(input_ids=ids).logits
    assert relative_error(logits["two"], logits["one"]) < 1e-4


def test_a_mistake_under_two_processes_is_reported_once_with_exit_2(tmp_path: Path):
    path = write_recipe(tmp_path)
    result = ligertune("train", str(path), "--nproc", "2", "--set", "optim.lr=-1", timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("error:") == 1 and "optim.lr" in result.stderr
    # A mistake found once the processes run (the data file is missing): still once, no hang.
    result = ligertune("train", str(path), "--nproc", "2", "--set", "data.path=missing.jsonl", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("error:") == 1 and "missing.jsonl" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("sections, modes", [
    ({}, "token,sequence,sum"),
    ({"lora": {"r": 4, "alpha": 8}, "distributed": {"strategy": "ddp"}}, "token"),
], ids=["full-fsdp", "lora-ddp"])
def test_verify_loss_deals_the_step_to_two_processes(tmp_path: Path, sections: dict, modes: str):
    recipe = write_recipe(tmp_path, loss={"z_loss_weight": 1e-3, "label_smoothing": 0.1}, **sections)
    result = ligertune("verify-loss", str(recipe), "--nproc", "2", "--samples", "6", "--modes", modes, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # printed once, by the first process
    assert report["pass"] is True
    dealt = [c for c in report["cases"] if c["name"].startswith("2 processes")]
    ligertune_cases = [c for c in dealt if c["kind"] == "ligertune"]
    assert len(ligertune_cases) == 2 * len(modes.split(","))
    assert all(c["pass"] and c["grad_rel_err"] <= 1e-4 for c in ligertune_cases)
    # Each process normalizing by its own tokens (plain data parallelism) is caught.
    naive = next(c for c in dealt if c["name"] == "2 processes, mean per process")
    assert not naive["pass"] and naive["grad_rel_err"] > 1e-2


def test_verify_loss_samples_must_split_over_the_processes(tmp_path: Path):
    result = ligertune("verify-loss", str(write_recipe(tmp_path)), "--nproc", "2", "--samples", "5")
    assert result.returncode == 2
    assert "--samples: 5 conversations do not split evenly over 2 processes" in result.stderr


def test_lion_under_fsdp_trains_as_one_process(tmp_path: Path):
    """Lion's update is elementwise, so it runs on each rank's shard: 2 processes x 1 micro-batch give
    the losses and the final model of 1 process x 2."""
    path = write_recipe(tmp_path, train={"max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 1,
                                         "eval_every": None},
                        optim={"name": "lion", "lr": 3e-4, "weight_decay": 0.1, "schedule": "constant"})
    two = tmp_path / "two"
    result = ligertune("train", str(path), "--nproc", "2", "-o", str(two))
    assert result.returncode == 0, result.stderr[-3000:]
    straight = train_in_one_process(path, f"output.dir={tmp_path / 'one'}", "train.grad_accum_steps=2")
    losses = [[r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r] for d in (two, tmp_path / "one")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    ids = torch.tensor([straight.eval_examples[0].input_ids])
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "final")(input_ids=ids).logits
    logits = AutoModelForCausalLM.from_pretrained(two / "final")(input_ids=ids).logits
    assert relative_error(logits, expected) < 1e-4
    from ligertune.models import build_model

    recipe = straight.recipe
    untrained = build_model(recipe.model, device="cpu", seed=recipe.train.seed, vocab_size=len(straight.tokenizer))
    assert relative_error(untrained(input_ids=ids).logits, expected) > 1e-2  # the steps moved the model


def test_a_model_with_tied_embeddings_saves_the_same_tensors_from_two_processes_as_from_one(tmp_path: Path):
    """The final model is the same files whatever the world size: the tied output projection is kept
    once (under the embeddings' name), and every tensor matches one process's."""
    from safetensors.torch import load_file

    path = write_recipe(tmp_path, train={"max_steps": 2, "micro_batch_size": 2, "grad_accum_steps": 1,
                                         "eval_every": None},
                        model={"config": {**TINY_MODEL, "tie_word_embeddings": True}})
    two = tmp_path / "two"
    result = ligertune("train", str(path), "--nproc", "2", "-o", str(two))
    assert result.returncode == 0, result.stderr[-3000:]
    train_in_one_process(path, f"output.dir={tmp_path / 'one'}", "train.grad_accum_steps=2")
    saved = {name: load_file(folder / "final" / "model.safetensors") for name, folder in
             (("one", tmp_path / "one"), ("two", two))}
    assert "lm_head.weight" not in saved["one"]
    assert saved["two"].keys() == saved["one"].keys()
    for key, tensor in saved["one"].items():
        assert saved["two"][key].dtype == tensor.dtype, key
        assert relative_error(saved["two"][key].double(), tensor.double()) < 1e-5, key
