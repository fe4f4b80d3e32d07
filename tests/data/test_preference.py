"""Preference data: formats and their detection, units with exact scored spans over several chat
templates, the length policy, and packs of whole units.

Two oracles, independent of the unit code: each answer's own conversation through the SFT path
(`tokenize_conversation`), which the unit must reproduce token for token, and hand-written scored
text per template. The packs are checked against a loop over the answers' own conversations: a tiny
attention model gives the same log-probability sums either way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import types
from pathlib import Path

import pytest
import torch
from chat_fixtures import make_tokenizer, write_jsonl
from transformers import AutoTokenizer

from ligertune import hub
from ligertune.data import (
    IGNORE_INDEX,
    KTOExample,
    PreferenceExample,
    PreferencePair,
    UnpairedPreference,
    load_preferences,
    pack_preferences,
    packing_stats,
    read_preferences,
    tokenize_conversation,
    tokenize_preference,
    tokenize_preferences,
    unpair,
)
from ligertune.data import preference as preference_module
from ligertune.data.chat import render
from ligertune.data.formats import RecordError, detect_format, detect_preference_format
from ligertune.data.preference import make_preference_pack, mismatch_completions, varlen_segments
from ligertune.errors import DataError

QUICKSTART_TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}
PROMPT = [SYSTEM, user("Say hi"), assistant("Hello there!"), user("What is two plus two?")]
CHOSEN, REJECTED = "Two plus two is four.", "Cats sleep all day, then they sleep some more."
PAIR = PreferencePair(PROMPT, [assistant(CHOSEN)], [assistant(REJECTED)])

# (name, family, kind): the bundled quick-start tokenizer and the fixture families.
TEMPLATES = [
    pytest.param("quickstart", id="quickstart"),
    *(pytest.param(f"{family}/{kind}", id=f"{family}-{kind}")
      for family in ("chatml", "llama3", "mistral", "gemma") for kind in ("bytelevel", "metaspace")),
    *(pytest.param(f"{family}/bytelevel", id=family)
      for family in ("chatml_last_system", "mistral_last_system", "chatml_think")),
]

# What each template scores of an answer A (bytelevel tokenizers decode back to the exact text).
SCORED = {
    "quickstart": "{}<|im_end|>",
    "chatml/bytelevel": "{}<|im_end|>",
    "llama3/bytelevel": "{}<|eot_id|>",
    "mistral/bytelevel": " {}</s>",
    "gemma/bytelevel": "{}<end_of_turn>",
    "chatml_last_system/bytelevel": "{}<|im_end|>",
    "mistral_last_system/bytelevel": "{}</s>",
    "chatml_think/bytelevel": "<think>\n\n</think>\n\n{}<|im_end|>",
}


@pytest.fixture(scope="module")
def tokenizers():
    cache = {}

    def get(name: str):
        if name not in cache:
            if name == "quickstart":
                cache[name] = AutoTokenizer.from_pretrained(str(QUICKSTART_TOKENIZER))
            else:
                cache[name] = make_tokenizer(*name.split("/"))
        return cache[name]

    return get


def scored_text(tokenizer, unit, answer: int) -> str:
    start, end = unit.answer_spans[answer]
    return tokenizer.decode([unit.input_ids[i] for i in range(start, end) if unit.labels[i] != IGNORE_INDEX],
                            skip_special_tokens=False, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------------------
# Units: exact ids, scored tokens and positions


@pytest.mark.parametrize("name", TEMPLATES)
def test_prompt_plus_each_answer_is_that_conversation_tokenized_whole(tokenizers, name):
    tokenizer = tokenizers(name)
    unit = tokenize_preference(tokenizer, PAIR)
    p = unit.prompt_len
    assert isinstance(unit, PreferenceExample)
    assert unit.labels[:p] == [IGNORE_INDEX] * p
    for answer, (start, end) in zip(PAIR.answers, unit.answer_spans):
        alone = tokenize_conversation(tokenizer, PROMPT + answer, train_on="last_assistant")
        assert unit.input_ids[:p] + unit.input_ids[start:end] == alone.input_ids
        assert [IGNORE_INDEX] * p + unit.labels[start:end] == alone.labels
        assert alone.trained_tokens > 0
    assert len(unit) == p + unit.chosen_len + unit.rejected_len
    assert unit.position_ids == [*range(p), *range(p, p + unit.chosen_len), *range(p, p + unit.rejected_len)]


@pytest.mark.parametrize("name", [n for n in SCORED])
def test_scored_tokens_are_each_answer_and_its_end_of_turn(tokenizers, name):
    tokenizer = tokenizers(name)
    unit = tokenize_preference(tokenizer, PAIR)
    assert scored_text(tokenizer, unit, 0) == SCORED[name].format(CHOSEN)
    assert scored_text(tokenizer, unit, 1) == SCORED[name].format(REJECTED)
    # The prompt is the prompt's own rendering up to the generation prompt, nothing of an answer.
    prompt = tokenizer.decode(unit.input_ids[: unit.prompt_len], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False)
    assert prompt == render(tokenizer, PROMPT, add_generation_prompt=True)


def test_the_drawn_layout():
    """The module docstring's example: the first token of both answers is predicted from row 2."""
    p0, p1, p2, c0, c1, c2, r0, r1 = range(10, 18)
    unit = PreferenceExample(input_ids=[p0, p1, p2, c0, c1, c2, r0, r1],
                             labels=[IGNORE_INDEX] * 3 + [c0, c1, c2, r0, r1],
                             prompt_len=3, answer_lens=(3, 2))
    assert unit.position_ids == [0, 1, 2, 3, 4, 5, 3, 4]
    assert unit.scores() == [(2, c0, 0), (3, c1, 0), (4, c2, 0), (2, r0, 1), (6, r1, 1)]
    rows = ["10000000",  # p0      query rows; key columns p0 p1 p2 c0 c1 c2 r0 r1
            "11000000",  # p1
            "11100000",  # p2
            "11110000",  # c0: the prompt and itself
            "11111000",  # c1
            "11111100",  # c2
            "11100010",  # r0: the prompt and itself, not the chosen answer
            "11100011"]  # r1
    expected = torch.tensor([[c == "1" for c in row] for row in rows])
    pack = make_preference_pack([unit], [0])
    assert torch.equal(pack.attention_mask(), expected)
    assert torch.equal(varlen_mask(pack), expected)


