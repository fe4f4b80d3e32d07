"""Every mistake gets exit code 2 and one line naming its culprit; faults of the machine get exit 1.

One test per family of mistakes that once escaped (a traceback, a silent acceptance, a minute of
hub retries, a message that named the wrong thing), through the command line as a user meets it,
and last a property test: random mutations of a valid recipe never make `validate` crash.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_recipe import QUICKSTART, ROOT, write_recipe
from typer.testing import CliRunner

from ligertune import hub
from ligertune.cli.main import app
from ligertune.data import chat
from ligertune.recipe import bundled_recipes

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Offline, as every test is; the connectivity probe must not run unless a test stands in for it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LIGERTUNE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "500")  # rich wraps at the terminal width: keep each message on one line

    def probe():
        raise AssertionError("a test asked the network")

    monkeypatch.setattr(hub, "probe_hub", probe)


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, n_train=6, n_eval=2)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def error_line(result, code: int = 2) -> str:
    """The one `error:` line of a failed command, checked: exit code, nothing else on stderr, no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# --------------------------------------------------------------------------------------------------
# Numbers that pass the types and crash later


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        pytest.param("optim.lr=.nan", "--set optim.lr=.nan: must be a finite number, got nan", id="lr-nan"),
        pytest.param("train.epochs=.inf", "--set train.epochs=.inf: must be a finite number, got inf",
                     id="epochs-inf"),
        pytest.param("loss.z_loss_weight=-.inf", "--set loss.z_loss_weight=-.inf: must be a finite number",
                     id="negative-inf"),
        pytest.param("optim.lr=1e999", "--set optim.lr=1e999: must be a finite number, got '1e999'",
                     id="overflowing-string"),
        pytest.param("optim.betas=[0.9, .nan]",
                     "--set optim.betas=[0.9, .nan]: optim.betas[1]: must be a finite", id="list-item"),
        pytest.param("train.seed=99999999999999999999999", "--set train.seed=99999999999999999999999: out of "
                     "range: an integer must fit in 64 bits", id="seed-beyond-64-bits"),
        pytest.param("train.epochs=1e308", "--set train.epochs=1e308: must be in (0, 1e+06]",
                     id="epochs-huge"),
        pytest.param("lora.r=1000000000", "--set lora.r=1000000000: must be in [1, 65536]", id="lora-rank"),
        pytest.param("train.num_threads=1099511627776",
                     "--set train.num_threads=1099511627776: must be <= 4096", id="threads"),
        pytest.param("loss.ignore_index=7", "--set loss.ignore_index=7: must be -100", id="ignore-index"),
        pytest.param("data.sources=[{path: train.jsonl, samples: 1000000000000}]",
                     "data.sources[0].samples: must be in [1, 100,000,000]", id="samples"),
    ],
)
def test_out_of_range_numbers_are_refused_with_their_key(recipe, override, expected):
    overrides = ["--set", override] + (["--set", "data.path=null"] if "sources" in override else [])
    assert expected in error_line(invoke("validate", recipe, *overrides))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        pytest.param("model.config.num_attention_heads=6",
                     "model.config.num_attention_heads: 6 attention heads do not divide hidden_size 32",
                     id="heads"),
        pytest.param("model.config.num_key_value_heads=3",
                     "model.config.num_key_value_heads: 3 key/value heads do not divide "
                     "num_attention_heads 4",
                     id="kv-heads"),
        pytest.param("model.config.hidden_size=0",
                     "model.config.hidden_size: must be a positive integer, got 0", id="zero-size"),
        pytest.param("model.config.intermediate_size=abc",
                     "model.config.intermediate_size: must be a positive integer, got 'abc'",
                     id="non-numeric"),
        pytest.param("model.config.rope_theta=abc", "model.config.rope_theta: must be a number, got 'abc'",
                     id="non-numeric-float"),
        pytest.param("model.config.rms_norm_eps=.nan", "model.config.rms_norm_eps: must be a finite number",
                     id="nan"),
        pytest.param("model.config.num_hidden_layers=1000000000000",
                     "model.config.num_hidden_layers: must be at most 1000", id="layers"),
        pytest.param("model.config.head_dim=7",
                     "model.config: ValueError: RoPE requires an even rotary dimension",
                     id="transformers-refusal"),
        pytest.param("model.config.hidden_size=2147483640", "model.config: cannot build a llama model",
                     id="unbuildable"),
    ],
)
def test_inconsistent_model_config_is_named_by_validate(recipe, override, expected):
    assert expected in error_line(invoke("validate", recipe, "--set", override))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        pytest.param("train.epochs=.inf", "--set train.epochs=.inf: must be a finite number", id="number"),
        pytest.param("model.config.hidden_size=0",
                     "model.config.hidden_size: must be a positive integer, got 0", id="model-config"),
    ],
)
def test_train_refuses_bad_numbers_and_model_configs_before_it_starts(recipe, tmp_path, override, expected):
    assert expected in error_line(invoke("train", recipe, "-o", tmp_path / "run", "--set", override))


