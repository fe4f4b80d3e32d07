"""The command line through typer's CliRunner: help, validate, recipes, env, and one test per error class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_recipe import save_tiny_model, write_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.recipe import bundled_recipes
from ligertune.recipe.catalogue import bundled_recipe_writing

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *expected: str) -> None:
    """Exit code 2, the messages on stderr as `error:` lines, and no traceback."""
    assert result.exit_code == 2, result.output
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    "command",
    [["train"], ["validate"], ["data"], ["verify-loss"], ["env"], ["recipes", "ls"], ["recipes", "cp"],
     ["bench", "kernels"], ["bench", "step"]],
    ids=lambda c: "-".join(c),
)
def test_help_shows_an_example(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Example" in result.output


def test_validate_a_good_recipe(tiny_recipe: Path):
    result = invoke("validate", tiny_recipe)
    assert result.exit_code == 0, result.output
    assert "48 train and 8 eval conversations" in result.output


def test_validate_warns_of_the_epsilon_trap_and_a_lion_lr_naming_the_keys(tiny_recipe: Path):
    """Warnings leave the exit code 0; each names its key. With master weights (the default) a bf16
    recipe gets none."""
    bf16 = ("--set", "model.dtype=bfloat16")
    result = invoke("validate", tiny_recipe, *bf16, "--set", "optim.master_weights=false")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "warning optim.eps: 1e-08 with bfloat16 AdamW moments" in text
    assert "warning optim.master_weights: false with bfloat16" in text
    result = invoke("validate", tiny_recipe, *bf16, "--set", "optim.name=lion", "--set", "optim.lr=2e-5")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "warning optim.lr: 2e-05 looks AdamW-sized for Lion" in text and "optim.eps" not in text
    assert "warning" not in invoke("validate", tiny_recipe, *bf16).output


def test_validate_reports_every_schema_problem_with_its_key(tiny_recipe: Path):
    result = invoke("validate", tiny_recipe, "--set", "optim.lr=-1", "--set", "model.dtyp=bf16",
                    "--set", "loss.normalization=tokens")
    assert_user_error(
        result,
        "--set optim.lr=-1: must be > 0, got -1.0",
        "--set model.dtyp=bf16: unknown key; did you mean `dtype`?",
        "--set loss.normalization=tokens: must be one of token, sequence, sum, got 'tokens'; "
        "did you mean `token`?",
    )


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  config: llama-tiny\n  dtype: [bf16\n")
    assert_user_error(invoke("validate", path), f"{path}: YAML syntax error at line")


def test_missing_recipe_file(tmp_path: Path):
    assert_user_error(invoke("train", tmp_path / "absent.yaml"), "absent.yaml: recipe file not found")


def test_missing_data_file_names_the_path(tmp_path: Path):
    path = write_recipe(tmp_path, data={"path": "nowhere.jsonl"})
    assert_user_error(invoke("validate", path), "nowhere.jsonl")


def test_malformed_data_names_file_and_line(tmp_path: Path):
    path = write_recipe(tmp_path)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    lines[4] = '{"messages": [{"role": "robot", "content": "hi"}]}'
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    assert_user_error(invoke("validate", path), "train.jsonl:5:", "robot")


def test_missing_tokenizer_names_the_path(tmp_path: Path):
    path = write_recipe(tmp_path, model={"tokenizer": str(tmp_path / "no-tokenizer")})
    assert_user_error(invoke("validate", path), "no-tokenizer")


def test_debug_shows_the_traceback(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("LIGERTUNE_DEBUG", "0")  # restored after the test: --debug sets it for the process
    result = invoke("--debug", "validate", tmp_path / "absent.yaml")
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "RecipeError"


def test_recipes_ls_show_cp(tmp_path: Path):
    listed = invoke("recipes", "ls")
    assert listed.exit_code == 0 and "quickstart" in listed.output
    shown = invoke("recipes", "show", "quickstart")
    assert shown.exit_code == 0 and "ligertune train recipes/quickstart.yaml" in shown.output
    target = tmp_path / "mine.yaml"
    assert invoke("recipes", "cp", "quickstart", target).exit_code == 0
    assert target.read_text() == bundled_recipes()["quickstart"].read_text()
    assert_user_error(invoke("recipes", "cp", "quickstart", target), "exists; pass --force")
    assert_user_error(invoke("recipes", "show", "quikstart"), "did you mean `quickstart`?")


def test_recipes_cp_creates_folders_and_replaces_only_with_force(tmp_path: Path):
    bundled = bundled_recipes()["quickstart"].read_text()
    target = tmp_path / "new" / "dir" / "x.yaml"
    assert invoke("recipes", "cp", "quickstart", target).exit_code == 0
    assert target.read_text() == bundled
    target.write_text("edited")
    assert_user_error(invoke("recipes", "cp", "quickstart", target), f"{target} exists; pass --force")
    assert target.read_text() == "edited"
    assert invoke("recipes", "cp", "quickstart", target, "--force").exit_code == 0
    assert target.read_text() == bundled
    # Into an existing folder, under the recipe's own file name.
    assert invoke("recipes", "cp", "bench/llama-3.2-1b", target.parent).exit_code == 0
    assert (target.parent / "llama-3.2-1b.yaml").read_text() == bundled_recipes()["bench/llama-3.2-1b"].read_text()
    # A file where a folder must be made: one line, exit 2.
    assert_user_error(invoke("recipes", "cp", "quickstart", target / "y.yaml"), "cannot write the copy")


def test_env_reports_versions_and_kernel_path(monkeypatch):
    monkeypatch.setenv("LIGERTUNE_KERNELS", "reference")
    result = invoke("env", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["kernel path"] == "reference"
    assert info["torch"] and info["device"].startswith(("cpu", "cuda"))
    assert "llama" in info["patched model types"].split(", ")


@pytest.mark.parametrize("name", sorted(bundled_recipes()))
def test_every_bundled_recipe_validates(name: str, tmp_path: Path, monkeypatch):
    """From a fresh folder, as on a clean clone: a recipe that starts from another's run
    (quickstart-dpo from runs/quickstart/final) finds a tiny stand-in there; without one, the error
    names the command that makes it."""
    path = bundled_recipes()[name]
    monkeypatch.chdir(tmp_path)  # output.dir, and a model of an earlier run, are relative to here
    model = (yaml.safe_load(path.read_text()).get("model") or {}).get("name_or_path")
    if model is not None and Path(model).name == "final":
        maker = bundled_recipe_writing(Path(model).parent)
        assert maker is not None, f"{name} starts from {model}, which no bundled recipe writes"
        assert_user_error(invoke("validate", path), f"no such folder: {model}",
                          f"(the model `ligertune train {maker}` leaves: run that first)")
        save_tiny_model(tmp_path / model)
    result = invoke("validate", path)
    assert result.exit_code == 0, result.output + result.stderr
    # It opens with its exact command and an override example.
    first = path.read_text().splitlines()[:3]
    assert first[0].startswith("# ligertune ") and f"recipes/{name}.yaml" in first[0]
    assert any("--set" in line for line in first if line.startswith("# ligertune "))


def test_validate_refuses_what_train_would_refuse(tmp_path):
    """LoRA targets the model lacks, a model folder without weights, an output folder holding a run."""
    from tiny_recipe import QUICKSTART, write_recipe
    from typer.testing import CliRunner

    from ligertune.cli.main import app

    path = write_recipe(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(path), "--set", "lora.target_modules=[nope]"])
    assert result.exit_code == 2 and "lora" in result.output and "nope" in result.output
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "llama", "vocab_size": 300}')
    result = runner.invoke(app, ["validate", str(path), "--set", f"model.name_or_path={empty}",
                                 "--set", "model.config=null", "--set", f"model.tokenizer={QUICKSTART / 'tokenizer'}"])
    assert result.exit_code == 2 and "holds no model weights" in result.output
    (tmp_path / "run" / "final").mkdir(parents=True)
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "already holds a finished run" in result.output


def test_train_and_validate_say_what_the_data_lost_before_the_first_step(tmp_path: Path):
    """Skipped records, a held-out split left empty and a warmup cut to a short run are warnings
    printed before training, not silence."""
    path = write_recipe(tmp_path, n_train=1, n_eval=0, train={"max_steps": 1, "eval_every": 1},
                        data={"eval_path": None, "eval_fraction": 0.01, "on_bad_record": "skip"},
                        optim={"warmup_steps": 5})
    with (tmp_path / "train.jsonl").open("a", encoding="utf-8") as f:
        f.write("{not json\n")
    for command in (["validate", str(path)], ["train", str(path)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        out = "".join(result.output.split())  # the console wraps long lines, paths too

        def said(text: str) -> bool:
            return "".join(text.split()) in out

        assert said("data.on_bad_record: skipped 1 malformed record; the first: ")
        assert said("train.jsonl:2")
        assert said("data.eval_fraction: 0.01 held out no conversation")
        if command[0] == "train":
            assert said("optim.warmup_steps: 5 warmup steps is longer than the run (1 step")
