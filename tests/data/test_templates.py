"""`model.chat_template`: a built-in, a .jinja file or Jinja text in place of the tokenizer's own template."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from chat_fixtures import make_tokenizer
from cli_runs import ligertune
from tiny_recipe import QUICKSTART, write_recipe
from transformers import AutoTokenizer

from ligertune.data import tokenize_conversation
from ligertune.data.chat import turn_end_ids
from ligertune.data.templates import CHATML, set_chat_template
from ligertune.errors import UserError
from ligertune.models import load_tokenizer
from ligertune.recipe import load_recipe

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye."}]


@pytest.fixture()
def plain_tokenizer(tmp_path: Path) -> Path:
    """The quick-start tokenizer without its template (ChatML's tokens, as a base model's vocabulary)."""
    plain = tmp_path / "plain-tokenizer"
    shutil.copytree(QUICKSTART / "tokenizer", plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    return plain


def test_chatml_renders_and_masks_as_a_tokenizer_whose_own_template_is_chatml(plain_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(plain_tokenizer)
    assert not tokenizer.chat_template
    set_chat_template(tokenizer, "chatml", "the plain tokenizer")
    own = AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer")
    assert tokenize_conversation(tokenizer, CONVERSATION) == tokenize_conversation(own, CONVERSATION)


def test_llama3_writes_meta_s_layout_and_trains_each_answer_with_its_eot():
    tokenizer = make_tokenizer("llama3")
    tokenizer.chat_template = None
    set_chat_template(tokenizer, "llama3", "the tokenizer")
    text = tokenizer.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=False)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>")
    example = tokenize_conversation(tokenizer, CONVERSATION)
    trained = tokenizer.decode([t for t in example.labels if t != -100])
    assert trained == "Hello!<|eot_id|>Bye.<|eot_id|>"
    assert tokenizer.convert_ids_to_tokens(turn_end_ids(tokenizer)) == ["<|eot_id|>"]


def test_a_built_in_template_needs_its_markers_as_special_tokens(plain_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(plain_tokenizer)
    with pytest.raises(UserError, match=r"^model.chat_template: llama3 needs <\|start_header_id\|>, "
                                        r"<\|end_header_id\|>, <\|eot_id\|> as special tokens, and the plain "
                                        "tokenizer has none of them: write a template of your own"):
        set_chat_template(tokenizer, "llama3", "the plain tokenizer")
    assert not tokenizer.chat_template  # left as it was


@pytest.mark.parametrize("value, message", [
    ("chatlm", "'chatlm' is no built-in template (chatml, llama3), no .jinja file and no Jinja text"),
    ("{% for m in messages %}{{ m['content'] }", "the chat template rejects this conversation: "),
    ("{{ raise_exception('no') }}", "the chat template rejects this conversation: no"),
])
def test_a_template_that_cannot_render_is_one_line(plain_tokenizer, value, message):
    tokenizer = AutoTokenizer.from_pretrained(plain_tokenizer)
    with pytest.raises(UserError, match="^model.chat_template: " + re.escape(message)):
        set_chat_template(tokenizer, value, "the plain tokenizer")


def test_a_jinja_file_resolves_next_to_the_recipe(plain_tokenizer, tmp_path: Path):
    (tmp_path / "chat.jinja").write_text(CHATML.replace("<|im_end|>", "<|endoftext|>"))
    path = write_recipe(tmp_path, model={"tokenizer": str(plain_tokenizer), "chat_template": "chat.jinja"})
    recipe = load_recipe(path)
    assert recipe.model.chat_template == str(tmp_path / "chat.jinja")
    tokenizer = load_tokenizer(recipe.model)
    assert tokenizer.convert_ids_to_tokens(turn_end_ids(tokenizer)) == ["<|endoftext|>"]
    (tmp_path / "chat.jinja").unlink()
    with pytest.raises(UserError, match=f"^model.chat_template: {tmp_path / 'chat.jinja'}: no such file$"):
        load_tokenizer(recipe.model)


def test_a_run_saves_the_template_and_chat_answers_through_it(plain_tokenizer, tmp_path: Path):
    path = write_recipe(tmp_path, model={"tokenizer": str(plain_tokenizer), "chat_template": "chatml"})
    result = ligertune("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert saved.chat_template == CHATML
    result = ligertune("chat", str(tmp_path / "run"), "--prompt", "reverse cat", "--json",
                       "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    prompt = saved.apply_chat_template([{"role": "user", "content": "reverse cat"}],
                                       add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nreverse cat<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = saved(prompt, add_special_tokens=False)["input_ids"]
    assert json.loads(result.stdout)["prompt_tokens"] == len(prompt_ids)
