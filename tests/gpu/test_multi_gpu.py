"""Several GPUs through NCCL, driven as a user drives them (`ligertune ... --nproc N`): verify-loss
passes with the step of Llama-3.2-1B shapes in bf16 dealt to N GPUs, and with the steps of DPO, KTO,
distillation and Medusa dealt to 2; 2 GPUs train as one GPU with twice the accumulation, and as two
nodes of one GPU each; a checkpoint of 2 GPUs resumes where the run went, DPO's and Medusa's too; the
1B bench recipe trains sharded over 2 GPUs, with every figure the trainer reports.

Skipped, with the reason, on fewer GPUs than a test needs. The same checks run on the CPU with 2
gloo processes (tests/training/test_distributed.py, test_distributed_resume.py); the multi-GPU
figures are scripts/multi_gpu.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from cli_runs import assert_resume_continues_the_run, free_port, ligertune, start_ligertune, train_records
from safetensors.torch import load_file
from tiny_recipe import (
    TINY_MODEL,
    save_tiny_model,
    write_distill_recipe,
    write_medusa_recipe,
    write_preference_recipe,
    write_recipe,
)

from ligertune.flops import spec_peak_tflops
from ligertune.numerics import relative_error
from ligertune.verify import TOLERANCES

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
BENCH_1B = ROOT / "recipes" / "bench" / "llama-3.2-1b.yaml"
BENCH_1B_DPO = ROOT / "recipes" / "bench" / "llama-3.2-1b-dpo.yaml"
# Starts in seconds; wide enough that the kernels run several blocks a row.
MODEL = {**TINY_MODEL, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2}
# A 1B model's processes start, build and compile in about a minute; a run of a few steps in two.
TIMEOUT = 600


def needs_gpus(count: int) -> None:
    here = torch.cuda.device_count()
    if here < count:
        pytest.skip(f"needs {count} CUDA GPUs, {here} here")


@pytest.fixture(autouse=True)
def _two_gpus():
    needs_gpus(2)


def succeeded(result) -> str:
    """What a failed command printed last (the message of a failed assertion on its exit code)."""
    return result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_verify_loss_passes_with_the_step_dealt_to_n_gpus(processes: int):
    """Every verify-loss case of N sharded processes (packed in one micro-batch, one conversation per
    micro-batch; token and sequence normalization) within bf16's tolerances of the single-row
    reference, on the bench recipe's Llama-3.2-1B shapes."""
    needs_gpus(processes)
    result = ligertune("verify-loss", str(BENCH_1B), "--nproc", str(processes), "--samples", "8", "--json",
                       timeout=TIMEOUT)
    assert result.returncode == 0, succeeded(result)
    report = json.loads(result.stdout)  # printed once, by the first process
    dealt = [c for c in report["cases"] if c["name"].startswith(f"{processes} processes") and c["kind"] == "ligertune"]
    assert sorted(c["mode"] for c in dealt) == ["sequence", "sequence", "token", "token"]
    assert all(c["pass"] for c in dealt), dealt
    assert report["pass"] is True


@pytest.mark.parametrize("objective", ["dpo", "kto", "distill", "medusa"])
def test_verify_loss_passes_with_each_objectives_step_dealt_to_two_gpus(tmp_path: Path, objective: str):
    """The objectives after SFT in bf16, their step dealt to 2 GPUs as `train --nproc 2` deals it:
    DPO and KTO on the 1B DPO bench recipe (the quick-start pairs), distillation (a student and its
    teacher sharded alike) and Medusa heads over a frozen model, each within bf16's tolerances of
    the one-process reference."""
    if objective in ("dpo", "kto"):
        recipe = [str(BENCH_1B_DPO), "--set", f"objective.name={objective}"]
    elif objective == "distill":
        student = {**MODEL, "hidden_size": 256, "intermediate_size": 688}
        recipe = [str(write_distill_recipe(tmp_path, teacher=save_tiny_model(tmp_path / "teacher", seed=1),
                                           model={"config": student, "dtype": "bfloat16"}))]
    else:
        base = save_tiny_model(tmp_path / "base", seed=3)
        recipe = [str(write_medusa_recipe(tmp_path, base=base, model={"name_or_path": str(base), "config": None,
                                                                       "tokenizer": None, "dtype": "bfloat16"}))]
    result = ligertune("verify-loss", *recipe, "--nproc", "2", "--samples", "8", "--json", timeout=TIMEOUT)
    assert result.returncode == 0, succeeded(result)
    report = json.loads(result.stdout)
    dealt = [c for c in report["cases"] if c["name"].startswith("2 processes") and c["kind"] == "ligertune"]
    assert dealt and all(c["pass"] for c in dealt), dealt
    assert report["pass"] is True


