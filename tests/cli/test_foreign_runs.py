"""`chat` and `merge` on run folders from elsewhere: code of the model's own runs only with
--trust-remote-code, and damaged weights are named in one line (exit 2), never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file
from tiny_recipe import write_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.recipe import load_recipe

runner = CliRunner()

NO_EVAL = {"max_steps": 1, "eval_every": None, "eval_at_start": False}
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}

# A module that a model folder maps its classes to: importing it writes MARKER (the code ran).
REMOTE_CODE = '''
from pathlib import Path

Path({marker!r}).write_text("ran")

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


class RemoteConfig(LlamaConfig):
    pass


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
'''
MODEL_MAP = {"AutoConfig": "remote.RemoteConfig", "AutoModelForCausalLM": "remote.RemoteForCausalLM"}
TOKENIZER_MAP = {"AutoTokenizer": [None, "remote.RemoteTokenizer"]}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *expected: str) -> None:
    assert result.exit_code == 2, result.output + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in result.output + result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A full fine-tune and a LoRA run of one step each."""
    from ligertune.training import train

    made = {}
    for kind, sections in (("full", {}), ("lora", {"lora": LORA})):
        folder = tmp_path_factory.mktemp(kind)
        recipe = write_recipe(folder, n_train=8, train=NO_EVAL, **sections)
        train(load_recipe(recipe), console=Console(quiet=True))
        made[kind] = folder / "run"
    return made


@pytest.fixture
def copy_run(runs, tmp_path):
    def copy(kind: str) -> Path:
        target = tmp_path / kind
        shutil.copytree(runs[kind], target)
        return target
    return copy


