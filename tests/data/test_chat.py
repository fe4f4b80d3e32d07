"""Rendering and masking: exact labels per template family, train_on modes, role rules.

The oracle for each family is the expected rendering written out by hand as segments, each marked
trained or not; a token's expected label is trained when its characters overlap a trained segment.
The implementation finds those segments by diffing prefix renderings, so the two are independent.
"""

from __future__ import annotations

import types

import pytest
from chat_fixtures import make_tokenizer
from transformers import GenerationConfig

from ligertune.data import (IGNORE_INDEX, Conversation, ConversationError, tokenize_conversation,
                            trained_segments)
from ligertune.data.chat import check_renders_tools, encode, turn_end_ids
from ligertune.errors import DataError
from ligertune.inference import stop_token_ids

SYSTEM = "Be brief."
U1, A1 = "Say hi", "Say hi"  # the answer repeats the question word for word
U2 = "Tell me about the assistant role."
A2 = "The user asked the assistant a question, and the model answered."  # role names inside

CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": U1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": U2},
    {"role": "assistant", "content": A2},
]



def im(role: str, content: str) -> str:
    """A whole ChatML message."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def header(role: str) -> str:
    """A Llama-3 role header."""
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


ASK = "<|im_start|>assistant\n"  # ChatML generation prompt

# (text, trained) segments of each family's rendering of CONVERSATION.
EXPECTED = {
    "chatml": [
        (im("system", SYSTEM) + im("user", U1) + ASK, False),
        (f"{A1}<|im_end|>", True),
        ("\n" + im("user", U2) + ASK, False),
        (f"{A2}<|im_end|>", True),
        ("\n", False),
    ],
    "llama3": [
        ("<|begin_of_text|>" + header("system") + f"{SYSTEM}<|eot_id|>" + header("user") + f"{U1}<|eot_id|>"
         + header("assistant"), False),
        (f"{A1}<|eot_id|>", True),
        (f"{header('user')}{U2}<|eot_id|>{header('assistant')}", False),
        (f"{A2}<|eot_id|>", True),
    ],
    "mistral": [
        (f"<s>[INST] {SYSTEM}\n\n{U1} [/INST]", False),
        (f" {A1}</s>", True),
        (f"[INST] {U2} [/INST]", False),
        (f" {A2}</s>", True),
    ],
    "gemma": [
        (f"<bos><start_of_turn>user\n{SYSTEM}\n\n{U1}<end_of_turn>\n<start_of_turn>model\n", False),
        (f"{A1}<end_of_turn>", True),
        (f"\n<start_of_turn>user\n{U2}<end_of_turn>\n<start_of_turn>model\n", False),
        (f"{A2}<end_of_turn>", True),
        ("\n", False),
    ],
    "mistral_last_system": [
        (f"<s>[INST] {U1}[/INST]", False),
        (f"{A1}</s>", True),
        (f"[INST] {SYSTEM}\n\n{U2}[/INST]", False),
        (f"{A2}</s>", True),
    ],
    "chatml_last_system": [
        (im("user", U1) + ASK, False),
        (f"{A1}<|im_end|>", True),
        ("\n" + im("system", SYSTEM) + im("user", U2) + ASK, False),
        (f"{A2}<|im_end|>", True),
        ("\n", False),
    ],
    "chatml_think": [
        (im("system", SYSTEM) + im("user", U1) + ASK, False),
        (f"{A1}<|im_end|>", True),
        ("\n" + im("user", U2) + ASK, False),
        (f"<think>\n\n</think>\n\n{A2}<|im_end|>", True),
        ("\n", False),
    ],
}

KINDS = ["bytelevel", "metaspace"]


def expected_labels(tokenizer, segments, keep=lambda k: True) -> list[int]:
    """Labels from hand-written segments; `keep(k)` selects which trained segments (k-th) count."""
    text = "".join(t for t, _ in segments)
    spans, pos, k = [], 0, 0
    for t, trained in segments:
        if trained:
            if keep(k):
                spans.append((pos, pos + len(t)))
            k += 1
        pos += len(t)
    ids, offsets = encode(tokenizer, text)
    labels = [tok if any(s < b and e > a for a, b in spans) else IGNORE_INDEX
              for tok, (s, e) in zip(ids, offsets)]
    labels[0] = IGNORE_INDEX
    return labels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(EXPECTED))
def test_every_assistant_turn_and_its_end_of_turn_are_trained(tokenizer_factory, family, kind):
    tokenizer = tokenizer_factory(family, kind)
    segments = EXPECTED[family]
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == "".join(t for t, _ in segments), "the hand-written rendering is off"

    example = tokenize_conversation(tokenizer, CONVERSATION)

    assert example.input_ids == encode(tokenizer, rendered)[0]
    assert example.labels == expected_labels(tokenizer, segments)
    assert example.trained_tokens > 0


REPEATED = [{"role": "system", "content": SYSTEM}] + [
    {"role": "user", "content": U1}, {"role": "assistant", "content": A1}] * 3

EXPECTED_REPEATED = {
    "chatml_last_system": [
        (im("user", U1) + ASK, False),
        (f"{A1}<|im_end|>", True),
        ("\n" + im("user", U1) + ASK, False),
        (f"{A1}<|im_end|>", True),
        ("\n" + im("system", SYSTEM) + im("user", U1) + ASK, False),
        (f"{A1}<|im_end|>", True),
        ("\n", False),
    ],
    "mistral_last_system": [
        (f"<s>[INST] {U1}[/INST]", False),
        (f"{A1}</s>", True),
        (f"[INST] {U1}[/INST]", False),
        (f"{A1}</s>", True),
        (f"[INST] {SYSTEM}\n\n{U1}[/INST]", False),
        (f"{A1}</s>", True),
    ],
}


@pytest.mark.parametrize("family", list(EXPECTED_REPEATED))
def test_an_exchange_repeated_word_for_word(tokenizer_factory, family):
    """Each answer is found at its own place, not in the question it repeats nor at a later copy
    (whose preceding text matches the prompt even further back, the system prompt having moved)."""
    tokenizer = tokenizer_factory(family, "bytelevel")
    segments = EXPECTED_REPEATED[family]
    assert tokenizer.apply_chat_template(REPEATED, tokenize=False) == "".join(t for t, _ in segments)
    assert tokenize_conversation(tokenizer, REPEATED).labels == expected_labels(tokenizer, segments)


@pytest.mark.parametrize("family", list(EXPECTED))
def test_input_ids_match_the_templates_own_tokenization(tokenizer_factory, family):
    tokenizer = tokenizer_factory(family, "bytelevel")
    direct = tokenizer.apply_chat_template(CONVERSATION, tokenize=True)
    direct = direct["input_ids"] if hasattr(direct, "keys") else direct
    assert tokenize_conversation(tokenizer, CONVERSATION).input_ids == list(direct)


@pytest.mark.parametrize("family", ["chatml", "llama3", "mistral", "gemma"])
def test_last_assistant_trains_only_the_final_turn(tokenizer_factory, family):
    tokenizer = tokenizer_factory(family, "bytelevel")
    example = tokenize_conversation(tokenizer, CONVERSATION, train_on="last_assistant")
    assert example.labels == expected_labels(tokenizer, EXPECTED[family], keep=lambda k: k == 1)


def test_all_trains_every_token_but_the_first(chatml):
    example = tokenize_conversation(chatml, CONVERSATION, train_on="all")
    assert example.labels[0] == IGNORE_INDEX
    assert example.labels[1:] == example.input_ids[1:]


def test_tool_turns_pass_through_untrained(chatml):
    messages = [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "sunny, 21 degrees"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    example = tokenize_conversation(chatml, messages)
    trained = [text for text, t in trained_segments(chatml, example) if t]
    assert trained == ["Let me look.<|im_end|>", "It is sunny.<|im_end|>"]
    untrained = "".join(text for text, t in trained_segments(chatml, example) if not t)
    assert "<|im_start|>tool\nsunny, 21 degrees<|im_end|>" in untrained


def test_empty_answer_still_trains_its_end_of_turn(chatml):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    example = tokenize_conversation(chatml, messages)
    trained = [tok for tok in example.labels if tok != IGNORE_INDEX]
    assert trained == [chatml.convert_tokens_to_ids("<|im_end|>")]


def test_template_that_trims_content(tokenizer_factory):
    tokenizer = tokenizer_factory("llama3", "bytelevel")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello there!  \n"}]
    example = tokenize_conversation(tokenizer, messages)
    assert [t for t, trained in trained_segments(tokenizer, example) if trained] == ["Hello there!<|eot_id|>"]


def test_answer_first_conversation(chatml):
    messages = [{"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "How are you?"}]
    example = tokenize_conversation(chatml, messages)
    assert [t for t, trained in trained_segments(chatml, example) if trained] == [
        "Hello there!<|im_end|>", "How are you?<|im_end|>"]


def test_no_assistant_turn_leaves_nothing_trained(chatml):
    example = tokenize_conversation(chatml, [{"role": "user", "content": "Hi"}])
    assert example.trained_tokens == 0
    assert all(label == IGNORE_INDEX for label in example.labels)


def test_system_message_only_first(chatml):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."},
                {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ConversationError, match="message 2: a system message may only come first"):
        tokenize_conversation(chatml, messages)


def test_template_errors_become_conversation_errors(tokenizer_factory):
    tokenizer = tokenizer_factory("mistral", "bytelevel")
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ConversationError, match="roles must alternate"):
        tokenize_conversation(tokenizer, messages)


@pytest.mark.parametrize("family, closing", [
    ("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("mistral", "</s>"), ("gemma", "<end_of_turn>"),
    ("chatml_last_system", "<|im_end|>")])
def test_the_turn_end_is_the_special_token_that_closes_an_answer(tokenizer_factory, family, closing):
    tokenizer = tokenizer_factory(family, "bytelevel")
    assert tokenizer.convert_ids_to_tokens(turn_end_ids(tokenizer)) == [closing]


def test_a_template_that_closes_a_turn_in_plain_text_has_no_turn_end():
    tokenizer = make_tokenizer("chatml")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    assert turn_end_ids(tokenizer) == []


def test_chat_stops_at_the_template_s_turn_end_under_another_eos(tokenizer_factory):
    # Gemma's template closes a turn with <end_of_turn>, its EOS is <eos>; a model built from a config
    # names neither in its generation config.
    tokenizer = tokenizer_factory("gemma", "bytelevel")
    model = types.SimpleNamespace(generation_config=GenerationConfig())
    stops = tokenizer.convert_ids_to_tokens(stop_token_ids(model, tokenizer))
    assert stops == ["<eos>", "<end_of_turn>"]


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALLING = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
]


def test_tool_calls_are_trained_and_tools_and_results_are_not(tokenizer_factory):
    tokenizer = tokenizer_factory("chatml_tools", "bytelevel")
    example = tokenize_conversation(tokenizer, CALLING, tools=TOOLS)
    text = tokenizer.decode(example.input_ids)
    assert text.startswith('<|im_start|>system\nTools:\n{"type": "function"')  # the tools reach the text
    trained = tokenizer.decode([t for t in example.labels if t != IGNORE_INDEX])
    assert trained == ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>'
                       "Sunny.<|im_end|>")


def test_data_whose_tools_the_template_leaves_out_is_refused(tokenizer_factory):
    offered = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                           "train.jsonl:4", TOOLS)
    called = Conversation(CALLING, "train.jsonl:7")
    check_renders_tools(tokenizer_factory("chatml_tools", "bytelevel"), [called, offered])
    chatml = tokenizer_factory("chatml", "bytelevel")
    with pytest.raises(DataError, match=r"^train.jsonl:4: the record has `tools`, which the chat template "
                                        r"does not write into the text: use a template that renders them"):
        check_renders_tools(chatml, [called, offered])
    with pytest.raises(DataError, match=r"^train.jsonl:7: the record has `tool_calls`, which"):
        check_renders_tools(chatml, [called])