def test_two_nodes_of_one_gpu_train_as_one_node_of_two(tmp_path: Path):
    """The multi-node path on one host: two launches (`--nnodes 2 --node-rank 0/1 --nproc 1`, each
    seeing its own GPU) meet at torchrun's rendezvous and run NCCL between them; they take the same
    steps as one launch of 2 processes: the same tokens and learning rates, the losses and gradient
    norms within float32's rounding, and the same final weights."""
    path = write_recipe(tmp_path, model={"config": MODEL, "dtype": "float32"},
                        train={"max_steps": 4, "micro_batch_size": 2, "grad_accum_steps": 1, "eval_every": None},
                        distributed={"strategy": "fsdp"})
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_ligertune("train", str(path), "-o", str(tmp_path / "nodes"), "--nnodes", "2",
                             "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--nproc", "1",
                             env={"CUDA_VISIBLE_DEVICES": str(rank)})
             for rank in (0, 1)]
    for node in nodes:
        out, err = node.communicate(timeout=TIMEOUT)
        assert node.returncode == 0, out[-2000:] + err[-3000:]
    one = ligertune("train", str(path), "--nproc", "2", "-o", str(tmp_path / "one"), timeout=TIMEOUT)
    assert one.returncode == 0, succeeded(one)

    split, straight = train_records(tmp_path / "nodes"), train_records(tmp_path / "one")
    assert [r["step"] for r in split] == [r["step"] for r in straight] == [1, 2, 3, 4]
    for mine, reference in zip(split, straight):
        assert mine["tokens"] == reference["tokens"] and mine["lr"] == reference["lr"], mine["step"]
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5), mine["step"]
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), mine["step"]
    expected, weights = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("one", "nodes"))
    assert weights.keys() == expected.keys()
    for name, weight in weights.items():
        assert relative_error(weight, expected[name]) < 1e-4, name


def test_two_gpus_train_as_one_gpu_with_twice_the_accumulation(tmp_path: Path):
    """The same packs at every step (2 processes x 1 micro-batch, 1 x 2), float32: the same tokens and
    learning rates, and the loss and gradient norm of every step within float32's rounding over
    four AdamW steps (a step normalized per process, not over the whole step, is off by percents)."""
    path = write_recipe(tmp_path, model={"config": MODEL, "dtype": "float32"},
                        train={"max_steps": 4, "micro_batch_size": 2, "grad_accum_steps": 1, "eval_every": None})
    two = ligertune("train", str(path), "--nproc", "2", "-o", str(tmp_path / "two"), timeout=TIMEOUT)
    assert two.returncode == 0, succeeded(two)
    one = ligertune("train", str(path), "-o", str(tmp_path / "one"), "--set", "train.grad_accum_steps=2",
                    timeout=TIMEOUT)
    assert one.returncode == 0, succeeded(one)
    records = {name: train_records(tmp_path / name) for name in ("one", "two")}
    assert [r["step"] for r in records["two"]] == [r["step"] for r in records["one"]] == [1, 2, 3, 4]
    for mine, reference in zip(records["two"], records["one"]):
        assert mine["tokens"] == reference["tokens"] and mine["lr"] == reference["lr"], mine["step"]
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4), mine["step"]
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-3), mine["step"]


def test_a_checkpoint_of_two_gpus_resumes_the_run(tmp_path: Path):
    """FSDP2 over 2 GPUs in bf16 over float32 weights: 4 steps straight, against 2 steps, a checkpoint
    (each rank's shard of the optimizer state) and `--resume` to step 4. The data position and the
    schedule continue exactly; the loss and gradient norm within verify-loss's bf16 tolerances,
    since GPU kernels need not repeat bit for bit from one run to the next."""
    path = write_recipe(tmp_path, model={"config": MODEL, "dtype": "bfloat16"},
                        train={"micro_batch_size": 2, "grad_accum_steps": 1, "eval_every": None},
                        optim={"warmup_steps": 2}, distributed={"strategy": "fsdp"})
    loss_rtol, grad_rtol = TOLERANCES[torch.bfloat16]
    assert_resume_continues_the_run(path, tmp_path / "run", processes=2, steps=4, save_at=2,
                                    loss_rtol=loss_rtol, grad_norm_rtol=grad_rtol, timeout=TIMEOUT)