def add_remote_code(folder: Path, config_name: str, auto_map: dict, marker: Path) -> None:
    """Map `folder`'s Auto classes (in config.json or tokenizer_config.json) to remote.py beside it."""
    (folder / "remote.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    config = json.loads((folder / config_name).read_text())
    (folder / config_name).write_text(json.dumps({**config, "auto_map": auto_map}))


def set_recipe_trust(run: Path) -> None:
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["model"]["trust_remote_code"] = True
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """Code that transformers copies out of a model folder lands under tmp_path, and sys.path and
    sys.modules are left as they were."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(dynamic.TRANSFORMERS_DYNAMIC_MODULE_NAME):
            del sys.modules[name]


# --------------------------------------------------------------------------------------------------
# code of the model's own


def refused_everywhere(run: Path, *expected: str) -> None:
    """chat and merge refuse `run`, in one line naming the flag."""
    assert_one_line_error(invoke("chat", run, "-p", "hi", "-n", "2"), *expected, "--trust-remote-code")
    assert_one_line_error(invoke("merge", run, "-o", run.parent / "merged"), *expected, "--trust-remote-code")


def test_a_model_config_that_maps_to_code_is_refused_then_run_with_the_flag(copy_run, tmp_path, modules_cache):
    run, marker = copy_run("full"), tmp_path / "marker"
    add_remote_code(run / "final", "config.json", MODEL_MAP, marker)
    result = invoke("chat", run, "-p", "hi", "-n", "2")
    assert_one_line_error(result, f"{run / 'final' / 'config.json'}: its auto_map names code of its own (remote.py)",
                          "refused. Pass --trust-remote-code")
    assert not marker.exists()

    result = invoke("chat", run, "-p", "hi", "-n", "2", "--trust-remote-code")
    assert result.exit_code == 0, result.output + result.stderr
    assert marker.read_text() == "ran"  # the person at the command line asked for it


def test_a_tokenizer_that_maps_to_code_is_refused_then_run_with_the_flag(copy_run, tmp_path, modules_cache):
    run, marker = copy_run("lora"), tmp_path / "marker"
    add_remote_code(run / "final", "tokenizer_config.json", TOKENIZER_MAP, marker)
    refused_everywhere(run, f"{run / 'final' / 'tokenizer_config.json'}: its auto_map names code of its own")
    assert not marker.exists()

    result = invoke("merge", run, "-o", tmp_path / "merged", "--trust-remote-code")
    assert result.exit_code == 0, result.output + result.stderr
    assert marker.read_text() == "ran"


def test_a_run_recipe_never_turns_trust_on(copy_run):
    full, lora = copy_run("full"), copy_run("lora")
    set_recipe_trust(full)
    assert_one_line_error(invoke("chat", full, "-p", "hi"), f"{full / 'recipe.yaml'}: model.trust_remote_code is "
                          "true", "--trust-remote-code")
    set_recipe_trust(lora)
    refused_everywhere(lora, f"{lora / 'recipe.yaml'}: model.trust_remote_code is true")
    # With the flag the run loads: trust is the command line's to give, and here it was given.
    result = invoke("chat", lora, "-p", "hi", "-n", "2", "--trust-remote-code")
    assert result.exit_code == 0, result.output + result.stderr


def test_the_base_model_named_by_bare_adapters_is_checked_too(runs, copy_run, tmp_path):
    base, marker = copy_run("full") / "final", tmp_path / "marker"
    add_remote_code(base, "config.json", MODEL_MAP, marker)
    adapters = tmp_path / "adapters"  # a peft folder alone: its base is its adapter_config.json's
    shutil.copytree(runs["lora"] / "final", adapters)
    config = json.loads((adapters / "adapter_config.json").read_text())
    (adapters / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    result = invoke("chat", adapters, "-p", "hi", "-n", "2")
    assert_one_line_error(result, f"{base / 'config.json'}: its auto_map names code of its own")
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# damaged weights


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("damage, cause", [(truncate, "damaged: truncated"), (empty, "damaged: the file is empty"),
                                           (garbage, "damaged or not a safetensors file")], ids=["truncated", "empty", "garbage"])
@pytest.mark.parametrize("command, kind, weights", [
    ("chat", "full", "model.safetensors"),
    ("chat", "lora", "adapter_model.safetensors"),
    ("merge", "lora", "adapter_model.safetensors"),
], ids=["chat-full", "chat-lora", "merge-lora"])
def test_damaged_weights_are_named(copy_run, command, kind, weights, damage, cause):
    run = copy_run(kind)
    damage(run / "final" / weights)
    args = ["-p", "hi"] if command == "chat" else ["-o", run / "merged"]
    assert_one_line_error(invoke(command, run, *args), f"{run / 'final' / weights}: {cause}")
    assert not (run / "merged").exists()


class Payload:
    def __reduce__(self):
        return (print, ("this would run",))


@pytest.mark.parametrize("command", ["chat", "merge"])
def test_pickled_adapters_are_refused_and_whole_ones_load(copy_run, command):
    """Adapters saved with torch.save (adapter_model.bin) load as weights only."""
    run = copy_run("lora")
    final = run / "final"
    torch.save(load_file(final / "adapter_model.safetensors"), final / "adapter_model.bin")
    (final / "adapter_model.safetensors").unlink()
    args = ["-p", "hi", "-n", "2"] if command == "chat" else ["-o", run / "merged"]
    result = invoke(command, run, *args)
    assert result.exit_code == 0, result.output + result.stderr

    torch.save({"weights": Payload()}, final / "adapter_model.bin")
    assert_one_line_error(invoke(command, run, *args), f"{final / 'adapter_model.bin'}: refused: it holds Python "
                          "objects beyond tensors")


def test_damaged_weights_of_the_base_of_bare_adapters(runs, copy_run, tmp_path):
    base = copy_run("full") / "final"
    truncate(base / "model.safetensors")
    adapters = tmp_path / "adapters"
    shutil.copytree(runs["lora"] / "final", adapters)
    config = json.loads((adapters / "adapter_config.json").read_text())
    (adapters / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    assert_one_line_error(invoke("merge", adapters, "-o", tmp_path / "merged"),
                          f"{base / 'model.safetensors'}: damaged: truncated")
