"""`ligertune chat`: what a path points at, one-shot answers against a reference loop, the chat loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import write_recipe
from typer.testing import CliRunner

from ligertune.cli.main import app
from ligertune.errors import UserError
from ligertune.inference import Reply, locate_model, render_prompt
from ligertune.recipe import load_recipe

runner = CliRunner()

QUESTION = "Which herbs grow well indoors?"


def invoke(*args, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def assert_user_error(result, *expected: str) -> None:
    assert result.exit_code == 2, result.output
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.output


def one_shot(*args) -> dict:
    result = invoke("chat", *args, "--json")
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A LoRA run of 3 steps at a small learning rate: near its random start, the model does not yet
    end every turn at once, so greedy replies run for several tokens."""
    from ligertune.training import train

    folder = tmp_path_factory.mktemp("chat")
    recipe = write_recipe(folder, n_train=16, lora={"r": 4, "alpha": 8, "target_modules": "all-linear"},
                          optim={"lr": 1e-3}, train={"eval_every": None, "eval_at_start": False})
    train(load_recipe(recipe), console=Console(quiet=True))
    return folder / "run"


@torch.no_grad()
def reference_greedy(run_dir: Path, messages: list[dict], max_new_tokens: int) -> list[int]:
    """Argmax one token at a time over the whole sequence (no cache, no `generate`), on the base model
    with the run's adapters through peft, until the tokenizer's end-of-turn token."""
    from peft import PeftModel

    from ligertune.models import build_model, load_tokenizer

    recipe = load_recipe(run_dir / "recipe.yaml")
    tokenizer = load_tokenizer(recipe.model)
    base = build_model(recipe.model, device="cpu", seed=recipe.train.seed, vocab_size=len(tokenizer))
    model = PeftModel.from_pretrained(base, run_dir / "final").eval()
    ids = render_prompt(tokenizer, messages)
    new: list[int] = []
    while len(new) < max_new_tokens and (not new or new[-1] != tokenizer.eos_token_id):
        new.append(int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax()))
    return new


# --------------------------------------------------------------------------------------------------
# what a path points at


