"""The bundled quick-start data: reproducible, correct, disjoint, and rendered by its own tokenizer;
the preference pairs of the DPO example: right against plausibly wrong, held-out from held-out."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "recipes" / "quickstart"
SCRIPT = ROOT / "scripts" / "make_quickstart_data.py"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BUNDLED_FILES = (
    "train.jsonl",
    "eval.jsonl",
    "pairs_train.jsonl",
    "pairs_eval.jsonl",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
)


def load_script():
    spec = importlib.util.spec_from_file_location("make_quickstart_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@cache
def conversations(name: str) -> tuple[tuple[dict, ...], ...]:
    with (BUNDLE / name).open(encoding="utf-8") as f:
        return tuple(tuple(json.loads(line)["messages"]) for line in f)


@cache
def pairs(name: str) -> tuple[dict, ...]:
    with (BUNDLE / name).open(encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


@cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLE / "tokenizer"))


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quickstart")
    load_script().main(["--out", str(out)])
    return out


@pytest.mark.parametrize("name", BUNDLED_FILES)
def test_generator_reproduces_the_bundled_files(regenerated: Path, name: str):
    assert (regenerated / name).read_bytes() == (BUNDLE / name).read_bytes(), (
        f"{name} differs from what scripts/make_quickstart_data.py writes: rerun the script"
    )


def test_generator_writes_nothing_else(regenerated: Path):
    written = sorted(str(p.relative_to(regenerated)) for p in regenerated.rglob("*") if p.is_file())
    assert written == sorted(BUNDLED_FILES)


def test_train_and_eval_are_disjoint_and_without_duplicates():
    train, held_out = conversations("train.jsonl"), conversations("eval.jsonl")
    key = lambda messages: json.dumps(messages, sort_keys=True)  # noqa: E731
    train_keys, eval_keys = {key(m) for m in train}, {key(m) for m in held_out}
    assert len(train_keys) == len(train) and len(eval_keys) == len(held_out)
    assert not train_keys & eval_keys
    assert 2000 <= len(train) <= 5000 and 100 <= len(held_out) <= 200


@pytest.mark.parametrize("name", ["train.jsonl", "eval.jsonl"])
def test_conversations_have_the_promised_shape(name: str):
    n_system = 0
    for number, messages in enumerate(conversations(name), 1):
        roles = [m["role"] for m in messages]
        if roles[0] == "system":
            n_system += 1
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2), f"{name}:{number}: role order {roles}"
        assert 2 <= len(roles) // 2 <= 4, f"{name}:{number}: {len(roles) // 2} assistant turns"
        assert all(m["content"] and m["content"] == m["content"].strip() for m in messages)
    assert 0.1 < n_system / len(conversations(name)) < 0.6


# The answer of every question, computed here from the question text alone (independently of the
# generator), so a wrong answer in the data fails the test.
RULES: tuple[tuple[str, object], ...] = (
    (r"reverse (\w+)", lambda w: w[::-1]),
    (r"spell (\w+) backwards", lambda w: w[::-1]),
    (r"uppercase (\w+)", str.upper),
    (r"sort the letters of (\w+)", lambda w: "".join(sorted(w))),
    (r"sort the digits (\d+)", lambda d: "".join(sorted(d))),
    (r"how many letters are in (\w+)\?", lambda w: str(len(w))),
    (r"first letter of (\w+)\?", lambda w: w[0]),
    (r"last letter of (\w+)\?", lambda w: w[-1]),
    (r"say (\w+) (\d) times", lambda w, n: " ".join([w] * int(n))),
    (r"what comes after ([a-y])\?", lambda c: chr(ord(c) + 1)),
    (r"which is bigger, (\d+) or (\d+)\?", lambda a, b: str(max(int(a), int(b)))),
    (r"what is (\d) \+ (\d)\?", lambda a, b: str(int(a) + int(b))),
)
MEMORY = re.compile(r"which word did I give you first\?|what was the word in my first message\?")


def expected_answer(question: str, first_question: str) -> str:
    if MEMORY.fullmatch(question):
        return payload_word(first_question)
    for pattern, answer in RULES:
        match = re.fullmatch(pattern, question)
        if match:
            return answer(*match.groups())
    raise AssertionError(f"no rule for the question {question!r}")


def payload_word(question: str) -> str:
    for pattern, _ in RULES:
        match = re.fullmatch(pattern, question)
        if match and match.group(1).isalpha() and len(match.group(1)) > 1:
            return match.group(1)
    raise AssertionError(f"asked for the first word, but the first question {question!r} has none")


@pytest.mark.parametrize("name", ["train.jsonl", "eval.jsonl"])
def test_every_answer_is_right(name: str):
    for number, messages in enumerate(conversations(name), 1):
        capitals = messages[0]["role"] == "system" and messages[0]["content"] == "Answer in capital letters."
        turns = [m for m in messages if m["role"] != "system"]
        first_question = turns[0]["content"]
        for question, answer in zip(turns[::2], turns[1::2]):
            expected = expected_answer(question["content"], first_question)
            expected = expected.upper() if capitals else expected
            assert answer["content"] == expected, f"{name}:{number}: {question['content']!r}"


def test_every_task_is_in_both_splits():
    def kinds(name: str) -> set[str]:
        return {
            next(p for p, _ in RULES if re.fullmatch(p, m["content"])) if not MEMORY.fullmatch(m["content"]) else "memory"
            for messages in conversations(name)
            for m in messages
            if m["role"] == "user"
        }

    assert kinds("eval.jsonl") == kinds("train.jsonl") == {p for p, _ in RULES} | {"memory"}


def test_tokenizer_special_tokens_are_single_ids():
    tok = tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == [len(tok) - 3, len(tok) - 2, len(tok) - 1]
    assert tok.eos_token_id == ids[2] and tok.pad_token_id == ids[0]
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tok.encode(f"a{token}b", add_special_tokens=False) == [ord("a"), token_id, ord("b")]
    assert 256 < len(tok) <= 512


@pytest.mark.parametrize("text, pieces", [
    pytest.param("assistant", ["assistant"], id="role"),
    pytest.param("reverse tree", ["reverse", " ", "t", "r", "e", "e"], id="payload-is-letters"),
    pytest.param("the theme", ["the", " ", "t", "h", "e", "m", "e"], id="word-boundary"),
    pytest.param("letters letter", ["letters", " ", "letter"], id="longest-word"),
    pytest.param("What", ["W", "h", "a", "t"], id="case-sensitive"),
    pytest.param("sort 305", ["sort", " ", "3", "0", "5"], id="digits"),
])
def test_fixed_words_are_one_token_and_everything_else_one_per_byte(text: str, pieces: list[str]):
    tok = tokenizer()
    assert [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)] == pieces


def test_chat_template_renders_chatml_with_generation_prompt():
    tok = tokenizer()
    messages = [
        {"role": "system", "content": "Answer in capital letters."},
        {"role": "user", "content": "reverse kite"},
        {"role": "assistant", "content": "ETIK"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nAnswer in capital letters.<|im_end|>\n"
        "<|im_start|>user\nreverse kite<|im_end|>\n"
        "<|im_start|>assistant\nETIK<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nreverse kite<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == tok.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("text", [
    pytest.param("sort the letters of plant", id="ascii"),
    pytest.param("  two  spaces\tand a tab\n", id="whitespace"),
    pytest.param("naïve café ✓ 日本", id="multibyte"),
    pytest.param("<|im_start|>user\nhi<|im_end|>\n", id="special-tokens"),
])
def test_text_round_trips(text: str):
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_rendered_conversations_tokenize_stably():
    """Each rendered prefix tokenizes to a prefix of the whole: a turn's tokens do not depend on the next."""
    tok = tokenizer()
    for messages in conversations("eval.jsonl")[:40]:
        whole = tok.encode(tok.apply_chat_template(list(messages), tokenize=False), add_special_tokens=False)
        assert tok.decode(whole) == tok.apply_chat_template(list(messages), tokenize=False)
        for end in range(1, len(messages)):
            part = tok.encode(tok.apply_chat_template(list(messages[:end]), tokenize=False), add_special_tokens=False)
            assert whole[: len(part)] == part


