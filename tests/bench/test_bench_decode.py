"""The prompts `bench decode` answers: `-p` strings, a chat-data file's conversations, or the defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ligertune.bench.decode import DEFAULT_PROMPTS, bench_prompts, prompt_text, prompts_from
from ligertune.errors import UserError

SYSTEM = {"role": "system", "content": "Answer in capital letters."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "what comes after t?"}, {"role": "assistant", "content": "U"},
     {"role": "user", "content": "sort the letters of boat"}, {"role": "assistant", "content": "ABOT"}],
    [{"role": "user", "content": "reverse baby"}, {"role": "assistant", "content": "ybab"},
     {"role": "user", "content": "and deer?"}],
    [{"role": "user", "content": "uppercase yarn"}],
]


def write_jsonl(folder: Path, lines: list[str]) -> Path:
    path = folder / "eval.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path, [json.dumps({"messages": m}) for m in CONVERSATIONS])


def test_a_conversation_is_its_messages_before_its_last_assistant_turn(chat_file: Path):
    prompts = prompts_from(chat_file)
    assert prompts == [CONVERSATIONS[0][:4], CONVERSATIONS[1], CONVERSATIONS[2]]
    assert [prompt_text(p) for p in prompts] == ["sort the letters of boat", "and deer?", "uppercase yarn"]


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
def test_max_prompts_keeps_the_first_conversations(chat_file: Path, limit: int):
    prompts = bench_prompts((), chat_file, max_prompts=limit)
    assert [prompt_text(p) for p in prompts] == [prompt_text(p) for p in prompts_from(chat_file)][:limit]


def test_strings_come_first_then_the_file_and_the_defaults_without_either(chat_file: Path):
    prompts = bench_prompts(["hi"], chat_file, max_prompts=1)
    assert prompts == ([{"role": "user", "content": "hi"}], CONVERSATIONS[0][:4])
    assert [prompt_text(p) for p in bench_prompts()] == list(DEFAULT_PROMPTS)
    assert all(len(p) == 1 for p in bench_prompts())
    with pytest.raises(UserError, match="--max-prompts: give --prompts-from"):
        bench_prompts(["hi"], max_prompts=2)


GOOD = json.dumps({"messages": CONVERSATIONS[2]})


@pytest.mark.parametrize("lines, expected", [
    pytest.param([GOOD, GOOD, "{not json"], r"--prompts-from .*eval\.jsonl:3: invalid JSON", id="not-json"),
    pytest.param([GOOD, json.dumps({"text": "hi"})], r"--prompts-from .*eval\.jsonl:2: missing `messages`",
                 id="no-messages"),
    pytest.param([json.dumps({"messages": [SYSTEM, {"role": "assistant", "content": "A"}]})],
                 r"--prompts-from .*eval\.jsonl:1: no user turn to answer", id="no-user-turn"),
    pytest.param([], r"--prompts-from .*eval\.jsonl: no conversations", id="empty"),
])
def test_bad_lines_name_the_file_and_line(tmp_path: Path, lines: list[str], expected: str):
    path = write_jsonl(tmp_path, lines)
    with pytest.raises(UserError, match=expected) as caught:
        prompts_from(path)
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_named(tmp_path: Path):
    with pytest.raises(UserError, match=r"--prompts-from .*missing\.jsonl: no such file"):
        prompts_from(tmp_path / "missing.jsonl")


def test_the_drafts_take_turns_on_each_prompt(monkeypatch, tmp_path: Path):
    """Each prompt is answered by every draft in turn, `repeats` times, so a drift of the machine's
    speed falls on all drafts alike; each draft's time is the sum of its per-prompt medians."""
    import types

    import ligertune.bench.decode as decode
    import ligertune.inference as inference
    from ligertune.decoding import DecodeStats

    calls = []

    def reply(model, tokenizer, messages, *, max_new_tokens, draft):
        calls.append((prompt_text(messages), draft or "none"))
        seconds = {"none": 0.3, "ngram": 0.1}[draft or "none"] * len(calls)  # the machine slows down
        return inference.Reply(text="ok", prompt_tokens=5, completion_tokens=3, finish_reason="stop", seconds=seconds,
                               stats=DecodeStats.plain(3))

    loaded = types.SimpleNamespace(model=None, tokenizer=None, device=types.SimpleNamespace(type="cpu"),
                                   dtype="torch.float32", source=types.SimpleNamespace(model_dir=tmp_path))
    monkeypatch.setattr(inference, "load_for_inference", lambda path, **kw: loaded)
    monkeypatch.setattr(inference, "require_chat_template", lambda loaded: None)
    monkeypatch.setattr(inference, "generate_reply", reply)
    monkeypatch.setattr(decode, "make_drafter", lambda name, **kw: name)
    config = decode.DecodeBenchConfig(drafts=("none", "ngram"), prompts=bench_prompts(["a", "b"]),
                                      repeats=2, warmup=1)
    report = decode.run_decode_bench(tmp_path, config, log=lambda line: None)
    timed = calls[2:]  # after one warm-up answer per draft
    assert timed == [("a", "none"), ("a", "ngram")] * 2 + [("b", "none"), ("b", "ngram")] * 2
    assert [r.draft for r in report.rows] == ["none", "ngram"]
    # calls 3-6 answer "a", 7-10 "b": the median of calls 3 and 5 plus that of 7 and 9 for `none`
    assert report.rows[0].seconds == pytest.approx(0.3 * (4 + 8))
    assert report.rows[1].seconds == pytest.approx(0.1 * (5 + 9))