def test_answers_that_open_alike_keep_their_shared_words(chatml):
    """Tokens shared by both answers stay in each answer (scored there), never in the prompt."""
    pair = PreferencePair([user("What is two plus two?")], [assistant("The answer is four.")],
                          [assistant("The answer is five.")])
    unit = tokenize_preference(chatml, pair)
    assert scored_text(chatml, unit, 0) == "The answer is four.<|im_end|>"
    assert scored_text(chatml, unit, 1) == "The answer is five.<|im_end|>"
    assert chatml.decode(unit.input_ids[: unit.prompt_len]).endswith("<|im_start|>assistant\n")


def test_multi_turn_answer_scores_its_assistant_turns_only(chatml):
    tool = {"role": "tool", "content": "sunny, 21 degrees"}
    chosen = [assistant("Let me look."), tool, assistant("It is sunny.")]
    pair = PreferencePair([user("What is the weather?")], chosen, [assistant("No idea.")])
    unit = tokenize_preference(chatml, pair)
    start, end = unit.answer_spans[0]
    runs, run = [], []
    for i in range(start, end):
        if unit.labels[i] != IGNORE_INDEX:
            run.append(unit.input_ids[i])
        elif run:
            runs.append(chatml.decode(run))
            run = []
    assert runs == ["Let me look.<|im_end|>", "It is sunny.<|im_end|>"]
    assert scored_text(chatml, unit, 1) == "No idea.<|im_end|>"


@pytest.mark.parametrize("name", ["quickstart", "llama3/bytelevel", "mistral/bytelevel"])
def test_kto_unit_is_its_conversation_with_the_completion_scored(tokenizers, name):
    tokenizer = tokenizers(name)
    record = UnpairedPreference(PROMPT, [assistant(REJECTED)], desirable=False)
    unit = tokenize_preference(tokenizer, record)
    alone = tokenize_conversation(tokenizer, PROMPT + record.completion, train_on="last_assistant")
    assert isinstance(unit, KTOExample) and unit.desirable is False
    assert unit.input_ids == alone.input_ids
    assert unit.labels == alone.labels
    assert unit.position_ids == list(range(len(unit)))
    assert unit.prompt_len + unit.completion_len == len(unit)
    assert unit.labels[: unit.prompt_len] == [IGNORE_INDEX] * unit.prompt_len
    assert scored_text(tokenizer, unit, 0) == SCORED.get(name, "{}<|im_end|>").format(REJECTED)


