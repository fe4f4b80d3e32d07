"""Reading sources and normalizing formats; every malformed record is reported with file and line."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
from chat_fixtures import write_jsonl

from ligertune import hub
from ligertune.data import prepare_data, read_conversations
from ligertune.data.formats import source_fingerprint
from ligertune.errors import DataError
from ligertune.recipe import DataConfig

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
NORMALIZED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
GOOD_IN = {
    "auto": GOOD,
    "messages": GOOD,
    "sharegpt": {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    "prompt_completion": {"prompt": "Hi", "completion": "Hello!"},
}


def conversation_with(question: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "Yes."}]}


def config(path: Path, **kwargs) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=None, num_workers=1, **kwargs)


@pytest.mark.parametrize(
    "record, fmt, expected",
    [
        pytest.param(GOOD, "auto", NORMALIZED, id="messages"),
        pytest.param(
            {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello!"}]},
            "auto",
            [{"role": "system", "content": "Be brief."}, *NORMALIZED],
            id="sharegpt",
        ),
        pytest.param({"prompt": "Hi", "completion": "Hello!"}, "auto", NORMALIZED, id="prompt-completion"),
        pytest.param(
            {"prompt": "Hi", "completion": "Hello!", "system": "Be brief."}, "prompt_completion",
            [{"role": "system", "content": "Be brief."}, *NORMALIZED], id="prompt-completion-system",
        ),
        pytest.param(
            {"prompt": [{"role": "user", "content": "Hi"}],
             "completion": [{"role": "assistant", "content": "Hello!"}]},
            "auto", NORMALIZED, id="prompt-completion-lists",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": "Looking."},
                          {"role": "tool", "content": "sunny"},
                          {"role": "assistant", "content": "Sunny."}]},
            "messages",
            [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking."},
             {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
            id="messages-tool",
        ),
    ],
)
def test_formats_normalize_to_messages(tmp_path, record, fmt, expected):
    path = write_jsonl(tmp_path / "train.jsonl", [record, record])
    result = read_conversations(str(path), fmt=fmt)
    assert [c.messages for c in result.conversations] == [expected, expected]
    assert [c.origin for c in result.conversations] == [f"{path}:1", f"{path}:2"]



def test_tool_calls_tools_and_text_parts_normalize_as_chat_templates_take_them(tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    record = {
        "tools": json.dumps(tools),  # some datasets store them as a JSON string
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                         {"type": "text", "text": "in Oslo?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                {"name": "weather", "arguments": {"city": "Bergen"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "extra": 1},
            {"role": "assistant", "content": "Sunny.", "tool_calls": []},
        ],
    }
    path = write_jsonl(tmp_path / "train.jsonl", [record, {"messages": record["messages"]}])
    with_tools, without = read_conversations(str(path)).conversations
    assert with_tools.tools == tools and without.tools is None
    assert with_tools.messages == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}},
             "id": "call_1"},
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Bergen"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny."},
    ]

MALFORMED = [
    pytest.param('{"messages": [{"role": "user", "content": "Hi"}', "auto", "invalid JSON",
                 id="invalid-json"),
    pytest.param([1, 2], "auto", "expected a JSON object, got a list", id="not-an-object"),
    pytest.param({"text": "Hi"}, "auto", "missing `messages` (format messages)",
                 id="not-the-detected-format"),
    pytest.param({"messages": "Hi"}, "auto", "`messages` must be a list of messages, got a string",
                 id="not-a-list"),
    pytest.param({"messages": []}, "auto", "empty conversation", id="empty"),
    pytest.param({"messages": [{"content": "Hi"}]}, "auto", "message 1 has no `role`", id="missing-role"),
    pytest.param(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}, "auto",
        "message 2 has unknown role 'bot' (expected system, user, assistant, tool)", id="unknown-role",
    ),
    pytest.param({"messages": [{"role": "user", "content": 3}]}, "auto",
                 "message 1 has non-string `content` (got int)", id="non-string-content"),
    pytest.param({"messages": [{"role": "user", "content": ["Hi"]}]}, "auto",
                 'message 1 has a string in its `content` list, where text parts {"type": "text", '
                 '"text": ...} were expected', id="content-list-of-strings"),
    pytest.param({"messages": [{"role": "user",
                                "content": [{"type": "image_url", "image_url": "x.png"}]}]}, "auto",
                 "message 1 has a `content` part of type 'image_url': only text parts are read",
                 id="image-part"),
    pytest.param({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
                 "auto", "message 2 has non-string `content` (got null)",
                 id="null-content-without-tool-calls"),
    pytest.param({"messages": [{"role": "user", "content": "Hi"},
                               {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
                 "auto", "message 2, tool call 1: expected an object with a function `name`, got an object",
                 id="tool-call-without-name"),
    pytest.param({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{'a': 1}"}}]}]},
                 "auto", "message 2, tool call 1: `arguments` is a string but no JSON object",
                 id="arguments-not-json"),
    pytest.param({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                  "tools": {"name": "f"}},
                 "auto", "`tools` must be a list of function definitions (objects), got an object",
                 id="tools-object"),
    pytest.param({"messages": [{"role": "user"}]}, "auto", "message 1 has no `content`",
                 id="missing-content"),
    pytest.param({"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"}]},
                 "sharegpt", "message 2 has unknown `from` 'bot'", id="sharegpt-unknown-from"),
    pytest.param({"conversations": [{"from": ["human"], "value": "Hi"}]},
                 "sharegpt", "message 1 has unknown `from` ['human']", id="sharegpt-from-not-a-string"),
    pytest.param({"prompt": 3, "completion": "Hello"}, "prompt_completion",
                 "`prompt` must be a string or a list of messages, got int", id="prompt-not-string"),
    pytest.param({"conversations": []}, "messages", "missing `messages` (format messages)",
                 id="wrong-format"),
    pytest.param(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late"},
                      {"role": "assistant", "content": "Hello"}]}, "auto",
        "message 2: a system message may only come first", id="system-not-first",
    ),
]


@pytest.mark.parametrize("bad, fmt, problem", MALFORMED)
def test_first_malformed_record_names_file_and_line(tmp_path, chatml, bad, fmt, problem):
    # Line 2 is blank: line numbers are those of the file, not of the records.
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD_IN[fmt], "", bad, GOOD_IN[fmt]])
    with pytest.raises(DataError, match=re.escape(f"{path}:3: {problem}")):
        prepare_data(config(path, format=fmt), chatml, seed=0, show_progress=False)


@pytest.mark.parametrize("bad, fmt, problem", MALFORMED)
def test_skip_counts_malformed_records(tmp_path, chatml, bad, fmt, problem):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD_IN[fmt], "", bad, GOOD_IN[fmt]])
    data = prepare_data(config(path, format=fmt, on_bad_record="skip"), chatml, seed=0, show_progress=False)
    assert data.stats.conversations_read == 3
    assert data.stats.bad_records == 1
    assert len(data.train) == 2
    assert [e.origin for e in data.train] == [f"{path}:1", f"{path}:4"]
    assert any(problem in line and f"{path}:3" in line for line in data.stats.bad_record_examples)


def test_format_detected_from_the_first_record(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "Hi"}, GOOD])
    with pytest.raises(DataError, match=re.escape(f"{path}:1: cannot tell the format: expected")):
        read_conversations(str(path))
    result = read_conversations(str(path), on_bad_record="skip")
    assert [c.messages for c in result.conversations] == [NORMALIZED]


def test_template_rejection_names_file_and_line(tmp_path, tokenizer_factory):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD, {"messages": [{"role": "user", "content": "a"},
                                                                       {"role": "user", "content": "b"}]}])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: the chat template rejects this conversation")):
        prepare_data(config(path), tokenizer_factory("mistral"), seed=0, show_progress=False)


def test_json_array_records_know_their_lines(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[\n" + json.dumps(GOOD, indent=1) + ",\n" + json.dumps(GOOD) + "\n]\n")
    result = read_conversations(str(path))
    first_len = json.dumps(GOOD, indent=1).count("\n") + 1
    assert [c.origin for c in result.conversations] == [f"{path}:2", f"{path}:{2 + first_len}"]
    assert result.conversations[1].messages == NORMALIZED


def test_json_array_records_on_one_line_have_origins_of_their_own(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([GOOD, GOOD, GOOD]))  # minified: every record starts on line 1
    origins = [c.origin for c in read_conversations(str(path)).conversations]
    assert origins == [f"{path}:1", f"{path}:1 (record 2)", f"{path}:1 (record 3)"]


def test_json_array_syntax_error_stops_with_its_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[\n" + json.dumps(GOOD) + ",\n{\"messages\": [}\n]\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: invalid JSON")):
        read_conversations(str(path), on_bad_record="skip")


def test_json_file_of_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "train.json", [GOOD, GOOD])
    assert len(read_conversations(str(path)).conversations) == 2


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    bad = {"messages": [{"role": "bot", "content": "x"}]}
    pq.write_table(pa.Table.from_pylist([GOOD, bad, GOOD]), path)
    result = read_conversations(str(path), on_bad_record="skip")
    assert [c.messages for c in result.conversations] == [NORMALIZED, NORMALIZED]
    assert result.bad == [
        f"{path}:row 2: message 1 has unknown role 'bot' (expected system, user, assistant, tool)"]


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        read_conversations(str(tmp_path / "nope.jsonl"))
    (tmp_path / "train.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        read_conversations(str(tmp_path / "train.txt"))


def test_a_pattern_reads_every_file_it_matches_in_name_order(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in (1, 0):  # written out of order: read in name order
        write_jsonl(shards / f"train-0000{i}-of-00002.jsonl",
                    [conversation_with(f"shard {i}, {n}") for n in (1, 2)])
    write_jsonl(shards / "test-00000-of-00001.jsonl", [conversation_with("held out")])
    result = read_conversations(str(shards / "train-*.jsonl"))
    assert [c.messages[0]["content"] for c in result.conversations] == [
        "shard 0, 1", "shard 0, 2", "shard 1, 1", "shard 1, 2"]
    assert [c.origin for c in result.conversations] == [
        f"{shards / name}:{line}" for name in ("train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl")
        for line in (1, 2)]


def test_a_pattern_that_matches_no_file_or_a_file_of_another_type_is_one_line(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "train.jsonl", [GOOD])
    (shards / "README.md").write_text("# shards")
    with pytest.raises(DataError, match=re.escape(f"{shards / 'x-*.jsonl'}: data file not found (read as a "
                                                  "pattern, it matches no file)")):
        read_conversations(str(shards / "x-*.jsonl"))
    with pytest.raises(DataError, match=re.escape(f"{shards / 'README.md'} (matched by {shards / '*'}): "
                                                  "unsupported file type '.md'")):
        read_conversations(str(shards / "*"))


def test_a_file_whose_name_has_brackets_is_read_as_that_file(tmp_path):
    path = write_jsonl(tmp_path / "train [v2].jsonl", [GOOD])
    assert [c.origin for c in read_conversations(str(path)).conversations] == [f"{path}:1"]


def test_a_pattern_s_fingerprint_changes_with_a_new_or_changed_file(tmp_path):
    write_jsonl(tmp_path / "a-0.jsonl", [GOOD])
    pattern = str(tmp_path / "a-*.jsonl")
    first = source_fingerprint(pattern)
    write_jsonl(tmp_path / "a-1.jsonl", [GOOD])
    second = source_fingerprint(pattern)
    write_jsonl(tmp_path / "a-1.jsonl", [GOOD, GOOD])
    assert len({first, second, source_fingerprint(pattern)}) == 3
    assert source_fingerprint(str(tmp_path / "b-*.jsonl")) is None


@pytest.fixture()
def hub_online(monkeypatch):
    """The hub answers (without asking it: tests use no network)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "probe_hub", lambda: None)


def test_hub_names_go_through_datasets(monkeypatch, hub_online):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [GOOD, {"prompt": "Hi", "completion": "Hello!"}] if split == "train" else []

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    result = read_conversations("someone/chat-data", fmt="auto", split="train", on_bad_record="skip")
    assert calls == [("someone/chat-data", "train")]
    assert [c.origin for c in result.conversations] == ["someone/chat-data[train]:row 1"]
    assert result.bad == ["someone/chat-data[train]:row 2: missing `messages` (format messages)"]


def test_hub_unreachable_or_datasets_missing(monkeypatch, hub_online):
    def unreachable(name, split):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    with pytest.raises(DataError, match="someone/chat-data: cannot load the hub dataset .*no route to host"):
        read_conversations("someone/chat-data")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="needs the `datasets` package"):
        read_conversations("someone/chat-data")