def test_trained_tokens_are_the_answers_and_their_end_of_turn():
    from ligertune.data.chat import tokenize_conversation

    tok = tokenizer()
    for messages in conversations("eval.jsonl")[:40]:
        example = tokenize_conversation(tok, list(messages))
        spans, current = [], []
        for token, label in zip(example.input_ids, example.labels):
            if label != -100:
                current.append(token)
            elif current:
                spans.append(tok.decode(current))
                current = []
        assert not current
        assert spans == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def test_quickstart_recipe_points_at_the_bundled_files():
    from ligertune.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert Path(recipe.model.tokenizer) == BUNDLE / "tokenizer"
    assert Path(recipe.data.path) == BUNDLE / "train.jsonl"
    assert Path(recipe.data.eval_path) == BUNDLE / "eval.jsonl"
    tok = tokenizer()
    longest = max(
        len(tok.encode(tok.apply_chat_template(list(m), tokenize=False), add_special_tokens=False))
        for name in ("train.jsonl", "eval.jsonl")
        for m in conversations(name)
    )
    assert longest <= recipe.data.max_seq_len, "a conversation would be truncated"


# --------------------------------------------------------------------------------------------------
# Preference pairs (recipes/quickstart-dpo.yaml)

PAIR_FILES = ("pairs_train.jsonl", "pairs_eval.jsonl")