@pytest.mark.parametrize("name", ["quickstart", "llama3/bytelevel", "mistral/bytelevel"])
def test_kto_unit_with_a_mismatched_completion_is_laid_out_as_a_pair(tokenizers, name):
    """prompt + completion + mismatched completion: each answer after the prompt is its own
    conversation, token for token; positions continue from the prompt for both."""
    tokenizer = tokenizers(name)
    record = UnpairedPreference(PROMPT, [assistant(CHOSEN)], desirable=True, mismatched=[assistant(REJECTED)])
    unit = tokenize_preference(tokenizer, record)
    p = unit.prompt_len
    assert isinstance(unit, KTOExample) and unit.desirable is True and len(unit.answer_lens) == 2
    for answer, (start, end) in zip(record.answers, unit.answer_spans):
        alone = tokenize_conversation(tokenizer, PROMPT + answer, train_on="last_assistant")
        assert unit.input_ids[:p] + unit.input_ids[start:end] == alone.input_ids
        assert [IGNORE_INDEX] * p + unit.labels[start:end] == alone.labels
    completion, mismatched = unit.answer_lens
    assert unit.position_ids == [*range(p), *range(p, p + completion), *range(p, p + mismatched)]
    assert scored_text(tokenizer, unit, 1) == SCORED.get(name, "{}<|im_end|>").format(REJECTED)


def test_mismatched_completions_are_another_records_each_used_once():
    records = [UnpairedPreference([user(f"q{i}")], [assistant(f"a{i}")], i % 2 == 0) for i in range(7)]
    mismatched = mismatch_completions(records, random.Random("seed"))
    assert [r.completion for r in mismatched] == [r.completion for r in records]
    assert all(r.mismatched != r.completion for r in mismatched)
    assert sorted(r.mismatched[0]["content"] for r in mismatched) == [f"a{i}" for i in range(7)]
    assert mismatched == mismatch_completions(records, random.Random("seed"))  # fixed by the seed
    assert mismatched != mismatch_completions(records, random.Random("another seed"))
    two = mismatch_completions(records[:2], random.Random(0))
    assert [r.mismatched for r in two] == [records[1].completion, records[0].completion]
    with pytest.raises(ValueError, match="at least 2"):
        mismatch_completions(records[:1], random.Random(0))


def test_kto_loading_unpairs_pairs_and_gives_each_example_a_mismatched_completion(tmp_path, chatml):
    path = write_jsonl(tmp_path / "prefs.jsonl", [pair_record(i) for i in range(3)])
    units = load_preferences(str(path), chatml, max_seq_len=4096, kto=True, seed=5).units
    assert [u.desirable for u in units] == [True, False] * 3
    assert all(isinstance(u, KTOExample) and len(u.answer_lens) == 2 for u in units)
    completions = sorted(tuple(u.input_ids[slice(*u.answer_spans[0])]) for u in units)
    mismatched = sorted(tuple(u.input_ids[slice(*u.answer_spans[1])]) for u in units)
    assert mismatched == completions  # every completion serves once as another example's
    again = load_preferences(str(path), chatml, max_seq_len=4096, kto=True, seed=5).units
    assert [u.input_ids for u in again] == [u.input_ids for u in units]


def test_kto_refuses_a_file_of_one_example(tmp_path, chatml):
    path = write_jsonl(tmp_path / "one.jsonl", [GOOD["unpaired"]])
    with pytest.raises(DataError, match=r"one.jsonl: KTO needs at least 2 examples .*; it has 1$"):
        load_preferences(str(path), chatml, max_seq_len=256, kto=True)
    assert len(load_preferences(str(path), chatml, max_seq_len=256).units) == 1  # read alone, it is one unit


def test_the_system_prompt_opens_every_prompt_without_one(tmp_path, chatml):
    path = write_jsonl(tmp_path / "prefs.jsonl", [pair_record(0), pair_record(1)])
    records = read_preferences(str(path)).records
    units = load_preferences(str(path), chatml, max_seq_len=4096, system_prompt="Be kind.").units
    for record, unit in zip(records, units):
        system = [] if record.prompt[0]["role"] == "system" else [{"role": "system", "content": "Be kind."}]
        expected = tokenize_preference(chatml, dataclasses.replace(record, prompt=system + record.prompt))
        assert unit.input_ids == expected.input_ids and unit.labels == expected.labels


def test_unpair_makes_two_kto_records():
    assert unpair([PAIR]) == [UnpairedPreference(PROMPT, PAIR.chosen, True),
                              UnpairedPreference(PROMPT, PAIR.rejected, False)]


TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": '{"x": "2+2"}'}}]}