@pytest.mark.parametrize("command", ["validate", "train"])
def test_max_seq_len_beyond_the_model_positions(recipe, tmp_path, command):
    """Accepted silently once; now named with the limit from the model's own config (512 here)."""
    line = error_line(invoke(command, recipe, "--set", "data.max_seq_len=100000"))
    assert line == ("error: data.max_seq_len: 100000 is more than the model's 512 positions "
                    "(max_position_embeddings in its config); give at most 512")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------------
# Unreadable data files


def test_data_file_without_permission(recipe, tmp_path, monkeypatch):
    original = Path.open

    def refuse(self, *args, **kwargs):
        if self.name == "train.jsonl":
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    line = error_line(invoke("validate", recipe))
    assert line == f"error: {tmp_path / 'train.jsonl'}: cannot read: Permission denied"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param(bytes(range(256)) * 4, "train.jsonl:1: not valid UTF-8", id="binary"),
        pytest.param(b"[" * 100_000 + b"\n", "train.jsonl:1: invalid JSON: nested too deeply", id="deep"),
        pytest.param(b'{"messages": ' + b"7" * 5000 + b"}\n",
                     "train.jsonl:1: invalid JSON: Exceeds the limit", id="huge-integer"),
        pytest.param(b'{"messages": [{"role": "user", "content": "a\\ud800"}]}\n',
                     "train.jsonl:1: message 1 has invalid text in `content`: a lone surrogate",
                     id="surrogate"),
    ],
)
def test_garbage_in_a_data_file_names_file_and_line(recipe, tmp_path, content, expected):
    (tmp_path / "train.jsonl").write_bytes(content)
    assert expected in error_line(invoke("validate", recipe))


def test_a_directory_as_data_file(recipe, tmp_path):
    (tmp_path / "folder").mkdir()
    line = error_line(invoke("validate", recipe, "--set", "data.path=folder"))
    folder = tmp_path / "folder"
    assert line == (f"error: {folder}: is a folder; name a .jsonl, .json or .parquet file in it, or its files "
                    f"by a pattern ({folder / '*.jsonl'})")


# --------------------------------------------------------------------------------------------------
# User text is printed literally, never read as rich markup


def test_markup_in_a_data_role_is_printed_as_written(recipe, tmp_path):
    with (tmp_path / "train.jsonl").open("a") as f:
        f.write(json.dumps({"messages": [{"role": "[/x]", "content": "[bold]hi"}]}) + "\n")
    line = error_line(invoke("validate", recipe))
    assert line.endswith(
        "train.jsonl:7: message 1 has unknown role '[/x]' (expected system, user, assistant, tool)")


def test_markup_in_paths_is_printed_as_written(tmp_path):
    folder = tmp_path / "[/x] [bold]runs"
    path = write_recipe(folder, n_train=4, n_eval=2)
    result = invoke("validate", path)
    assert result.exit_code == 0, result.output
    assert f"ok recipe {path}" in result.output
    shown = invoke("data", path, "--show", "1")
    assert shown.exit_code == 0, shown.output
    assert "[bold]runs" in shown.output
    line = error_line(invoke("validate", path, "--set", "data.path=[b]missing[/b].jsonl"))
    assert line == "error: [b]missing[/b].jsonl: data file not found (read as a pattern, it matches no file)"