def _anagram(a: str, b: str) -> bool:
    return sorted(a) == sorted(b)


def _neighbour(a: str, b: str) -> bool:
    return a.isdigit() and b.isdigit() and abs(int(a) - int(b)) == 1


# What a wrong answer of the same game looks like, given the question's groups, the right answer and
# the wrong one (both already cased): the same letters in another order, one off, the other number...
MISTAKES: dict[str, object] = {
    r"reverse (\w+)": lambda groups, right, wrong: _anagram(right, wrong),
    r"spell (\w+) backwards": lambda groups, right, wrong: _anagram(right, wrong),
    r"uppercase (\w+)": lambda groups, right, wrong: _anagram(right, wrong),
    r"sort the letters of (\w+)": lambda groups, right, wrong: _anagram(right, wrong),
    r"sort the digits (\d+)": lambda groups, right, wrong: (
        _anagram(right, wrong) or (len(set(right)) == 1 and wrong == right[1:])),
    r"how many letters are in (\w+)\?": lambda groups, right, wrong: _neighbour(right, wrong),
    r"first letter of (\w+)\?": lambda groups, right, wrong: wrong.lower() in groups[0],
    r"last letter of (\w+)\?": lambda groups, right, wrong: wrong.lower() in groups[0],
    r"say (\w+) (\d) times": lambda groups, right, wrong: (
        set(wrong.split()) == set(right.split()) and 1 <= len(wrong.split()) <= 4),
    r"what comes after ([a-y])\?": lambda groups, right, wrong: (
        wrong.lower() == (chr(ord(groups[0]) - 1) if groups[0] != "a" else "a")),
    r"which is bigger, (\d+) or (\d+)\?": lambda groups, right, wrong: wrong == str(min(map(int, groups))),
    r"what is (\d) \+ (\d)\?": lambda groups, right, wrong: _neighbour(right, wrong),
}


def test_every_question_kind_has_a_kind_of_mistake():
    assert list(MISTAKES) == [pattern for pattern, _ in RULES]