def test_a_pair_s_tools_reach_its_prompt_and_each_answer_is_its_conversation_with_them(tmp_path):
    tokenizer = make_tokenizer("chatml_tools")
    record = {"prompt": [user("What is 2+2?")], "chosen": [CALL], "rejected": [assistant(REJECTED)],
              "tools": TOOLS}
    path = write_jsonl(tmp_path / "prefs.jsonl", [record, record])
    pair = read_preferences(str(path)).records[0]
    assert pair.tools == TOOLS
    unit = tokenize_preference(tokenizer, pair)
    p = unit.prompt_len
    assert '"calculator"' in tokenizer.decode(unit.input_ids[:p])
    for answer, (start, end) in zip(pair.answers, unit.answer_spans):
        alone = tokenize_conversation(tokenizer, pair.prompt + answer, train_on="last_assistant", tools=TOOLS)
        assert unit.input_ids[:p] + unit.input_ids[start:end] == alone.input_ids
        assert [IGNORE_INDEX] * p + unit.labels[start:end] == alone.labels
    assert scored_text(tokenizer, unit, 0) == (
        '<tool_call>{"name": "calculator", "arguments": {"x": "2+2"}}</tool_call><|im_end|>')
    kto = load_preferences(str(path), tokenizer, max_seq_len=4096, kto=True).units
    assert all('"calculator"' in tokenizer.decode(u.input_ids[:u.prompt_len]) for u in kto)
    with pytest.raises(DataError, match=r"prefs.jsonl:1: the record has `tools`, which the chat template"):
        load_preferences(str(path), make_tokenizer("chatml"), max_seq_len=4096)


# --------------------------------------------------------------------------------------------------
# Formats, detection, bad records


Q = "What is two plus two?"
UF_ROW = {  # UltraFeedback-binarized: a `prompt` string beside whole conversations, and more keys
    "prompt": Q,
    "prompt_id": "abc123",
    "chosen": [user(Q), assistant(CHOSEN)],
    "rejected": [user(Q), assistant(REJECTED)],
    "messages": [user(Q), assistant(CHOSEN)],
    "score_chosen": 9.0,
    "score_rejected": 2.0,
}
ONE_TURN = PreferencePair([user(Q)], [assistant(CHOSEN)], [assistant(REJECTED)])
LONGER = [assistant(CHOSEN), user("Sure?"), assistant("Yes.")]


@pytest.mark.parametrize("record, fmt, expected", [
    pytest.param({"prompt": Q, "chosen": CHOSEN, "rejected": REJECTED}, "paired", ONE_TURN,
                 id="paired-strings"),
    pytest.param({"prompt": Q, "system": "Be brief.", "chosen": CHOSEN, "rejected": REJECTED}, "paired",
                 PreferencePair([SYSTEM, user(Q)], [assistant(CHOSEN)], [assistant(REJECTED)]),
                 id="paired-system"),
    pytest.param({"prompt": PROMPT, "chosen": [assistant(CHOSEN)], "rejected": [assistant(REJECTED)]},
                 "paired", PAIR, id="paired-messages-multi-turn"),
    pytest.param({"chosen": PROMPT + [assistant(CHOSEN)], "rejected": PROMPT + [assistant(REJECTED)]},
                 "paired_conversations", PAIR, id="trl-conversations"),
    pytest.param({"chosen": PROMPT + LONGER, "rejected": PROMPT + [assistant(REJECTED)]},
                 "paired_conversations", PreferencePair(PROMPT, LONGER, [assistant(REJECTED)]),
                 id="trl-multi-turn-answer"),
    pytest.param(UF_ROW, "paired_conversations", ONE_TURN, id="ultrafeedback"),
    pytest.param({"prompt": Q, "completion": REJECTED, "label": False}, "unpaired",
                 UnpairedPreference([user(Q)], [assistant(REJECTED)], False), id="kto-strings"),
    pytest.param({"prompt": PROMPT, "completion": [assistant(CHOSEN)], "label": True}, "unpaired",
                 UnpairedPreference(PROMPT, [assistant(CHOSEN)], True), id="kto-messages"),
])
def test_formats_are_detected_and_normalized(tmp_path, record, fmt, expected):
    assert detect_preference_format(record) == fmt
    path = write_jsonl(tmp_path / "prefs.jsonl", [record, record])
    result = read_preferences(str(path))
    assert result.format == fmt
    assert result.records[0] == dataclasses.replace(expected, origin=f"{path}:1")
    assert [r.origin for r in result.records] == [f"{path}:1", f"{path}:2"]


