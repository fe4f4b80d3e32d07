"""`build_data`: the warnings a run prints before its first step about what the data lost (records
skipped, conversations dropped or shortened, an empty held-out split), and `data.max_seq_len`
checked against the model's positions before any data is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_recipe import QUICKSTART, TINY_MODEL

from ligertune.errors import UserError
from ligertune.models import load_tokenizer
from ligertune.recipe import recipe_from_dict
from ligertune.training.build import build_data, check_max_seq_len

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer with the result only."}


def exchange(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def short(i: int) -> dict:
    return {"messages": [SYSTEM, *exchange(f"what is {i} + 1?", str(i + 1))]}


LONG = "a b c d e f g h " * 40  # far more than 96 tokens


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def recipe_for(path: Path, *, data: dict | None = None, train: dict | None = None, model: dict | None = None):
    return recipe_from_dict({
        "model": model or {"config": dict(TINY_MODEL), "tokenizer": str(QUICKSTART / "tokenizer")},
        "data": {"path": str(path), "max_seq_len": 96, "cache_dir": None, "num_workers": 1, **(data or {})},
        "train": train or {},
    })


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(recipe_for(Path("unused.jsonl")).model)


def test_what_the_data_lost_is_in_the_warnings(tmp_path: Path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [
        short(0), short(1),
        '{"messages": [{"role": "bot", "content": "x"}]}',                             # line 3: bad
        {"messages": [SYSTEM, *exchange("say it", LONG)]},                           # too long
        {"messages": [SYSTEM, *exchange("what is 2 + 1?", "3"), *exchange("again", LONG)]},  # shortened
        {"messages": [SYSTEM, {"role": "user", "content": "nothing to answer"}]},    # no trained token
        "not json",                                                                  # line 7: bad
        short(2),
    ])
    data = build_data(recipe_for(path, data={"on_bad_record": "skip"}, train={"eval_every": 10}), tokenizer,
                      show_progress=False)
    assert len(data.train_examples) == 4
    assert data.warnings == [
        f"data.on_bad_record: skipped 2 malformed records; the first: {path}:3: message 1 has unknown role "
        "'bot' (expected system, user, assistant, tool)",
        "data.max_seq_len: dropped 1 conversation longer than 96 tokens (not even their first answer fits)",
        "data.truncation: shortened 1 conversation longer than data.max_seq_len (96 tokens) by 2 trailing turns",
        "data.train_on: dropped 1 conversation with no trained token (train_on: assistant)",
        "train.eval_every: there is no held-out data (data.eval_path or data.eval_fraction): no evaluation will run",
    ]
    dropped = build_data(recipe_for(path, data={"on_bad_record": "skip", "truncation": "drop"}), tokenizer,
                         show_progress=False)
    assert "data.max_seq_len: dropped 2 conversations longer than 96 tokens (data.truncation: drop)" in dropped.warnings


def test_an_empty_held_out_split_is_said(tmp_path: Path, tokenizer):
    path = write_jsonl(tmp_path / "one.jsonl", [short(0)])
    data = build_data(recipe_for(path, data={"eval_fraction": 0.2}), tokenizer, show_progress=False)
    assert data.eval_examples == [] and data.eval_packs == []
    assert data.warnings == ["data.eval_fraction: 0.2 held out no conversation (a source needs at least 2 to "
                             "give one): no evaluation will run"]
    # Two conversations give one to evaluation, and clean data says nothing.
    path = write_jsonl(tmp_path / "two.jsonl", [short(0), short(1)])
    data = build_data(recipe_for(path, data={"eval_fraction": 0.2}), tokenizer, show_progress=False)
    assert (len(data.train_examples), len(data.eval_examples), data.warnings) == (1, 1, [])


def test_max_seq_len_beyond_the_model_positions_is_refused_before_reading(tmp_path: Path, tokenizer):
    missing = tmp_path / "not-read.jsonl"  # the check comes before the data: this file is never opened
    with pytest.raises(UserError) as info:
        build_data(recipe_for(missing, data={"max_seq_len": 100_000}), tokenizer, show_progress=False)
    assert str(info.value) == ("data.max_seq_len: 100000 is more than the model's 512 positions "
                               "(max_position_embeddings in its config); give at most 512")
    check_max_seq_len(recipe_for(missing, data={"max_seq_len": 512}), vocab_size=len(tokenizer))  # as many: fine


def test_max_seq_len_is_checked_against_a_local_pretrained_config(tmp_path: Path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_MODEL, "vocab_size": 300, "max_position_embeddings": 64}))
    model = {"name_or_path": str(folder), "tokenizer": str(QUICKSTART / "tokenizer")}
    with pytest.raises(UserError, match=r"^data.max_seq_len: 96 is more than the model's 64 positions "):
        check_max_seq_len(recipe_for(tmp_path / "x.jsonl", model=model), vocab_size=300)
    # A hub id that is not in the local cache is left to the model's loader.
    hub = {"name_or_path": "nobody-here/not-a-model", "tokenizer": str(QUICKSTART / "tokenizer")}
    check_max_seq_len(recipe_for(tmp_path / "x.jsonl", model=hub), vocab_size=300)
