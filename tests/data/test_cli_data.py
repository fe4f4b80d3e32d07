"""`ligertune data` through typer's runner: tables, --json, --show, --set, and one-line errors."""

from __future__ import annotations

import json

import pytest
from chat_fixtures import conversation, write_jsonl
from typer.testing import CliRunner

from ligertune.cli.main import app


@pytest.fixture()
def recipe(tmp_path, tokenizer_factory, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LIGERTUNE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps panels at the terminal width
    tokenizer_factory("llama3").save_pretrained(tmp_path / "tokenizer")
    records = [conversation(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(12)]
    records.append({"messages": [{"role": "user", "content": "Hi"}]})  # nothing to train
    write_jsonl(tmp_path / "train.jsonl", records + ['{"messages": [{"role": "bot", "content": "x"}]}'])
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model:\n  config: {model_type: llama}\n  tokenizer: tokenizer\n"
        "data:\n  path: train.jsonl\n  max_seq_len: 128\n  on_bad_record: skip\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  num_workers: 1\n"
    )
    return path


def run(*args: str):
    return CliRunner().invoke(app, ["data", *args])


def test_json_report(recipe):
    result = run(str(recipe), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    data, packing = report["data"], report["packing"]
    assert data["conversations_read"] == 14
    assert data["bad_records"] == 1
    assert data["dropped"]["no_trained_tokens"] == 1
    assert data["train_conversations"] == 12 - data["dropped"].get("too_long", 0)
    assert data["bad_record_examples"][0].endswith(
        "train.jsonl:14: message 1 has unknown role 'bot' (expected system, user, assistant, tool)")
    assert packing["conversations"] == data["train_conversations"]
    assert packing["real_tokens"] == data["total_tokens"]
    assert 0 < packing["efficiency"] <= 1
    assert sum(b["count"] for b in packing["histogram"]) == packing["conversations"]


def test_tables_and_shown_conversations(recipe):
    result = run(str(recipe), "--show", "2")
    assert result.exit_code == 0, result.output
    for text in ("Data", "conversations read", "Packing", "efficiency", "Conversation lengths",
                 "train.jsonl:1", "train.jsonl:2", "what is 0 plus 0?", "skipped"):
        assert text in result.stdout, text


def test_show_in_json_marks_trained_segments(recipe):
    report = json.loads(run(str(recipe), "--json", "--show", "1").stdout)
    (shown,) = report["conversations"]
    trained = [s["text"] for s in shown["segments"] if s["trained"]]
    assert trained == ["The answer is 0.<|eot_id|>"]
    assert "<|start_header_id|>assistant<|end_header_id|>" in "".join(
        s["text"] for s in shown["segments"] if not s["trained"])


def test_overrides_reach_the_data(recipe):
    report = json.loads(run(str(recipe), "--json", "--set", "data.truncation=drop",
                            "--set", "data.max_seq_len=70").stdout)
    assert report["data"]["dropped"]["too_long"] > 0
    assert report["packing"]["max_seq_len"] == 70


def test_data_with_nothing_usable_names_the_file_and_what_became_of_it(recipe):
    result = run(str(recipe), "--set", "data.truncation=drop", "--set", "data.max_seq_len=40")
    assert result.exit_code == 2
    assert result.stderr.count("error:") == 1
    assert ("train.jsonl: no usable conversation among its 14 records (no trained tokens: 1; too long: 12; "
            "bad records skipped: 1)") in result.stderr
    assert "Traceback" not in result.output


def test_malformed_record_is_one_line_and_exit_2(recipe):
    result = run(str(recipe), "--set", "data.on_bad_record=error")
    assert result.exit_code == 2
    assert "train.jsonl:14: message 1 has unknown role 'bot'" in result.stderr
    assert "Traceback" not in result.output