def test_ultrafeedback_prompt_beside_conversations_is_not_read(tmp_path):
    """The `prompt` string is not the prompt: the conversations' shared messages are."""
    row = dict(UF_ROW, prompt="something else entirely")
    assert detect_preference_format(row) == "paired_conversations"
    (pair,) = read_preferences(str(write_jsonl(tmp_path / "uf.jsonl", [row]))).records
    assert pair.prompt == [user(Q)]


def test_sft_detection_is_unchanged_and_names_preference_pairs():
    assert detect_format(UF_ROW) == "messages"
    assert detect_format({"prompt": "Hi", "completion": "Hello", "label": True}) == "prompt_completion"
    with pytest.raises(RecordError, match="preference pairs, which supervised fine-tuning does not read"):
        detect_format({"chosen": [], "rejected": []})
    with pytest.raises(RecordError, match="cannot tell the preference format.*chat data for supervised"):
        detect_preference_format({"messages": []})


def talk(*messages: dict) -> list[dict]:
    return list(messages)


GOOD = {
    "paired": {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."},
    "paired_conversations": {"chosen": talk(user("Hi"), assistant("a")),
                             "rejected": talk(user("Hi"), assistant("b"))},
    "unpaired": {"prompt": "Hi", "completion": "a", "label": True},
}
NO_PROMPT = "`chosen` and `rejected` share no prompt: their first messages differ"
LABEL = "`label` must be true (desirable) or false (undesirable), got"


@pytest.mark.parametrize("bad, fmt, problem", [
    pytest.param("{not json", "paired",
                 "invalid JSON: Expecting property name enclosed in double quotes (column 2)", id="json"),
    pytest.param([1], "paired", "expected a JSON object, got a list", id="not-object"),
    pytest.param({"prompt": "Hi", "chosen": "a"}, "paired", "missing `rejected` (format paired)",
                 id="missing"),
    pytest.param({"prompt": [], "chosen": "a", "rejected": "b"}, "paired", "`prompt` is empty",
                 id="empty-prompt"),
    pytest.param({"prompt": 3, "chosen": "a", "rejected": "b"}, "paired",
                 "`prompt` must be a string or a list of messages, got int", id="prompt-type"),
    pytest.param({"prompt": "Hi", "chosen": [{"role": "bot", "content": "x"}], "rejected": "b"}, "paired",
                 "`chosen` message 1 has unknown role 'bot' (expected system, user, assistant, tool)",
                 id="role"),
    pytest.param({"prompt": "Hi", "chosen": talk(user("Hi"), assistant("x")), "rejected": "b"}, "paired",
                 "`chosen` must open with an assistant message, got a user message (whole conversations are "
                 "format paired_conversations)", id="answer-opens-with-user"),
    pytest.param({"prompt": "Hi", "chosen": "a", "rejected": talk(assistant("a"))}, "paired",
                 "`chosen` and `rejected` are the same answer", id="same-answer"),
    pytest.param({"prompt": "Hi", "chosen": "a", "rejected": talk(assistant("x"), SYSTEM)}, "paired",
                 "`rejected` message 2: a system message may only open the prompt", id="system-in-answer"),
    pytest.param({"prompt": talk(user("Hi"), SYSTEM), "chosen": "a", "rejected": "b"}, "paired",
                 "`prompt` message 2: a system message may only come first", id="system-late-in-prompt"),
    pytest.param({"chosen": talk(user("Hi"), assistant("a")), "rejected": talk(user("Hey"), assistant("b"))},
                 "paired_conversations", NO_PROMPT, id="no-shared-prefix"),
    pytest.param({"chosen": talk(assistant("a")), "rejected": talk(assistant("b"))},
                 "paired_conversations", NO_PROMPT, id="answers-only"),
    pytest.param({"chosen": talk(user("Hi"), assistant("a")), "rejected": talk(user("Hi"), user("b"))},
                 "paired_conversations", "the conversations first differ at message 2, a user message in "
                 "`rejected`: each answer must open with an assistant message", id="answer-not-assistant"),
    pytest.param({"chosen": talk(user("Hi"), assistant("a")), "rejected": talk(user("Hi"), assistant("a"))},
                 "paired_conversations", "`chosen` and `rejected` are the same conversation", id="identical"),
    pytest.param({"chosen": talk(user("Hi")), "rejected": talk(user("Hi"), assistant("a"))},
                 "paired_conversations",
                 "`chosen` has no answer: every one of its messages opens `rejected` too", id="no-answer"),
    pytest.param({"chosen": "a", "rejected": "b"}, "paired_conversations",
                 "`chosen` must be a whole conversation (a list of messages), got a string",
                 id="strings-no-prompt"),
    pytest.param({"prompt": "Hi", "completion": "a", "label": 1}, "unpaired", f"{LABEL} 1", id="label-int"),
    pytest.param({"prompt": "Hi", "completion": "a", "label": "good"}, "unpaired", f"{LABEL} 'good'",
                 id="label-str"),
    pytest.param({"prompt": "Hi", "chosen": "a", "rejected": "b", "tools": "[{"}, "paired",
                 "`tools` is a string but no JSON list", id="tools-not-json"),
])
def test_bad_record_names_file_and_line(tmp_path, bad, fmt, problem):
    path = write_jsonl(tmp_path / "prefs.jsonl", [GOOD[fmt], bad, GOOD[fmt]])
    with pytest.raises(DataError) as err:
        read_preferences(str(path))
    assert str(err.value) == f"{path}:2: {problem}"
    skipped = read_preferences(str(path), on_bad_record="skip")
    assert (len(skipped.records), skipped.read, skipped.bad) == (2, 3, [f"{path}:2: {problem}"])


def test_an_undetectable_first_record(tmp_path):
    path = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "Hi", "completion": "a"}])
    with pytest.raises(DataError, match=r"prefs.jsonl:1: cannot tell the preference format: .*got keys "
                                        r"prompt, completion \(chat data for supervised fine-tuning"):
        read_preferences(str(path))


