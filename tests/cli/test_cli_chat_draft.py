"""`ligertune chat --draft` and `ligertune bench decode` on tiny llama and qwen2 models with the quick-start tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_recipe import QUICKSTART, TINY_MODEL
from typer.testing import CliRunner

from ligertune.cli.main import app

runner = CliRunner()
PROMPTS = ["Repeat exactly: red green blue red green blue", "what comes after d?", "uppercase yarn"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_shot(model: Path, prompt: str, *args) -> dict:
    result = invoke("chat", model, "-p", prompt, "--json", *args)
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> Path:
    """A random tiny model of the family and the quick-start tokenizer, as a merged model folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp(request.param)
    tokenizer = AutoTokenizer.from_pretrained(str(QUICKSTART / "tokenizer"))
    fields = {k: v for k, v in TINY_MODEL.items() if k != "model_type"}
    config = AutoConfig.for_model(request.param, **fields, vocab_size=len(tokenizer), tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("prompt", PROMPTS, ids=["repeat", "after-d", "uppercase"])
def test_ngram_draft_answers_as_plain_greedy_decoding(model_dir: Path, prompt: str):
    plain = one_shot(model_dir, prompt, "-n", 24)
    drafted = one_shot(model_dir, prompt, "-n", 24, "--draft", "ngram")
    assert drafted["answer"] == plain["answer"] and drafted["completion_tokens"] == plain["completion_tokens"]
    assert drafted["finish_reason"] == plain["finish_reason"]
    assert (plain["draft"], plain["tokens_per_step"], plain["forwards"]) == ("none", 1.0, plain["completion_tokens"])
    assert drafted["forwards"] <= plain["forwards"] and drafted["tokens_per_s"] > 0
    assert drafted["tokens_per_step"] == round(drafted["completion_tokens"] / drafted["forwards"], 4)
    assert all(0 <= r <= 1 for r in drafted["acceptance_per_depth"])


def test_sampled_draft_answers_repeat_under_a_seed(model_dir: Path):
    args = ("-n", 12, "--draft", "ngram", "--temperature", 0.9, "--seed", 5)
    for accept in ("exact", "typical"):
        first = one_shot(model_dir, PROMPTS[0], *args, "--accept", accept)
        assert first == {**one_shot(model_dir, PROMPTS[0], *args, "--accept", accept), "tokens_per_s": first["tokens_per_s"]}
        assert first["accept"] == accept


def test_draft_mistakes_are_one_line_errors(model_dir: Path):
    for args, expected in [(("--draft", "medusa"), "has no Medusa heads"),
                           (("--draft", "eagle"), "--draft: expected one of none, ngram, medusa"),
                           (("--accept", "greedy"), "--accept: expected one of exact, typical")]:
        result = invoke("chat", model_dir, "-p", "hi", *args)
        assert result.exit_code == 2 and expected in result.stderr and "Traceback" not in result.output, result.output


def test_bench_decode_times_each_draft_and_checks_the_answers(model_dir: Path, tmp_path: Path):
    out = tmp_path / "decode.json"
    result = invoke("bench", "decode", model_dir, "-p", PROMPTS[0], "-p", PROMPTS[1], "-n", 16, "--repeats", 1,
                    "--warmup", 0, "--json", out)
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(out.read_text())
    rows = {row["draft"]: row for row in report["rows"]}
    assert set(rows) == {"none", "ngram"} and report["prompts"] == PROMPTS[:2]
    assert rows["none"]["tokens_per_step"] == 1.0 and rows["none"]["speedup"] == 1.0
    assert rows["ngram"]["same_as_plain"] is True and rows["ngram"]["tokens"] == rows["none"]["tokens"]
    assert rows["ngram"]["forwards"] <= rows["none"]["forwards"] and rows["ngram"]["tokens_per_s"] > 0
    assert "tokens/s" in result.stdout
    refused = invoke("bench", "decode", model_dir, "--drafts", "none,eagle")
    assert refused.exit_code == 2 and "--drafts: expected some of none, ngram, medusa" in refused.stderr


def test_bench_decode_answers_the_conversations_of_a_chat_file(model_dir: Path, tmp_path: Path):
    chat = tmp_path / "eval.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": p},
        {"role": "assistant", "content": "ok"}]}) + "\n" for p in PROMPTS))
    out = tmp_path / "decode.json"
    result = invoke("bench", "decode", model_dir, "-p", "hi", "--prompts-from", chat, "--max-prompts", 2,
                    "-n", 8, "--repeats", 1, "--warmup", 0, "--json", out)
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(out.read_text())
    assert [row["draft"] for row in report["rows"]] == ["none", "ngram"]
    assert report["prompts"] == ["hi", *PROMPTS[:2]] and report["rows"][1]["same_as_plain"] is True
    chat.write_text(chat.read_text() + "{not json\n")
    refused = invoke("bench", "decode", model_dir, "--prompts-from", chat)
    assert refused.exit_code == 2, refused.output
    assert f"--prompts-from {chat}:4: invalid JSON" in refused.stderr and "Traceback" not in refused.output