def make_files(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("{}")
    return folder


def test_locate_a_run_its_final_a_checkpoint_and_a_model_folder(tmp_path: Path):
    run = make_files(tmp_path / "run", "recipe.yaml")
    make_files(run / "final", "adapter_config.json")
    step = make_files(run / "checkpoints" / "step-000004", "adapter_config.json", "trainer_state.pt")
    (run / "checkpoints" / "latest").symlink_to("step-000004")
    alone = make_files(tmp_path / "model", "config.json")

    found = locate_model(run)
    assert (found.model_dir, found.run_dir, found.adapters) == (run / "final", run, True)
    assert locate_model(run / "final").run_dir == run
    assert locate_model(step).run_dir == run and locate_model(step).model_dir == step
    assert locate_model(run / "checkpoints" / "latest").run_dir == run
    assert (locate_model(alone).run_dir, locate_model(alone).adapters) == (None, False)


def test_locate_refuses_what_holds_no_model(tmp_path: Path):
    run = make_files(tmp_path / "run", "recipe.yaml")
    with pytest.raises(UserError, match="no final/ model yet"):
        locate_model(run)
    make_files(run / "checkpoints" / "step-000002", "adapter_config.json")
    make_files(run / "checkpoints" / "step-000010", "adapter_config.json")
    with pytest.raises(UserError, match="pass one of its checkpoints, e.g. .*step-000010"):
        locate_model(run)
    with pytest.raises(UserError, match="not found"):
        locate_model(tmp_path / "absent")
    with pytest.raises(UserError, match="holds no model"):
        locate_model(make_files(tmp_path / "empty"))


# --------------------------------------------------------------------------------------------------
# one-shot


def test_one_shot_answer_is_the_greedy_reply_of_base_plus_adapters(lora_run: Path):
    reply = one_shot(lora_run, "--prompt", QUESTION, "--max-new-tokens", 12)
    expected = reference_greedy(lora_run, [{"role": "user", "content": QUESTION}], 12)
    from ligertune.models import load_tokenizer

    tokenizer = load_tokenizer(load_recipe(lora_run / "recipe.yaml").model)
    assert reply["answer"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply["answer"].strip()  # the reply has text, so the comparison above means something
    assert reply["completion_tokens"] == len(expected)
    assert reply["prompt_tokens"] == len(render_prompt(tokenizer, [{"role": "user", "content": QUESTION}]))
    assert reply["finish_reason"] == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
    assert reply["prompt"] == QUESTION and reply["temperature"] == 0.0


def test_plain_one_shot_prints_the_answer(lora_run: Path):
    answer = one_shot(lora_run, "-p", QUESTION, "-n", 8)["answer"]
    result = invoke("chat", lora_run, "-p", QUESTION, "-n", 8)
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stdout == answer + "\n"


def test_system_prompt_and_sampling(lora_run: Path):
    plain = one_shot(lora_run, "-p", QUESTION, "-n", 8)
    system = one_shot(lora_run, "-p", QUESTION, "-n", 8, "--system", "Answer in one word.")
    assert system["prompt_tokens"] > plain["prompt_tokens"]
    sampled = [one_shot(lora_run, "-p", QUESTION, "-n", 8, "--temperature", 1.5, "--top-p", 0.95, "--seed", 7)
               for _ in range(2)]
    assert sampled[0]["answer"] == sampled[1]["answer"]  # the seed makes sampling repeatable


def test_chat_with_the_merged_model_answers_like_the_run(lora_run: Path, tmp_path: Path):
    merged = tmp_path / "merged"
    assert invoke("merge", lora_run, "--output", merged).exit_code == 0
    from_merged, from_run = (one_shot(path, "-p", QUESTION, "-n", 10) for path in (merged, lora_run))
    for reply in (from_merged, from_run):
        assert reply.pop("tokens_per_s") > 0  # a timing: the one field that may differ
    assert from_merged == {**from_run, "model": str(merged)}


# --------------------------------------------------------------------------------------------------
# interactive


def test_interactive_loop_keeps_history_and_obeys_commands(lora_run: Path, monkeypatch):
    import ligertune.inference

    seen: list[list[dict]] = []

    def fake_reply(model, tokenizer, messages, *, on_text=None, **generation):
        if messages[-1]["content"] == "boom":
            raise UserError("the chat template refused the conversation: no system role")
        seen.append(list(messages))
        text = f"reply {len(seen)}"
        on_text(text)
        return Reply(text=text, prompt_tokens=1, completion_tokens=2, finish_reason="stop")

    monkeypatch.setattr(ligertune.inference, "generate_reply", fake_reply)
    lines = ["hello", "and then?", "/system Be brief.", "hi", "/bogus", "/reset", "boom", "hi", "/system",
             "bye", "/tool sunny", "/exit", "never read"]
    result = invoke("chat", lora_run, input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output + result.stderr

    def user(text):
        return {"role": "user", "content": text}

    system = {"role": "system", "content": "Be brief."}
    assert seen == [
        [user("hello")],
        [user("hello"), {"role": "assistant", "content": "reply 1"}, user("and then?")],
        [system, user("hi")],
        [system, user("hi")],
        [user("bye")],
        [user("bye"), {"role": "assistant", "content": "reply 5"}, {"role": "tool", "content": "sunny"}],
    ]
    for n in range(1, 7):
        assert f"reply {n}\n" in result.stdout
    assert "unknown command /bogus" in result.stdout
    assert "error: the chat template refused the conversation" in result.stdout  # and the loop went on
    assert "/system TEXT" in result.stderr  # the help line


def test_interactive_reply_streams_the_one_shot_answer_and_ends_at_eof(lora_run: Path):
    answer = one_shot(lora_run, "-p", QUESTION, "-n", 8)["answer"]
    result = invoke("chat", lora_run, "-n", 8, input=f"{QUESTION}\n")  # no /exit: end of input ends it
    assert result.exit_code == 0, result.output + result.stderr
    assert f"{answer}\n" in result.stdout


def test_brackets_in_a_command_or_a_path_are_printed_as_they_are(lora_run: Path, tmp_path: Path):
    run = tmp_path / "run[" / "x]"  # `[/x]` would close a rich markup tag
    shutil.copytree(lora_run, run)
    result = invoke("chat", run, input="/[/x]\n/exit\n")
    assert result.exit_code == 0, result.output + result.stderr
    assert "unknown command /[/x]: /system TEXT" in result.stdout
    assert f"LoRA adapters in {run / 'final'}, cpu" in result.stderr


# --------------------------------------------------------------------------------------------------
# mistakes


def test_help_shows_an_example():
    result = invoke("chat", "--help")
    assert result.exit_code == 0 and "Example" in result.output and "/reset" in result.output


def test_chat_user_errors(lora_run: Path, tmp_path: Path):
    assert_user_error(invoke("chat", lora_run, "--json"), "--json: needs --prompt")
    assert_user_error(invoke("chat", lora_run, "-p", "hi", "--top-p", "0"), "--top-p: must be in (0, 1]")
    assert_user_error(invoke("chat", lora_run, "-p", "hi", "--temperature", "-1"),
                      "--temperature: must be >= 0")
    assert_user_error(invoke("chat", lora_run, "-p", "hi", "-n", "0"), "--max-new-tokens: must be >= 1")
    assert_user_error(invoke("chat", lora_run, "-p", "hi", "--dtype", "fp8"), "--dtype:")
    assert_user_error(invoke("chat", tmp_path / "absent", "-p", "hi"), "absent: not found")
    assert_user_error(invoke("chat", tmp_path, "-p", "hi"), "holds no model")

    no_template = tmp_path / "no-template"
    assert invoke("merge", lora_run, "--output", no_template).exit_code == 0
    (no_template / "chat_template.jinja").unlink()
    assert_user_error(invoke("chat", no_template, "-p", "hi"), f"{no_template}: its tokenizer has no chat")


# ChatML that writes the tools offered into a system turn of their own.
CHATML_TOOLS = (
    "{%- if tools -%}{{- '<|im_start|>system\\nTools: ' + tools | tojson + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_tools_are_offered_through_the_template_and_refused_where_it_ignores_them(lora_run: Path,
                                                                                   tmp_path: Path):
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    assert_user_error(invoke("chat", lora_run, "-p", "hi", "--tools", tmp_path / "tools.json"),
                      "--tools: the model's chat template does not write tools into the prompt")
    merged = tmp_path / "merged"
    assert invoke("merge", lora_run, "--output", merged).exit_code == 0
    (merged / "chat_template.jinja").write_text(CHATML_TOOLS)
    reply = one_shot(merged, "-p", QUESTION, "-n", 3, "--tools", tmp_path / "tools.json")
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert reply["tools"] == tools
    question = [{"role": "user", "content": QUESTION}]
    assert reply["prompt_tokens"] == len(render_prompt(tokenizer, question, tools))
    assert reply["prompt_tokens"] > len(render_prompt(tokenizer, question))
    (tmp_path / "bad.json").write_text('{"name": "weather"}')
    assert_user_error(invoke("chat", merged, "-p", "hi", "--tools", tmp_path / "bad.json"),
                      "--tools: ", "`tools` must be a list of function definitions")
    assert_user_error(invoke("chat", merged, "-p", "hi", "--tools", tmp_path / "absent.json"),
                      "--tools: ", "absent.json: no such file")


def test_a_run_trained_under_a_system_prompt_chats_under_it(lora_run: Path, tmp_path: Path):
    import yaml

    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["data"]["system_prompt"] = "Answer briefly."
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert one_shot(lora_run, "-p", QUESTION, "-n", 2)["system"] is None
    trained_under = one_shot(run, "-p", QUESTION, "-n", 2)
    assert trained_under["system"] == "Answer briefly."
    assert trained_under == {**one_shot(run, "-p", QUESTION, "-n", 2, "--system", "Answer briefly."),
                             "tokens_per_s": trained_under["tokens_per_s"]}
    assert one_shot(run, "-p", QUESTION, "-n", 2, "--system", "Be long.")["system"] == "Be long."