def test_template_rejection_names_file_and_line(tmp_path, tokenizer_factory):
    """Mistral's template wants alternating roles: the record is named, not a traceback."""
    tokenizer = tokenizer_factory("mistral", "bytelevel")
    bad = {"prompt": [user("Hi"), user("Hello?")], "chosen": "a", "rejected": "b"}
    path = write_jsonl(tmp_path / "prefs.jsonl", [GOOD["paired"], bad])
    rejected = r"prefs.jsonl:2: the chat template rejects this conversation: .*alternate"
    with pytest.raises(DataError, match=rejected):
        load_preferences(str(path), tokenizer, max_seq_len=256)
    prepared = load_preferences(str(path), tokenizer, max_seq_len=256, on_bad_record="skip")
    assert len(prepared.units) == 1 and prepared.stats.bad_records == 1
    assert prepared.stats.bad_record_examples[0].startswith(f"{path}:2: the chat template rejects")


def test_parquet_rows(tmp_path, chatml):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "prefs.parquet"
    bad = dict(UF_ROW, rejected=[user("Other question"), assistant(REJECTED)])
    pq.write_table(pa.Table.from_pylist([UF_ROW, bad, UF_ROW]), path)
    prepared = load_preferences(str(path), chatml, max_seq_len=256, on_bad_record="skip")
    assert [u.origin for u in prepared.units] == [f"{path}:row 1", f"{path}:row 3"]
    assert prepared.stats.bad_record_examples == [
        f"{path}:row 2: `chosen` and `rejected` share no prompt: their first messages differ"]