def test_bracketed_text_survives_in_messages(recipe, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    line = error_line(invoke("validate", recipe, "--set", "data.path=someone/chat-data"))
    assert "pip install 'ligertune[hub]'" in line


def test_markup_in_an_override_is_printed_as_written(recipe):
    line = error_line(invoke("validate", recipe, "--set", "optim.lr=[/x]x"))
    assert line == "error: --set optim.lr=[/x]x: expected a number, got '[/x]x'"


# --------------------------------------------------------------------------------------------------
# Silent acceptance


def test_duplicate_keys_are_named_with_both_lines(tmp_path):
    path = write_recipe(tmp_path, n_train=4, n_eval=2)
    text = path.read_text() + "optim:\n  lr: 0.001\n"  # a second `optim:` would reset its betas
    path.write_text(text)
    first = text.splitlines().index("optim:") + 1
    last = len(text.splitlines()) - 1
    line = error_line(invoke("validate", path))
    assert line == (f"error: {path}: optim: duplicate key (lines {first} and {last}); "
                    "the second would silently replace the first")


def test_duplicate_keys_at_any_depth(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model:\n"
        "  config:\n"
        "    model_type: llama\n"
        "    hidden_size: 32\n"
        "    hidden_size: 64\n"
        "data:\n"
        "  sources:\n"
        "    - {path: a.jsonl, weight: 1, weight: 2}\n"
    )
    result = invoke("validate", path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{path}: model.config.hidden_size: duplicate key (lines 4 and 5)" in result.stderr
    assert f"{path}: data.sources[0].weight: duplicate key (line 8, columns 23 and 34)" in result.stderr


def test_duplicate_keys_in_an_override_value(recipe):
    line = error_line(invoke("validate", recipe, "--set", "optim={lr: 0.1, lr: 0.2}"))
    assert line.startswith("error: --set optim={lr: 0.1, lr: 0.2}: optim.lr: duplicate key")


def test_a_smoke_run_shorter_than_the_warmup_runs_with_the_warmup_cut(recipe):
    """`--max-steps 2` of a recipe with 5 warmup steps trains (it was refused): the warmup is cut to
    the run, and `optim.warmup_ratio` is validated against `optim.warmup_steps`."""
    from ligertune.metrics import read_metrics

    recipe.write_text(recipe.read_text().replace("warmup_steps: 1", "warmup_steps: 5"))
    result = invoke("train", recipe, "--max-steps", "2")
    assert result.exit_code == 0, result.output + result.stderr
    steps = [r for r in read_metrics(recipe.parent / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["lr"] for r in steps] == pytest.approx([3e-3 * 1 / 3, 3e-3 * 2 / 3])  # a warmup of 2 steps
    line = error_line(invoke("validate", recipe, "--set", "optim.warmup_ratio=0.1"))
    assert line == ("error: --set optim.warmup_ratio=0.1: give `warmup_steps` (5) or `warmup_ratio` (0.1), "
                    "not both: set the other to 0")


def test_a_run_is_never_written_among_the_users_files(recipe, tmp_path, monkeypatch):
    """`output.dir: ''`, the current folder, or a folder of other files: refused before anything is
    built, and nothing is written there."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    recipe.write_text(recipe.read_text().replace(f"dir: {tmp_path / 'run'}", "dir: ''"))
    assert error_line(invoke("train", recipe)) == (
        f"error: {recipe}: output.dir: must name a folder for the run, e.g. runs/NAME; an empty name would "
        "write the run's files among those of the current folder")
    assert error_line(invoke("train", recipe, "-o", ".")) == (
        "error: output.dir: . is the current folder: the run's files (recipe.yaml, metrics.jsonl, "
        "checkpoints/, final/) would land among yours; name a folder for the run, e.g. runs/NAME")
    (work / "data").mkdir()
    for name in ("b.txt", "c.txt", "recipe.yaml"):
        (work / "data" / name).write_text("mine")
    assert error_line(invoke("validate", recipe, "--set", "output.dir=data")) == (
        "error: output.dir: data holds files that are not a ligertune run (b.txt, c.txt, recipe.yaml): the "
        "run's files would land among them; choose a new or empty folder")
    # Replacing a run moves the run aside; a folder of other files is no run to replace.
    assert "data holds files that are not a ligertune run (b.txt, c.txt, recipe.yaml)" in error_line(
        invoke("train", recipe, "-o", "data", "--set", "output.overwrite=true"))
    assert ".. holds files that are not a ligertune run (eval.jsonl, recipe.yaml, train.jsonl, ...)" in error_line(
        invoke("train", recipe, "-o", ".."))  # the folder above: the recipe's own
    assert sorted(p.name for p in work.rglob("*")) == ["b.txt", "c.txt", "data", "notes.txt", "recipe.yaml"]
    assert (work / "data" / "recipe.yaml").read_text() == "mine"
    (work / "empty").mkdir()
    assert invoke("validate", recipe, "--set", "output.dir=empty").exit_code == 0  # an empty folder is fine


# --------------------------------------------------------------------------------------------------
# Slow or wrong failures


def test_a_relative_path_is_not_taken_for_a_hub_id(recipe, tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    line = error_line(invoke("validate", recipe, "--set", "model.tokenizer=m/missing"))
    assert line == f"error: model.tokenizer: no such folder: {tmp_path / 'm' / 'missing'}"
    # The first folder in the current directory counts too, and `./` always means a path.
    elsewhere = write_recipe(tmp_path / "elsewhere", n_train=4, n_eval=2)
    line = error_line(invoke("validate", elsewhere, "--set", "model.tokenizer=m/missing"))
    assert line == "error: model.tokenizer: no such folder: m/missing"
    line = error_line(invoke("validate", elsewhere, "--set", "model.tokenizer=./tok"))
    assert line == "error: model.tokenizer: no such folder: ./tok"


@pytest.mark.parametrize(
    ("path", "shown"),
    [pytest.param("./my-model", "./my-model", id="dot-slash"),
     pytest.param("../models/my-model", "{recipe_dir}/../models/my-model", id="parent"),  # next to the recipe
     pytest.param("/no/such/my-model", "/no/such/my-model", id="absolute"),
     pytest.param("my model", "my model", id="no-hub-id")],
)
def test_a_mistyped_local_model_folder_is_the_users_mistake_not_the_hubs(recipe, tmp_path, monkeypatch, path,
                                                                          shown):
    """A path that cannot be a hub id is a missing folder (exit 2), not an offline hub (exit 1),
    for the model as for its tokenizer, in `validate` as in `train`."""
    monkeypatch.chdir(tmp_path)
    elsewhere = write_recipe(tmp_path / "elsewhere", n_train=4, n_eval=2)
    shown = shown.format(recipe_dir=elsewhere.parent)
    model = ["--set", "model.config=null", "--set", f"model.name_or_path={path}"]
    assert error_line(invoke("validate", elsewhere, *model)) == f"error: model.name_or_path: no such folder: {shown}"
    assert error_line(invoke("train", elsewhere, *model, "-o", tmp_path / "run")) == \
        f"error: model.name_or_path: no such folder: {shown}"
    line = error_line(invoke("validate", elsewhere, "--set", f"model.tokenizer={path}"))
    assert line == f"error: model.tokenizer: no such folder: {shown}"


def test_a_missing_final_folder_says_which_run_to_train_first(recipe, tmp_path, monkeypatch):
    """`RUN/final` is what a finished run leaves: the line says so, and names the bundled recipe that
    writes RUN when there is one (the DPO example starts from the quick start's model)."""
    monkeypatch.chdir(tmp_path)
    model = ["--set", "model.config=null", "--set"]
    assert error_line(invoke("validate", recipe, *model, "model.name_or_path=runs/mine/final")) == (
        "error: model.name_or_path: no such folder: runs/mine/final (the model a run writing to runs/mine "
        "leaves when it finishes: train that run first)")
    quickstart = bundled_recipes()["quickstart"]
    assert error_line(invoke("validate", recipe, *model, "model.name_or_path=runs/quickstart/final")) == (
        "error: model.name_or_path: no such folder: runs/quickstart/final (the model "
        f"`ligertune train {quickstart}` leaves: run that first)")


def test_a_hub_id_offline_fails_at_once_and_says_so(recipe, monkeypatch):
    line = error_line(invoke("validate", recipe, "--set", "model.tokenizer=someone/no-such-model"), code=1)
    assert line == ("error: model.tokenizer: someone/no-such-model not found locally and the hub cannot be "
                    "reached (offline: HF_HUB_OFFLINE is set); give a local directory, or download it "
                    "while online")
    # Without the variable, a probe that finds no hub (stood in for here: no network in tests).
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "probe_hub", lambda: "huggingface.co")
    line = error_line(invoke("validate", recipe, "--set", "model.config=null",
                             "--set", "model.name_or_path=someone/no-such-model"), code=1)
    assert "someone/no-such-model not found locally and the hub cannot be reached (offline: no answer from " \
           "huggingface.co within 2 s)" in line


def test_a_huge_record_is_dropped_without_tokenizing_it_all(recipe, tmp_path, monkeypatch):
    huge = "the quick brown fox jumps over the lazy dog " * 120_000  # 5 MB
    with (tmp_path / "train.jsonl").open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": huge}]}) + "\n")
    longest = []
    count_tokens = chat.count_tokens

    def counting(tokenizer, text):
        longest.append(len(text))
        return count_tokens(tokenizer, text)

    monkeypatch.setattr(chat, "count_tokens", counting)
    result = invoke("data", recipe, "--json", "--set", "data.truncation=drop")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["dropped"] == {"too_long": 1}
    assert max(longest) <= chat.probe_chars(256) < len(huge) / 100


# --------------------------------------------------------------------------------------------------
# Messages that name their culprit


@pytest.mark.parametrize("override, missing", [
    ("lora.target_modules=[q_proj, v_prj]", "target_modules: v_prj matches"),
    ("lora.target_modules=[nope, gone]", "target_modules: nope, gone match"),
    ("lora.target_modules=qq", "target_modules: qq matches"),
    (r"lora.target_modules=.*\.q_prj", r"target_modules: .*\.q_prj matches"),
    ("lora.modules_to_save=[embed_tokns]", "modules_to_save: embed_tokns matches"),
])
def test_a_lora_name_that_matches_no_module_is_named(recipe, override, missing):
    """peft adapts (or saves) the names that match and drops a mistyped one silently."""
    line = error_line(invoke("validate", recipe, "--set", override))
    assert line == (f"error: lora.{missing} no module of the model; its linear layers: "
                    "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")


def test_a_lora_target_pattern_that_does_not_compile_is_named(recipe):
    line = error_line(invoke("validate", recipe, "--set", "lora.target_modules=q_proj("))
    assert line.startswith("error: lora.target_modules: 'q_proj(' is not a valid pattern: missing )")


@pytest.mark.parametrize("targets", ["[q_proj, v_proj]", "q_proj", "self_attn.q_proj", r".*\.(q|v)_proj"])
def test_lora_targets_as_names_or_a_pattern(recipe, targets):
    result = invoke("validate", recipe, "--set", f"lora.target_modules={targets}",
                    "--set", "lora.modules_to_save=[embed_tokens]")
    assert result.exit_code == 0, result.output + result.stderr


def test_empty_data_names_the_file(recipe, tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    line = error_line(invoke("validate", recipe))
    assert line == f"error: {tmp_path / 'train.jsonl'}: no records (the file is empty)"


def test_no_chat_template_names_the_tokenizer(recipe, tmp_path):
    plain = tmp_path / "plain-tokenizer"
    shutil.copytree(QUICKSTART / "tokenizer", plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    line = error_line(invoke("validate", recipe, "--set", f"model.tokenizer={plain}"))
    assert line.startswith(f"error: model.tokenizer: the tokenizer of {plain} has no chat template")


def test_override_mistakes_are_reported_as_overrides(recipe):
    result = invoke("validate", recipe, "--set", "optim.lr=-1", "--set", "optim.lr.x=1")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: --set optim.lr.x=1: `optim.lr` holds -1, not a mapping of keys"]
    line = error_line(invoke("validate", recipe, "--set", "optim.lr=-1"))
    assert line == "error: --set optim.lr=-1: must be > 0, got -1.0"
    # A problem in the file is still the file's.
    text = recipe.read_text().replace("lr: 0.003", "lr: -0.003")
    recipe.write_text(text)
    assert error_line(invoke("validate", recipe, "--set", "optim.eps=1e-6")) == \
        f"error: {recipe}: optim.lr: must be > 0, got -0.003"


# --------------------------------------------------------------------------------------------------
# Small


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_no_indexing_warning_for_conversations_that_are_truncated(recipe):
    # The quick-start tokenizer declares model_max_length 512: a conversation longer than that.
    long_one = {"messages": [{"role": "user", "content": "hi " * 700},
                             {"role": "assistant", "content": "yo"}]}
    with (recipe.parent / "train.jsonl").open("a") as f:
        f.write(json.dumps(long_one) + "\n")
    records = Records()
    logger = logging.getLogger("transformers")  # `transformers` logs there, without propagating
    logger.addHandler(records)
    try:
        result = invoke("data", recipe, "--json", "--set", "data.max_seq_len=600")
    finally:
        logger.removeHandler(records)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["dropped"] == {"too_long": 1}
    assert not [m for m in records.messages if "Token indices sequence length" in m]


def test_a_subprocess_gets_exit_2_and_one_line(recipe):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LIGERTUNE_DEBUG": "0"}
    command = [sys.executable, "-m", "ligertune", "validate", str(recipe), "--set", "optim.lr=.nan"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if "error" in line] == [
        "error: --set optim.lr=.nan: must be a finite number, got nan"]


# --------------------------------------------------------------------------------------------------
# Property: whatever a recipe holds, `validate` exits 0 or 2, never with a traceback

MARKUP = ["[/x]", "[bold]", "[red]x[/red]", "[", "]", "\\[", "[/]"]


def _mutated_value(rng: random.Random, value):
    choice = rng.randrange(9)
    if choice == 0:  # another type
        return rng.choice([None, True, [], {}, [1, "a"], {"a": 1}, "text[/x]", 3, 2.5])
    if choice == 1 and isinstance(value, (int, float)) and not isinstance(value, bool):  # the other sign
        return -value if value else -1
    if choice == 2:  # huge
        return rng.choice([10**30, -(10**30), 2**63, 2**64 + 1, 1e308, -1e308])
    if choice == 3:  # not finite
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if choice == 4 and isinstance(value, str):  # markup in text (never a valid hub id)
        return f"{value}{rng.choice(MARKUP)}"
    if choice == 5:
        return rng.choice(MARKUP) + "x"
    if choice == 6:  # an edge number
        return rng.choice([0, -1, 1, 0.0, 1e-320, 2**31, 2**63 - 1, -(2**63)])
    if choice == 7 and isinstance(value, list):
        return value + [value[0] if value else 1]
    return rng.choice(["", " ", "0", "1e-4", ".nan", "yes"])


def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _leaves(child, (*path, key))
    if path:
        yield path


# Keys that name a model, tokenizer or data: a value with the shape of a hub id would be looked up on
# the (offline) hub, an environment fault with exit code 1, so those get a character no hub id has.
NAMES = {"tokenizer", "name_or_path", "path", "eval_path", "config", "sources"}


def _mutate(rng: random.Random, recipe: dict) -> dict:
    for _ in range(rng.randrange(1, 4)):
        path = rng.choice(list(_leaves(recipe)))
        parent = recipe
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.15:  # an unknown key beside it
            parent[rng.choice(["lrr", "dtyp", "[/x]", "model", "0", "sources"])] = 1
            continue
        value = _mutated_value(rng, parent[path[-1]])
        if path[-1] in NAMES and isinstance(value, str) and hub.is_hub_id(value):
            value += "[/x]"
        parent[path[-1]] = value
    return recipe


def _duplicate_a_line(rng: random.Random, text: str) -> str:
    lines = text.splitlines()
    keyed = [i for i, line in enumerate(lines) if ":" in line and not line.lstrip().startswith("-")]
    i = rng.choice(keyed)
    lines.insert(i + 1, lines[i])
    return "\n".join(lines) + "\n"


def test_random_recipe_mutations_never_crash_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a mutated relative `cache_dir` lands here
    base = write_recipe(tmp_path, n_train=4, n_eval=2)
    valid = yaml.safe_load(base.read_text())
    valid["description"] = "a recipe"
    valid["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj"]}
    rng = random.Random(1234)
    outcomes = {0: 0, 2: 0}
    for case in range(300):
        recipe = _mutate(rng, json.loads(json.dumps(valid)))
        text = yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True)
        if rng.random() < 0.2:
            text = _duplicate_a_line(rng, text)
        base.write_text(text)
        result = runner.invoke(app, ["validate", str(base)])
        assert result.exit_code in (0, 2), f"case {case}:\n{text}\n{result.output}"
        assert "Traceback" not in result.output, f"case {case}:\n{text}\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), (case, text)
        outcomes[result.exit_code] += 1
    assert outcomes[2] > 150 and outcomes[0] > 5, outcomes  # both kinds were exercised
