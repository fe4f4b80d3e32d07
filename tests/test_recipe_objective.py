"""The recipe's `objective` section: defaults per objective, each field's checks, every conflict with
the data's format, old checkpoints without the section, and the one refusal of an objective the
trainer does not run yet."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tiny_recipe import write_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.errors import RecipeError, UserError
from ligertune.objectives import SFT, Preference, build_objective
from ligertune.recipe import ObjectiveConfig, Recipe, check_objective_data, load_recipe, recipe_from_dict
from ligertune.training.resume import check_resumable

MINIMAL = {"model": {"config": "llama-tiny"}, "data": {"path": "train.jsonl"}}
PAIRED = {"path": "train.jsonl", "format": "paired"}
UNPAIRED = {"path": "train.jsonl", "format": "unpaired"}


def recipe_with(objective: dict | None = None, data: dict | None = None) -> Recipe:
    raw = {**MINIMAL, "data": data or MINIMAL["data"]}
    if objective is not None:
        raw["objective"] = objective
    return recipe_from_dict(raw)


def problems_of(objective: dict | None = None, data: dict | None = None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_with(objective, data)
    return info.value.problems


# --------------------------------------------------------------------------------------------------
# Defaults


def test_a_recipe_without_the_section_is_sft_with_nothing_else_set():
    recipe = recipe_with()
    assert recipe.objective == ObjectiveConfig()
    assert dataclasses.asdict(recipe.objective) == {
        "name": "sft", "beta": None, "label_smoothing": 0.0, "gamma": None, "orpo_lambda": None,
        "desirable_weight": 1.0, "undesirable_weight": 1.0, "reference": "auto", "teacher": None,
        "loss": "forward_kl", "temperature": 1.0, "alpha": 0.0, "teacher_quantization": None,
        "heads": 4, "head_layers": 1, "head_weights": None, "backbone": "frozen", "lm_weight": 1.0,
    }
    assert not recipe.objective.preference and not recipe.objective.uses_reference
    # Writing the section with its defaults, or not at all, is one recipe.
    assert recipe.to_dict() == recipe_with({}).to_dict() == recipe_with({"name": "sft"}).to_dict()


def test_a_recipe_without_the_section_keeps_every_other_key_and_trains_sft():
    recipe = recipe_with()
    before = {f.name for f in dataclasses.fields(Recipe)} - {"objective"}
    assert set(recipe.to_dict()) - {"objective"} == before
    objective = build_objective(recipe)
    assert isinstance(objective, SFT)


@pytest.mark.parametrize(
    "name, beta, gamma, orpo_lambda, uses_reference",
    [
        pytest.param("dpo", 0.1, None, None, True, id="dpo"),
        pytest.param("ipo", 0.1, None, None, True, id="ipo"),
        pytest.param("kto", 0.1, None, None, True, id="kto"),
        pytest.param("simpo", 2.0, 1.0, None, False, id="simpo"),
        pytest.param("orpo", None, None, 0.1, False, id="orpo"),
    ],
)
def test_each_preference_objective_gets_its_own_defaults(name, beta, gamma, orpo_lambda, uses_reference):
    data = UNPAIRED if name == "kto" else PAIRED
    objective = recipe_with({"name": name}, data).objective
    assert (objective.beta, objective.gamma, objective.orpo_lambda) == (beta, gamma, orpo_lambda)
    assert objective.label_smoothing == 0.0
    assert (objective.desirable_weight, objective.undesirable_weight) == (1.0, 1.0)
    assert objective.reference == "auto" and objective.uses_reference is uses_reference
    assert objective.preference


def test_given_values_are_kept_and_the_filled_defaults_are_what_a_resumed_run_compares():
    objective = recipe_with({"name": "simpo", "beta": 2.5, "gamma": 1.4}, PAIRED).objective
    assert (objective.beta, objective.gamma) == (2.5, 1.4)
    saved = recipe_with({"name": "dpo"}, PAIRED).to_dict()["objective"]
    assert saved["beta"] == 0.1  # written out, so a later change of the default cannot pass unseen


def test_every_setting_of_dpo_at_once():
    objective = recipe_with({"name": "dpo", "beta": 0.3, "label_smoothing": 0.2, "reference": "live"},
                            PAIRED).objective
    assert (objective.beta, objective.label_smoothing, objective.reference) == (0.3, 0.2, "live")
    kto = recipe_with({"name": "kto", "desirable_weight": 1.33, "undesirable_weight": 0.5}, PAIRED).objective
    assert (kto.desirable_weight, kto.undesirable_weight) == (1.33, 0.5)


# --------------------------------------------------------------------------------------------------
# Each field's checks


@pytest.mark.parametrize(
    "objective, expected",
    [
        ({"name": "dpo", "beta": 0}, "objective.beta: must be > 0, got 0.0"),
        ({"name": "kto", "beta": -0.1}, "objective.beta: must be > 0, got -0.1"),
        ({"name": "simpo", "beta": 0}, "objective.beta: must be > 0, got 0.0"),
        ({"name": "dpo", "label_smoothing": 0.5}, "objective.label_smoothing: must be in [0, 0.5), got 0.5"),
        ({"name": "dpo", "label_smoothing": -0.1}, "objective.label_smoothing: must be in [0, 0.5), got -0.1"),
        ({"name": "simpo", "gamma": -1}, "objective.gamma: must be >= 0, got -1.0"),
        ({"name": "orpo", "orpo_lambda": 0}, "objective.orpo_lambda: must be > 0, got 0.0"),
        ({"name": "kto", "desirable_weight": 0}, "objective.desirable_weight: must be > 0, got 0.0"),
        ({"name": "kto", "undesirable_weight": -2}, "objective.undesirable_weight: must be > 0, got -2.0"),
        ({"name": "dpo", "reference": "none"}, "objective.reference: dpo measures its reward against a reference"),
        ({"name": "ipo", "reference": "none"}, "objective.reference: ipo measures its reward against a reference"),
        ({"name": "kto", "reference": "none"}, "objective.reference: kto measures its reward against a reference"),
        ({"name": "simpo", "reference": "live"}, "objective.reference: simpo is reference-free"),
        ({"name": "orpo", "reference": "precomputed"}, "objective.reference: orpo is reference-free"),
        ({"name": "dp"}, "objective.name: must be one of sft, dpo, ipo, simpo, orpo, kto, distill, medusa, got 'dp'; "
                         "did you mean `dpo`?"),
        ({"name": "dpo", "beta": "high"}, "objective.beta: expected a number, got 'high'"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None,
)
def test_out_of_range_values_name_their_key(objective, expected):
    data = UNPAIRED if objective.get("name") == "kto" else PAIRED
    problems = problems_of(objective, data)
    assert any(p.startswith(expected) for p in problems), problems


def test_the_edges_of_each_range_are_accepted():
    assert recipe_with({"name": "dpo", "label_smoothing": 0.49}, PAIRED).objective.label_smoothing == 0.49
    assert recipe_with({"name": "simpo", "gamma": 0}, PAIRED).objective.gamma == 0.0
    assert recipe_with({"name": "dpo", "reference": "auto"}, PAIRED).objective.uses_reference
    assert not recipe_with({"name": "orpo", "reference": "none"}, PAIRED).objective.uses_reference


@pytest.mark.parametrize(
    "objective, key, readers",
    [
        ({"name": "dpo", "gamma": 0.5}, "gamma", "simpo only, and objective.name is dpo"),
        ({"name": "ipo", "label_smoothing": 0.1}, "label_smoothing", "dpo only, and objective.name is ipo"),
        ({"name": "simpo", "label_smoothing": 0.1}, "label_smoothing", "dpo only, and objective.name is simpo"),
        ({"name": "dpo", "orpo_lambda": 0.2}, "orpo_lambda", "orpo only, and objective.name is dpo"),
        ({"name": "orpo", "beta": 0.1}, "beta", "dpo, ipo, simpo, kto and distill only, and objective.name is orpo: "
                                                 "remove it (orpo's weight is `orpo_lambda`)"),
        ({"name": "dpo", "desirable_weight": 2.0}, "desirable_weight", "kto only, and objective.name is dpo"),
        ({"name": "simpo", "undesirable_weight": 0.5}, "undesirable_weight", "kto only, and objective.name is simpo"),
        ({"beta": 0.1}, "beta", "dpo, ipo, simpo, kto and distill only, and objective.name is sft"),
        ({"reference": "live"}, "reference", "dpo, ipo, simpo, orpo and kto only, and objective.name is sft"),
        ({"reference": "none"}, "reference", "dpo, ipo, simpo, orpo and kto only, and objective.name is sft"),
        ({"label_smoothing": 0.1}, "label_smoothing", "dpo only, and objective.name is sft"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None,
)
def test_a_key_the_objective_does_not_read_is_refused_when_set(objective, key, readers):
    data = MINIMAL["data"] if "name" not in objective else (UNPAIRED if objective["name"] == "kto" else PAIRED)
    problems = problems_of(objective, data)
    assert f"objective.{key}: applies to {readers}" in " ".join(problems), problems


def test_a_key_the_objective_does_not_read_passes_at_its_default():
    """Leaving `desirable_weight: 1.0` in a recipe switched from kto to dpo is no problem: it says nothing."""
    objective = recipe_with({"name": "dpo", "desirable_weight": 1.0, "label_smoothing": 0.0, "gamma": None},
                            PAIRED).objective
    assert objective.name == "dpo" and objective.gamma is None


def test_every_problem_of_the_section_is_reported_at_once():
    problems = problems_of({"name": "dpo", "beta": -1, "gamma": 1.0, "reference": "none"}, PAIRED)
    keys = sorted(p.split(":", 1)[0] for p in problems)
    assert keys == ["objective.beta", "objective.gamma", "objective.reference"], problems


# --------------------------------------------------------------------------------------------------
# The objective and the data's format


@pytest.mark.parametrize("fmt", ["paired", "paired_conversations", "unpaired"])
def test_sft_refuses_preference_data(fmt):
    problems = problems_of(None, {"path": "train.jsonl", "format": fmt})
    assert problems == [f"data.format: {fmt} is preference data, which objective.name sft does not read: use a "
                        "chat format (messages, sharegpt, prompt_completion), or a preference objective "
                        "(objective.name: dpo, ipo, simpo, orpo, kto)"]


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo", "kto"])
@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "prompt_completion"])
def test_a_preference_objective_refuses_chat_data(name, fmt):
    problems = problems_of({"name": name}, {"path": "train.jsonl", "format": fmt})
    assert len(problems) == 1 and problems[0].startswith(
        f"data.format: {fmt} is chat data for supervised fine-tuning; objective.name {name} reads preference data"
    ), problems
    expected = "paired, paired_conversations or unpaired" if name == "kto" else "paired or paired_conversations"
    assert f"use {expected}, or objective.name: sft" in problems[0]


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_a_paired_objective_refuses_unpaired_data(name):
    problems = problems_of({"name": name}, UNPAIRED)
    assert problems == [f"data.format: unpaired answers (one answer with a label) cannot train {name}, which "
                        "compares a chosen with a rejected answer: use paired data, or objective.name: kto"]


@pytest.mark.parametrize("fmt", ["paired", "paired_conversations", "unpaired", "auto"])
def test_kto_reads_pairs_and_unpaired_answers(fmt):
    assert recipe_with({"name": "kto"}, {"path": "train.jsonl", "format": fmt}).objective.name == "kto"


@pytest.mark.parametrize("name", ["sft", "dpo", "ipo", "simpo", "orpo", "kto"])
def test_auto_is_left_to_the_data(name):
    assert recipe_with({"name": name}, {"path": "train.jsonl"}).data.format == "auto"


def test_each_source_format_is_checked_with_its_index():
    data = {"sources": [{"path": "a.jsonl", "format": "paired"}, {"path": "b.jsonl", "format": "messages"},
                        {"path": "c.jsonl", "format": "unpaired"}], "format": "paired"}
    problems = problems_of({"name": "dpo"}, data)
    assert [p.split(":", 1)[0] for p in problems] == ["data.sources[1].format", "data.sources[2].format"], problems
    # A source in `auto` follows `data.format`.
    data = {"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "format": "paired"}], "format": "messages"}
    problems = problems_of(None, data)
    assert [p.split(":", 1)[0] for p in problems] == ["data.sources[1].format"], problems


@pytest.mark.parametrize(
    "name, detected, expected",
    [
        ("sft", "paired", "data: the records are paired is preference data, which objective.name sft does not read"),
        ("sft", "unpaired", "data: the records are unpaired is preference data"),
        ("dpo", "messages", "data: the records are messages is chat data for supervised fine-tuning; "
                            "objective.name dpo reads preference data"),
        ("orpo", "unpaired", "data: the records are unpaired answers (one answer with a label) cannot train orpo"),
    ],
)
def test_check_objective_data_refuses_what_detection_found_in_one_line(name, detected, expected):
    objective = ObjectiveConfig(name=name)
    with pytest.raises(UserError) as info:
        check_objective_data(objective, detected)
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message, message


def test_check_objective_data_names_the_source_and_passes_what_fits():
    with pytest.raises(UserError, match=r"^data\.sources\[1\]: the records are sharegpt is chat data"):
        check_objective_data(ObjectiveConfig(name="kto"), "sharegpt", where="data.sources[1]")
    for name, fmt in [("sft", "messages"), ("sft", "sharegpt"), ("sft", "prompt_completion"), ("dpo", "paired"),
                      ("simpo", "paired_conversations"), ("kto", "paired"), ("kto", "unpaired")]:
        check_objective_data(ObjectiveConfig(name=name), fmt)


# --------------------------------------------------------------------------------------------------
# Resuming a checkpoint saved before the section existed


def test_a_checkpoint_saved_before_the_section_resumes(tmp_path: Path):
    recipe = recipe_with()
    old = recipe.to_dict()
    del old["objective"]
    check_resumable({"recipe": old}, recipe, tmp_path / "checkpoint-3")


def test_a_checkpoint_without_the_section_was_sft(tmp_path: Path):
    old = recipe_with().to_dict()
    del old["objective"]
    recipe = recipe_with({"name": "dpo"}, PAIRED)
    with pytest.raises(UserError) as info:
        check_resumable({"recipe": {**old, "data": recipe.to_dict()["data"]}}, recipe, tmp_path / "checkpoint-3")
    message = str(info.value)
    assert "objective.name ('sft' -> 'dpo')" in message and "objective.beta (None -> 0.1)" in message, message


def test_a_changed_objective_setting_stops_a_resume(tmp_path: Path):
    saved = recipe_with({"name": "dpo"}, PAIRED).to_dict()
    recipe = recipe_with({"name": "dpo", "beta": 0.2}, PAIRED)
    with pytest.raises(UserError, match=r"objective\.beta \(0\.1 -> 0\.2\)"):
        check_resumable({"recipe": saved}, recipe, tmp_path / "checkpoint-3")


# --------------------------------------------------------------------------------------------------
# What the trainer builds, and what it refuses


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_build_objective_maps_the_section_onto_the_preference_objective(name):
    section = {"name": name, **{"dpo": {"beta": 0.3, "label_smoothing": 0.1}, "ipo": {"beta": 0.2},
                                "simpo": {"beta": 2.5, "gamma": 0.7}, "orpo": {"orpo_lambda": 0.4},
                                "kto": {"beta": 0.3, "desirable_weight": 1.2,
                                        "undesirable_weight": 0.8}}[name]}
    objective = build_objective(recipe_with(section, PAIRED))
    assert isinstance(objective, Preference)
    cfg = objective.cfg
    assert cfg.loss == name
    for key, value in section.items():
        if key != "name":
            assert getattr(cfg, key) == value, key


@pytest.mark.parametrize("command", ["validate", "train", "verify-loss"])
def test_commands_refuse_chat_data_for_a_preference_objective(tmp_path: Path, command: str):
    """The recipe is valid (its data file holds chat records): reading them as pairs fails in one line
    that names the file and line, before a run folder is written."""
    path = write_recipe(tmp_path, n_train=4, n_eval=2)
    overrides = ["--set", "objective.name=dpo", "--set", "data.format=paired"]
    load_recipe(path, overrides[1::2])  # the recipe itself is valid
    result = CliRunner().invoke(app, [command, str(path), *overrides])
    assert result.exit_code == 2, result.output
    expected = "train.jsonl:1:"
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
