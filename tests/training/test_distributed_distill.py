"""Distillation over 2 gloo processes, the teacher sharded like the student: verify-loss deals the
step out exactly, and a run of 2 processes, and its checkpoint resumed by 1, log the losses of one
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import two_processes_then_one
from test_distributed import ligertune
from tiny_recipe import write_distill_recipe

from ligertune.metrics import read_metrics


def test_verify_loss_deals_a_distillation_step_to_two_processes(tmp_path: Path):
    path = write_distill_recipe(tmp_path, objective={"loss": "jsd", "alpha": 0.5})
    result = ligertune("verify-loss", str(path), "--nproc", "2", "--samples", "6", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    sharded = [c for c in report["cases"] if c["name"].startswith("2 processes") and c["kind"] == "ligertune"]
    assert len(sharded) == 4 and all(c["pass"] for c in sharded), sharded
    assert report["pass"]


def test_two_processes_distil_and_resume_as_one_process(tmp_path: Path):
    path = write_distill_recipe(tmp_path, optim={"schedule": "constant", "lr": 1e-2},
                                train={"max_steps": 4, "eval_every": 2, "micro_batch_size": 2,
                                       "grad_accum_steps": 1})
    two, resumed, one = two_processes_then_one(path, tmp_path, save_at=2)

    def steps(run: Path) -> list[dict]:
        return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]

    assert [r["step"] for r in steps(two)] == [r["step"] for r in steps(resumed)] == [1, 2, 3, 4]
    for run in (two, resumed):
        for mine, reference in zip(steps(run), steps(one), strict=True):
            for key in ("loss", "divergence", "ce", "teacher_ce"):
                assert mine[key] == pytest.approx(reference[key], rel=1e-5), (run.name, mine["step"], key)
    evals = [r for r in read_metrics(two / "metrics.jsonl") if "eval_loss" in r]
    assert evals and all("eval_teacher_accuracy" in r for r in evals)