@pytest.mark.parametrize("processes, resumed", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_checkpoint_resumes_on_another_number_of_gpus(tmp_path: Path, processes: int, resumed: int):
    """bf16 over float32 masters: FSDP2 keeps them as its sharded parameters, one process in the
    optimizer state; a checkpoint of either continues on the other (the step's packs the same, the
    accumulation set to match) with the loss and gradient norm of the straight run within bf16's
    tolerances."""
    path = write_recipe(tmp_path, model={"config": MODEL, "dtype": "bfloat16"},
                        train={"micro_batch_size": 2, "grad_accum_steps": 2 // processes, "eval_every": None},
                        optim={"warmup_steps": 2}, distributed={"strategy": "fsdp"})
    loss_rtol, grad_rtol = TOLERANCES[torch.bfloat16]
    assert_resume_continues_the_run(path, tmp_path / "run", processes=processes, resume_processes=resumed,
                                    steps=4, save_at=2, loss_rtol=loss_rtol, grad_norm_rtol=grad_rtol,
                                    timeout=TIMEOUT)


@pytest.mark.parametrize("objective", ["dpo", "medusa"])
def test_a_dpo_and_a_medusa_run_of_two_gpus_resume(tmp_path: Path, objective: str):
    """The objectives after SFT under FSDP2 over 2 GPUs, bf16 over float32 weights: DPO (its
    reference precomputed before the first step and read back from the run at `--resume`) and
    Medusa heads over a frozen model; 4 steps straight against 2 steps, a checkpoint and `--resume`
    to step 4, within verify-loss's bf16 tolerances."""
    sections = {"train": {"micro_batch_size": 2, "grad_accum_steps": 1, "eval_every": None},
                "optim": {"warmup_steps": 2}, "distributed": {"strategy": "fsdp"}}
    if objective == "dpo":
        path = write_preference_recipe(tmp_path, model={"config": MODEL, "dtype": "bfloat16"}, **sections)
    else:
        base = save_tiny_model(tmp_path / "base", seed=3)
        path = write_medusa_recipe(tmp_path, base=base, model={"name_or_path": str(base), "config": None,
                                                               "tokenizer": None, "dtype": "bfloat16"}, **sections)
    loss_rtol, grad_rtol = TOLERANCES[torch.bfloat16]
    assert_resume_continues_the_run(path, tmp_path / "run", processes=2, steps=4, save_at=2,
                                    loss_rtol=loss_rtol, grad_norm_rtol=grad_rtol, timeout=TIMEOUT)


def test_the_1b_bench_recipe_trains_sharded_over_two_gpus(tmp_path: Path):
    """What scripts/multi_gpu.py's scaling runs read: a record every step, each with a finite loss, the
    tokens per second of both processes, the MFU and rank 0's peak device memory."""
    run_dir = tmp_path / "run"
    result = ligertune("train", str(BENCH_1B), "--nproc", "2", "-o", str(run_dir), "--max-steps", "4",
                       "--set", "distributed.strategy=fsdp", "--set", "train.log_every=1",
                       "--set", "train.eval_every=null", "--set", "train.save_every=null", timeout=TIMEOUT)
    assert result.returncode == 0, succeeded(result)
    records = train_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    known_peak = spec_peak_tflops(torch.cuda.get_device_name(0)) is not None  # MFU needs the data sheet's
    for record in records:
        assert record["loss"] is not None and math.isfinite(record["loss"]), record
        assert record["tokens"] > 0 and record["tokens_per_s"] > 0, record
        if known_peak:
            assert 0 < record["mfu"] < 1, record
        else:
            assert "mfu" not in record, record
        assert 0 < record["peak_mem_gib"] < memory_gib, record
    assert (run_dir / "final" / "config.json").exists()