@pytest.fixture()
def hub_online(monkeypatch):
    """The hub answers (without asking it: tests use no network)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "probe_hub", lambda: None)


def test_hub_dataset_in_ultrafeedback_layout(monkeypatch, hub_online):
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [UF_ROW, UF_ROW]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    result = read_preferences("someone/ultrafeedback", split="train_prefs")
    assert calls == [("someone/ultrafeedback", "train_prefs")]
    assert result.format == "paired_conversations"
    assert [r.origin for r in result.records] == ["someone/ultrafeedback[train_prefs]:row 1",
                                                  "someone/ultrafeedback[train_prefs]:row 2"]


# --------------------------------------------------------------------------------------------------
# Too long, nothing scored


def pair_record(i: int) -> dict:
    """A paired record varied by `i`: 0-2 earlier exchanges, answers of different lengths."""
    prompt = [SYSTEM] if i % 2 else []
    for t in range(i % 3):
        prompt += [user(f"Question {i}.{t}?"), assistant(f"Answer {t}." + " Thanks!" * t)]
    prompt.append(user(f"What is {i} plus {i}?"))
    return {"prompt": prompt, "chosen": f"It is {2 * i}." + " Thanks!" * (i % 4),
            "rejected": [assistant("Cats sleep all day." * (1 + i % 3))]}


def test_too_long_units_are_dropped_and_counted(tmp_path, chatml):
    path = write_jsonl(tmp_path / "prefs.jsonl", [pair_record(i) for i in range(12)])
    everything = load_preferences(str(path), chatml, max_seq_len=4096)
    lengths = sorted(len(u) for u in everything.units)
    limit = lengths[len(lengths) // 2]
    prepared = load_preferences(str(path), chatml, max_seq_len=limit)
    too_long = sum(n > limit for n in lengths)
    assert too_long > 0
    assert prepared.stats.dropped == {"too_long": too_long}
    assert prepared.stats.kept == len(prepared.units) == 12 - too_long
    assert all(len(u) <= limit for u in prepared.units)
    assert f"{too_long} dropped (too_long {too_long})" in prepared.stats.summary()
    assert prepared.stats.scored_tokens == sum(sum(u.scored_tokens()) for u in prepared.units)


def test_a_huge_answer_is_dropped_without_tokenizing_it_whole(monkeypatch, chatml):
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized whole")

    monkeypatch.setattr(preference_module, "tokenize_preference", refuse)
    huge = PreferencePair([user("Hi")], [assistant("Thanks! " * 50_000)], [assistant("Hello")], origin="x:1")
    prepared = tokenize_preferences([huge], chatml, max_seq_len=64)
    assert prepared.units == [] and prepared.stats.dropped == {"too_long": 1}


def test_an_answer_with_nothing_scored_is_dropped(tmp_path):
    tokenizer = make_tokenizer("chatml")  # a private copy: its template is changed
    tokenizer.chat_template = ("{%- for m in messages if m['role'] != 'assistant' -%}"
                               "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
                               "{%- endfor -%}"
                               "{%- if add_generation_prompt -%}<|im_start|>assistant\\n{%- endif -%}")
    path = write_jsonl(tmp_path / "prefs.jsonl", [GOOD["paired"]])
    with pytest.raises(DataError, match=r"prefs.jsonl: no usable preference record among its 1 record "
                                        r"\(no trained tokens: 1\)"):
        load_preferences(str(path), tokenizer, max_seq_len=256)


# --------------------------------------------------------------------------------------------------
# Packs


def units_for(tokenizer, n: int = 14, kto: bool = False):
    records = [preference_module.normalize_preference(pair_record(i), "paired") for i in range(n)]
    if kto:
        records = unpair(records)
    return tokenize_preferences(records, tokenizer, max_seq_len=4096).units


def varlen_mask(pack) -> torch.Tensor:
    """The mask the varlen description gives: causal aligned to the end of each segment's keys."""
    v = pack.varlen()
    mask = torch.zeros(len(pack), len(pack), dtype=torch.bool)
    for s in range(len(v.cu_seqlens_q) - 1):
        rows = range(v.cu_seqlens_q[s], v.cu_seqlens_q[s + 1])
        keys = v.key_index[v.cu_seqlens_k[s] : v.cu_seqlens_k[s + 1]]
        for j, row in enumerate(rows):
            for key in keys[: len(keys) - len(rows) + j + 1]:
                mask[row, key] = True
    assert v.max_seqlen_q == max(b - a for a, b in zip(v.cu_seqlens_q, v.cu_seqlens_q[1:]))
    return mask


def test_a_prompt_and_its_first_answer_are_one_causal_segment():
    """The module docstring's pair (prompt p0..p2, answers c0..c2 and r0 r1), then a unit of one
    answer and a stand-in unit with none: the first answer shares its prompt's causal segment, so the
    prompt's keys are gathered once more for the second answer only, and no segment is empty."""
    v = varlen_segments([3, 2, 1], [(3, 2), (4,), ()])
    assert v.cu_seqlens_q == [0, 6, 8, 14, 15]
    assert v.cu_seqlens_k == [0, 6, 11, 17, 18]
    assert v.key_index == [0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7, *range(8, 14), 14]
    assert (v.max_seqlen_q, v.max_seqlen_k) == (6, 6)


