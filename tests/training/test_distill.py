"""Distillation (`objective.name: distill`): the recipe's checks, a run's metrics against its teacher,
the identities that pin the loss down (a student equal to its teacher, alpha 1 is SFT), verify-loss,
LoRA students and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import assert_resume_continues_the_run, train_here
from tiny_recipe import QUICKSTART, STUDENT, save_tiny_model, write_distill_recipe, write_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.errors import RecipeError
from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.verify import verify_loss

runner = CliRunner()


def steps_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def evals_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]


@pytest.mark.parametrize(("objective", "key", "words"), [
    ({"name": "distill"}, "objective.teacher", "needs a teacher"),
    ({"name": "distill", "teacher": "t", "loss": "jsd", "beta": 1.0}, "objective.beta", "(0, 1)"),
    ({"name": "distill", "teacher": "t", "beta": 0.3}, "objective.beta", "loss: jsd"),
    ({"name": "distill", "teacher": "t", "temperature": 0.0}, "objective.temperature", "> 0"),
    ({"name": "distill", "teacher": "t", "alpha": 1.5}, "objective.alpha", "[0, 1]"),
    ({"name": "sft", "teacher": "t"}, "objective.teacher", "distill only"),
    ({"name": "dpo", "temperature": 2.0}, "objective.temperature", "distill only"),
    ({"name": "distill", "teacher": "t", "reference": "live"}, "objective.reference", "remove it"),
], ids=["no-teacher", "jsd-beta-1", "beta-without-jsd", "temperature-0", "alpha-1.5", "teacher-for-sft",
        "temperature-for-dpo", "reference-for-distill"])
def test_the_recipe_refuses_what_distillation_cannot_mean(tmp_path: Path, objective, key, words):
    path = write_recipe(tmp_path, objective=objective)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    problems = [line for line in str(err.value).splitlines() if key in line]
    assert problems and words in problems[0], str(err.value)


def test_distillation_reads_chat_data_only(tmp_path: Path):
    path = write_distill_recipe(tmp_path, data={"format": "paired"})
    with pytest.raises(RecipeError, match="preference data"):
        load_recipe(path)


def test_a_teacher_with_other_tokens_is_refused_in_one_line(tmp_path: Path):
    from transformers import AutoTokenizer

    teacher = save_tiny_model(tmp_path / "teacher")
    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(teacher)
    result = runner.invoke(app, ["train", str(write_distill_recipe(tmp_path, teacher=teacher))])
    assert result.exit_code == 2
    assert "objective.teacher" in result.output and "vocabulary" in result.output
    assert "Traceback" not in result.output


def test_a_missing_teacher_is_named(tmp_path: Path):
    result = runner.invoke(app, ["train", str(write_distill_recipe(tmp_path, teacher=tmp_path / "nowhere"))])
    assert result.exit_code == 2 and "objective.teacher" in result.output, result.output


def test_a_run_reports_its_divergence_and_both_models(tmp_path: Path):
    path = write_distill_recipe(tmp_path, train={"max_steps": 6, "eval_every": 3, "eval_at_start": True},
                                optim={"lr": 1e-2})
    train_here(path)
    run = tmp_path / "run"
    steps = steps_of(run)
    assert [r["step"] for r in steps] == list(range(1, 7))
    keys = {"divergence", "ce", "token_accuracy", "teacher_ce", "teacher_accuracy"}
    assert all(keys <= r.keys() for r in steps)
    # forward KL, alpha 0: the loss is the divergence
    assert all(r["loss"] == pytest.approx(r["divergence"], rel=1e-6) for r in steps)
    evals = evals_of(run)
    assert [r["step"] for r in evals] == [0, 3, 6]
    # the teacher is frozen: its held-out numbers never move; the student comes closer to it
    assert len({r["eval_teacher_ce"] for r in evals}) == 1
    assert len({r["eval_teacher_accuracy"] for r in evals}) == 1
    assert evals[-1]["eval_divergence"] < 0.8 * evals[0]["eval_divergence"]
    assert (run / "final" / "config.json").is_file()


def test_a_student_equal_to_its_teacher_starts_at_divergence_zero(tmp_path: Path):
    """The student loaded from the teacher's own folder: at the first step every token's divergence is
    0 (whatever the loss), and the student's cross-entropy is the teacher's."""
    teacher = save_tiny_model(tmp_path / "teacher", seed=1)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        path = write_distill_recipe(tmp_path / loss, teacher=teacher, objective={"loss": loss, "temperature": 2.0},
                                    model={"name_or_path": str(teacher), "config": None, "tokenizer": None},
                                    train={"max_steps": 1})
        train_here(path)
        first = steps_of(tmp_path / loss / "run")[0]
        assert abs(first["divergence"]) < 1e-6, (loss, first)
        assert first["ce"] == pytest.approx(first["teacher_ce"], rel=1e-6)
        assert first["token_accuracy"] == first["teacher_accuracy"]


def test_alpha_one_trains_as_supervised_fine_tuning(tmp_path: Path):
    """With alpha 1 the loss is the student's cross-entropy alone: the same run as `sft`, step by step."""
    sft = write_recipe(tmp_path / "sft", model={"config": dict(STUDENT)}, train={"max_steps": 4})
    train_here(sft)
    distill = write_distill_recipe(tmp_path / "distill", objective={"alpha": 1.0}, train={"max_steps": 4})
    train_here(distill)
    expected, got = steps_of(tmp_path / "sft" / "run"), steps_of(tmp_path / "distill" / "run")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert [r["token_accuracy"] for r in got] == [r["token_accuracy"] for r in expected]


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_verify_loss_holds_for_distillation(tmp_path: Path, loss: str):
    path = write_distill_recipe(tmp_path, objective={"loss": loss, "temperature": 1.5, "alpha": 0.25})
    report = verify_loss(load_recipe(path), samples=6, modes=["token", "sequence"])
    ours = [c for c in report.cases if c.kind == "ligertune"]
    assert len(ours) == 8 and report.passed, [c for c in ours if not c.passed]
    naive = {(c.name, c.mode): c for c in report.cases if c.kind == "naive"}
    assert not naive[("no attention isolation", "token")].passed
    assert not naive[("mean per micro-batch, 6x1", "token")].passed


def test_a_lora_student_distils_and_resumes_to_the_bit(tmp_path: Path):
    teacher = save_tiny_model(tmp_path / "teacher", seed=1)
    student = save_tiny_model(tmp_path / "student", seed=2)
    path = write_distill_recipe(tmp_path, teacher=teacher, objective={"loss": "jsd"},
                                model={"name_or_path": str(student), "config": None, "tokenizer": None},
                                lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, optim={"lr": 1e-2})
    assert_resume_continues_the_run(path, tmp_path / "run", processes=1, steps=4, save_at=2,
                                    loss_rtol=0.0, grad_norm_rtol=0.0)