@pytest.mark.parametrize("name", PAIR_FILES)
def test_pairs_have_the_promised_shape(name: str):
    for number, pair in enumerate(pairs(name), 1):
        assert sorted(pair) == ["chosen", "prompt", "rejected"], f"{name}:{number}"
        roles = [m["role"] for m in pair["prompt"]]
        roles = roles[1:] if roles[0] == "system" else roles
        # A multi-turn prompt: at least one question answered before the one the pair answers.
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], f"{name}:{number}: {roles}"
        assert 1 <= len(roles) // 2 <= 3, f"{name}:{number}"
        for side in ("chosen", "rejected"):
            (message,) = pair[side]
            assert message["role"] == "assistant" and message["content"] == message["content"].strip()
        assert pair["chosen"][0]["content"] != pair["rejected"][0]["content"], f"{name}:{number}"


@pytest.mark.parametrize("name", PAIR_FILES)
def test_chosen_is_right_and_rejected_a_wrong_answer_of_the_same_game(name: str):
    kinds = set()
    for number, pair in enumerate(pairs(name), 1):
        messages = pair["prompt"]
        capitals = messages[0]["role"] == "system" and messages[0]["content"] == "Answer in capital letters."
        turns = [m for m in messages if m["role"] != "system"]
        first_question, question = turns[0]["content"], turns[-1]["content"]
        for earlier, answer in zip(turns[:-1:2], turns[1::2]):  # the prompt's turns are answered right
            expected = expected_answer(earlier["content"], first_question)
            assert answer["content"] == (expected.upper() if capitals else expected), f"{name}:{number}"
        right = expected_answer(question, first_question)
        right = right.upper() if capitals else right
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        assert chosen == right, f"{name}:{number}: {question!r}"
        assert rejected != right and rejected == (rejected.upper() if capitals else rejected), f"{name}:{number}"
        if MEMORY.fullmatch(question):
            kinds.add("memory")
            assert rejected.lower() in load_script().WORDS and rejected.lower() != right.lower()
            continue
        pattern, match = next((p, re.fullmatch(p, question)) for p, _ in RULES if re.fullmatch(p, question))
        kinds.add(pattern)
        assert MISTAKES[pattern](match.groups(), right, rejected), f"{name}:{number}: {question!r} -> {rejected!r}"
    assert kinds == {p for p, _ in RULES} | {"memory"}, f"{name}: a game without pairs"


def test_pairs_come_from_the_conversations_of_their_split():
    """A pair is a bundled conversation with its last answer in question: the held-out pairs are
    held-out conversations, which neither the quick start nor the DPO example trains on."""
    key = lambda messages: json.dumps(messages, sort_keys=True)  # noqa: E731
    for pair_file, conversation_file in (("pairs_train.jsonl", "train.jsonl"), ("pairs_eval.jsonl", "eval.jsonl")):
        made = [key([*p["prompt"], *p["chosen"]]) for p in pairs(pair_file)]
        assert len(set(made)) == len(made)
        assert set(made) <= {key(list(m)) for m in conversations(conversation_file)}, pair_file
    prompts = [{key(p["prompt"]) for p in pairs(name)} for name in PAIR_FILES]
    assert not prompts[0] & prompts[1]
    assert 500 <= len(pairs("pairs_train.jsonl")) <= 2000 and len(pairs("pairs_eval.jsonl")) == len(conversations("eval.jsonl"))


def test_dpo_recipe_points_at_the_bundled_pairs_and_every_pair_fits():
    from ligertune.data.preference import PreferencePair, tokenize_preference
    from ligertune.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "quickstart-dpo.yaml")
    assert recipe.objective.name == "dpo" and recipe.data.format == "paired"
    assert Path(recipe.data.path) == BUNDLE / "pairs_train.jsonl"
    assert Path(recipe.data.eval_path) == BUNDLE / "pairs_eval.jsonl"
    assert recipe.model.name_or_path == "runs/quickstart/final"
    quickstart = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert Path(recipe.model.name_or_path) == Path(quickstart.output.dir) / "final"
    tok = tokenizer()
    longest = max(
        len(tokenize_preference(tok, PreferencePair(p["prompt"], p["chosen"], p["rejected"])))
        for name in PAIR_FILES
        for p in pairs(name)
    )
    assert longest <= recipe.data.max_seq_len, "a pair would be dropped"