@pytest.mark.parametrize("kto", [False, True], ids=["pairs", "kto"])
def test_packs_hold_whole_units(chatml, kto):
    units = units_for(chatml, kto=kto)
    max_seq_len = 2 * max(len(u) for u in units) + 7
    packs = pack_preferences(units, max_seq_len)
    assert len(packs) < len(units)
    assert sorted(i for p in packs for i in p.example_indices) == list(range(len(units)))
    for pack in packs:
        assert len(pack) <= max_seq_len
        rows, targets, answers, n_answers = [], [], [], 0
        for offset, i in zip(pack.cu_seqlens, pack.example_indices):
            unit = units[i]
            assert pack.input_ids[offset : offset + len(unit)] == unit.input_ids
            assert pack.position_ids[offset : offset + len(unit)] == unit.position_ids
            for row, target, answer in unit.scores():
                rows.append(offset + row)
                targets.append(target)
                answers.append(n_answers + answer)
            n_answers += len(unit.answer_lens)
        assert (pack.score_rows, pack.score_targets, pack.score_answers) == (rows, targets, answers)
        assert pack.num_answers == n_answers == len(pack.seq_lens) * (1 if kto else 2)
        assert pack.desirable == ([units[i].desirable for i in pack.example_indices] if kto else None)
        assert torch.equal(pack.attention_mask(), varlen_mask(pack))
    stats = packing_stats(packs, max_seq_len)
    assert stats.real_tokens == sum(len(u) for u in units)
    assert stats.trained_tokens == sum(sum(u.scored_tokens()) for u in units)


def test_pack_refuses_too_long_and_mixed_units(chatml):
    units = units_for(chatml, n=3)
    with pytest.raises(ValueError, match="more than max_seq_len"):
        pack_preferences(units, len(units[0]) - 1)
    kto = units_for(chatml, n=1, kto=True)
    with pytest.raises(ValueError, match="separate packs"):
        pack_preferences(units + kto, 4096)
    assert [p.example_indices for p in pack_preferences(units, 4096, packing=False)] == [[0], [1], [2]]


class TinyLM(torch.nn.Module):
    """Two attention layers with learned absolute positions: enough to see a wrong position, mask or row."""

    def __init__(self, vocab: int, dim: int = 16, positions: int = 1024):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(positions, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: list[int], positions: list[int], mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(torch.tensor(ids)) + self.pos(torch.tensor(positions))
        for qkv in self.qkv:
            q, k, v = qkv(h).chunk(3, dim=-1)
            scores = (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
            h = h + scores.softmax(-1) @ v
        return self.head(h).log_softmax(-1)


@pytest.mark.parametrize("name", ["quickstart", "mistral/bytelevel", "gemma/metaspace"])
@pytest.mark.parametrize("kto, mismatched", [(False, False), (True, False), (True, True)],
                         ids=["pairs", "kto", "kto-mismatched"])
def test_packed_log_prob_sums_equal_each_answer_scored_alone(tokenizers, name, kto, mismatched):
    tokenizer = tokenizers(name)
    records = [preference_module.normalize_preference(pair_record(i), "paired") for i in range(9)]
    if kto:
        records = unpair(records)
    if mismatched:
        records = mismatch_completions(records, random.Random(0))
    units = tokenize_preferences(records, tokenizer, max_seq_len=4096).units
    torch.manual_seed(0)
    model = TinyLM(len(tokenizer)).double()

    expected = []  # per record and answer: sum of log p over the answer's trained tokens, alone
    for record in records:
        for answer in record.answers:
            alone = tokenize_conversation(tokenizer, record.prompt + answer, train_on="last_assistant")
            n = len(alone)
            logp = model(alone.input_ids, list(range(n)), torch.ones(n, n, dtype=torch.bool).tril())
            scored = [logp[i - 1, t] for i, t in enumerate(alone.labels) if t != IGNORE_INDEX]
            expected.append(sum(scored).item())

    per_unit = 1 if kto and not mismatched else 2
    got = [None] * len(expected)
    packs = pack_preferences(units, 3 * max(len(u) for u in units))
    assert any(len(p.seq_lens) > 1 for p in packs)
    for pack in packs:
        logp = model(pack.input_ids, pack.position_ids, pack.attention_mask())
        scored = logp[torch.tensor(pack.score_rows), torch.tensor(pack.score_targets)]
        answers = torch.tensor(pack.score_answers)
        sums = torch.zeros(pack.num_answers, dtype=torch.float64).index_add_(0, answers, scored)
        for u, i in enumerate(pack.example_indices):
            for a in range(per_unit):
                got[i * per_unit + a] = sums[u * per_unit + a].item()
    assert got == pytest.approx(expected, rel=1e-12)


def test_stats_round_trip_as_json(tmp_path, chatml):
    path = write_jsonl(tmp_path / "prefs.jsonl", [pair_record(i) for i in range(3)])
    stats = load_preferences(str(path), chatml, max_seq_len=4096).stats
    assert json.loads(json.dumps(stats.to_dict()))["kept"] == 3
