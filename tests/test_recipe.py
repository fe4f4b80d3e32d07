"""The recipe schema: every problem reported with its key path, overrides, path resolution."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ligertune.errors import RecipeError
from ligertune.recipe import (
    Recipe,
    apply_overrides,
    bundled_recipes,
    field_docs,
    load_recipe,
    recipe_from_dict,
)

MINIMAL = {"model": {"config": "llama-tiny"}, "data": {"path": "train.jsonl"}}


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    return info.value.problems


def test_minimal_recipe_gets_defaults():
    recipe = recipe_from_dict(MINIMAL)
    assert recipe.loss.normalization == "token"
    assert recipe.optim.betas == [0.9, 0.999]
    assert recipe.lora is None
    assert recipe.data.max_seq_len == 2048


def test_every_problem_is_collected_with_its_key_path():
    raw = {
        "model": {"config": "llama-tiny", "dtyp": "float32"},
        "data": {"path": "x.jsonl", "max_seq_len": "long"},
        "optim": {"lr": -1, "schedule": "cosin"},
        "lora": {"r": 0},
        "trian": {},
    }
    problems = problems_of(raw)
    assert "model.dtyp: unknown key; did you mean `dtype`?" in problems
    assert "data.max_seq_len: expected an integer, got 'long'" in problems
    assert "optim.schedule: must be one of cosine, linear, constant, got 'cosin'; did you mean `cosine`?" in problems
    assert "trian: unknown key; did you mean `train`?" in problems


def test_value_checks_run_when_types_are_right():
    problems = problems_of({**MINIMAL, "optim": {"lr": -1, "betas": [0.9]}, "lora": {"r": 0}})
    assert "optim.lr: must be > 0, got -1.0" in problems
    assert "optim.betas: must be two numbers in [0, 1), got [0.9]" in problems
    assert "lora.r: must be in [1, 65536], got 0" in problems


@pytest.mark.parametrize(
    "raw, expected",
    [
        pytest.param({"data": {"path": "x"}}, "model: give exactly one of", id="no-model"),
        pytest.param({"model": {"config": "x"}, "data": {}}, "data: give exactly one of", id="no-data"),
        pytest.param({**MINIMAL, "loss": {"label_smoothing": 1.5}}, "loss.label_smoothing: must be in [0, 1)",
                     id="smoothing"),
        pytest.param({**MINIMAL, "model": {"config": "x", "attention": "sdpa"}}, "data.packing: packing needs",
                     id="packing-attention"),
        pytest.param({"model": {"config": "x"}, "data": {"sources": [{"path": "a", "weight": 1, "samples": 3}]}},
                     "data.sources[0]: give `weight` or `samples`, not both", id="source-share"),
        pytest.param({"model": {"config": "x"}, "data": {"sources": [{"weight": 1}]}}, "data.sources[0].path: required",
                     id="source-path"),
        pytest.param({**MINIMAL, "train": {"micro_batch_size": 0}}, "train.micro_batch_size: must be >= 1",
                     id="micro-batch"),
        pytest.param({**MINIMAL, "train": True}, "train: expected a mapping, got true", id="section-type"),
        pytest.param({**MINIMAL, "optim": {"name": "lio"}}, "optim.name: must be one of adamw, lion, got 'lio'; "
                     "did you mean `lion`?", id="optimizer-name"),
        pytest.param({**MINIMAL, "optim": {"clip": "tensor"}}, "optim.clip: must be one of global, per_tensor",
                     id="clip-mode"),
        pytest.param({**MINIMAL, "train": {"spike_threshold": 0}}, "train.spike_threshold: must be > 0 or null",
                     id="spike-threshold"),
        pytest.param({**MINIMAL, "train": {"spike_window": 2}}, "train.spike_window: must be >= 3", id="spike-window"),
        pytest.param({**MINIMAL, "train": {"on_spike": "drop"}}, "train.on_spike: must be one of log, skip",
                     id="on-spike"),
    ],
)
def test_problem_messages(raw, expected):
    assert any(p.startswith(expected) for p in problems_of(raw)), problems_of(raw)


def test_betas_default_to_the_optimizer_s_own():
    """AdamW's (torch's) and Lion's (the paper's), written into the recipe as loaded; given ones stay."""
    assert recipe_from_dict(MINIMAL).optim.betas == [0.9, 0.999]
    assert recipe_from_dict({**MINIMAL, "optim": {"name": "lion"}}).optim.betas == [0.9, 0.99]
    lion = recipe_from_dict({**MINIMAL, "optim": {"name": "lion", "betas": [0.95, 0.98]}})
    assert lion.optim.betas == [0.95, 0.98]
    assert recipe_from_dict(lion.to_dict()).optim.betas == [0.95, 0.98]


def test_overrides_parse_values_as_yaml():
    raw = apply_overrides(MINIMAL, ["optim.lr=1e-4", "lora.r=8", "train.gradient_checkpointing=true",
                                    "data.sources=[{path: a}]"])
    assert raw["optim"]["lr"] == "1e-4"  # YAML 1.1 reads it as a string; the schema converts it
    assert raw["lora"] == {"r": 8}
    assert raw["train"]["gradient_checkpointing"] is True
    assert MINIMAL["model"] == {"config": "llama-tiny"}  # the input is not modified
    recipe = recipe_from_dict({**raw, "data": {"path": "x"}})
    assert recipe.optim.lr == pytest.approx(1e-4)
    assert recipe.lora is not None and recipe.lora.r == 8


def test_override_without_equals_is_reported():
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        apply_overrides(MINIMAL, ["optim.lr"])


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  config: x\ndata: [unclosed\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"{path}: YAML syntax error at line 4, column 1")


def test_missing_recipe_file(tmp_path: Path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_relative_paths_resolve_next_to_the_recipe(tmp_path: Path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent("""
        model: {name_or_path: org/some-model}
        data: {path: data/train.jsonl}
    """))
    monkeypatch.chdir("/")
    recipe = load_recipe(path)
    assert recipe.data.path == str(tmp_path / "data" / "train.jsonl")
    assert recipe.model.name_or_path == "org/some-model"  # not a local path: kept as a hub id


def test_a_data_pattern_resolves_next_to_the_recipe_when_it_matches_there(tmp_path: Path, monkeypatch):
    (tmp_path / "train-0.jsonl").write_text("")
    path = tmp_path / "r.yaml"
    path.write_text("model: {name_or_path: org/some-model}\n"
                    "data: {path: train-*.jsonl, eval_path: held-*.jsonl}\n")
    monkeypatch.chdir("/")
    recipe = load_recipe(path)
    assert recipe.data.path == str(tmp_path / "train-*.jsonl")
    assert recipe.data.eval_path == "held-*.jsonl"  # matches nothing there: relative to where it runs


def test_every_field_is_documented():
    undocumented = [key for key, _, _, doc in field_docs(Recipe) if not doc]
    assert undocumented == []


def test_bundled_recipes_are_found_recursively():
    names = bundled_recipes()
    assert "quickstart" in names
    assert all(p.suffix == ".yaml" for p in names.values())


def test_recipe_reference_doc_is_up_to_date():
    from ligertune.recipe import reference_markdown

    doc = Path(__file__).resolve().parent.parent / "docs" / "recipe.md"
    assert doc.read_text(encoding="utf-8") == reference_markdown(), "run: python -m ligertune.recipe > docs/recipe.md"
