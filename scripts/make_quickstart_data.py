"""Generate the quick-start data and tokenizer bundled in `recipes/quickstart/`.

The quick start must show a model learning something real in about two minutes on a laptop CPU,
so the data is a set of small word and number games with exactly one right answer each:

    user:      reverse plant
    assistant: tnalp
    user:      what comes after k?
    assistant: l
    user:      which word did I give you first?
    assistant: plant

Every conversation has 2-4 assistant turns. About a third carry a system prompt, and one of the
system prompts ("Answer in capital letters.") changes every answer, so the model must read it.
The memory question asks for the word of the first turn, which only attention over earlier turns
can answer.

The preference pairs of the DPO example (recipes/quickstart-dpo.yaml) are conversations of the two
splits with their last answer in question: every earlier message is the prompt (the earlier turns
answered right), the right answer is chosen and a plausible wrong one of the same game rejected:

    prompt:    [..., user: "what comes after k?"]   chosen: "l"      rejected: "j"
    prompt:    [..., user: "reverse plant"]         chosen: "tnalp"  rejected: "tanlp"

`pairs_train.jsonl` comes from training conversations, `pairs_eval.jsonl` from every held-out one,
so neither run trains on a held-out pair's prompt. The wrong answers are drawn from a second seeded
generator: the conversations are the same bytes with or without the pairs.

The tokenizer has one token per byte (so every letter of a word in play is its own token:
"reverse" and "sort" act on tokens the model can see, not on the hidden spelling of
multi-character pieces), plus one token per fixed word of the chat template and the instructions
("assistant", "reverse", "letters", ...), plus the three special tokens. The fixed words would
otherwise cost about half of every sequence and give the model nothing to learn: with them, a
conversation is about 80 tokens instead of 155, and training reaches the answers twice as fast.
The chat template is ChatML:

    <|im_start|>{role}\\n{content}<|im_end|>\\n

with `<|im_end|>` as the end-of-sequence token (generation stops at the end of a turn) and
`<|endoftext|>` as padding.

Everything is drawn from the two seeded `random.Random`s, so running this again writes the same bytes:

    python scripts/make_quickstart_data.py                 # rewrites recipes/quickstart/
    python scripts/make_quickstart_data.py --out /tmp/qs   # somewhere else
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
N_TRAIN = 5000
N_EVAL = 160
PAIRS_SEED = 4321
N_PAIRS_TRAIN = 1000

# Short, common words; none of them appears in the instructions, so a word in the payload is
# always the thing to operate on.
WORDS = (
    "able acid aged arch army atom aunt baby back bake ball band bank barn bath bead beam bean "
    "bear bell belt bike bird boat body bold bone book boot bowl brick bush cake calm camp card "
    "cart cave chair chalk cheek chin city clay cliff cloud coal coat code coin cold cook cord "
    "corn crab crow cube cup dark dawn deer desk dish dock door dove drum duck dust eagle earth "
    "east echo edge fair farm fern film fish flag flame flute foam fog fork frog fruit game gate "
    "gift glass glove goat gold grape grass gull hair hall hand harp hawk heart hill home honey "
    "hook horn horse hut ice ink iron jam jar jet juice kettle key kind kite knee lake lamp leaf "
    "lemon lily lime lion lock loft lunch maple map mask meal melon milk mint mist moon moss "
    "moth mouse mud nail nest net night noon north oak oar ocean olive onion orbit owl palm "
    "pan park path peach pear pearl pen pig pine plant plum pond pony pool quilt rain ramp "
    "raven reef rice ring river road robin rock roof rope rose ruby salt sand seal seed shell "
    "ship shoe silk sky slate snow soap sock sofa soup star stem stone storm sun swan table tail "
    "tea tent tiger toast tooth tower town toy tree tulip vase vine violet wave whale wheat "
    "wind wing wolf wood wool yard yarn zebra"
).split()

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer with the result only.",
    "Answer in capital letters.",
)
CAPITALS = "Answer in capital letters."


@dataclass(frozen=True)
class Turn:
    """One question and its answer; `word` is the payload word, when the question has one.

    `mistake(rng)` gives a plausible wrong answer of the same game (the rejected answer of a
    preference pair). It draws from the rng it is given, never from the one that draws the
    conversations, so the conversations do not depend on whether pairs are made.
    """

    question: str
    answer: str
    word: str | None = None
    mistake: Callable[[random.Random], str] | None = None


def _reverse(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    return Turn(rng.choice(("reverse {}", "spell {} backwards")).format(word), word[::-1], word,
                lambda r: _swap_neighbours(word[::-1], r))


def _uppercase(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    # Not a letter left in lower case: under "Answer in capital letters." that would be right.
    return Turn(f"uppercase {word}", word.upper(), word, lambda r: _swap_neighbours(word, r).upper())


def _sort_letters(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    return Turn(f"sort the letters of {word}", "".join(sorted(word)), word,
                lambda r: _swap_neighbours("".join(sorted(word)), r))


def _count_letters(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    return Turn(f"how many letters are in {word}?", str(len(word)), word,
                lambda r: str(len(word) + r.choice((-1, 1))))


def _first_letter(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    return Turn(f"first letter of {word}?", word[0], word, lambda r: r.choice([c for c in word if c != word[0]]))


def _last_letter(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    return Turn(f"last letter of {word}?", word[-1], word, lambda r: r.choice([c for c in word if c != word[-1]]))


def _repeat(rng: random.Random) -> Turn:
    word, times = rng.choice(WORDS), rng.randint(2, 3)
    return Turn(f"say {word} {times} times", " ".join([word] * times), word,
                lambda r: " ".join([word] * r.choice([n for n in (1, 2, 3, 4) if n != times])))


def _next_letter(rng: random.Random) -> Turn:
    letter = rng.choice(string.ascii_lowercase[:-1])
    # The neighbour on the wrong side; "a" has none, and the letter itself is the likelier slip.
    return Turn(f"what comes after {letter}?", chr(ord(letter) + 1),
                mistake=lambda r: chr(ord(letter) - 1) if letter != "a" else letter)


def _sort_digits(rng: random.Random) -> Turn:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 5)))
    ordered = "".join(sorted(digits))
    # "777" has no two digits to swap: one digit too few instead.
    return Turn(f"sort the digits {digits}", ordered,
                mistake=lambda r: _swap_neighbours(ordered, r) if len(set(ordered)) > 1 else ordered[1:])


def _bigger(rng: random.Random) -> Turn:
    a, b = rng.sample(range(10, 100), 2)
    return Turn(f"which is bigger, {a} or {b}?", str(max(a, b)), mistake=lambda r: str(min(a, b)))


def _add(rng: random.Random) -> Turn:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return Turn(f"what is {a} + {b}?", str(a + b), mistake=lambda r: str(a + b + r.choice((-1, 1)) if a + b else 1))


def _swap_neighbours(text: str, rng: random.Random) -> str:
    """`text` with two neighbouring characters that differ swapped ("tnalp" -> "tanlp")."""
    i = rng.choice([i for i in range(len(text) - 1) if text[i] != text[i + 1]])
    return text[:i] + text[i + 1] + text[i] + text[i + 2:]


TASKS: tuple[Callable[[random.Random], Turn], ...] = (
    _reverse, _uppercase, _sort_letters, _count_letters, _first_letter, _last_letter, _repeat,
    _next_letter, _sort_digits, _bigger, _add,
)
MEMORY_QUESTIONS = ("which word did I give you first?", "what was the word in my first message?")


def _memory(rng: random.Random, turns: list[Turn]) -> Turn:
    """Ask back for the first turn's word; the wrong answer is the latest other word given, else any word."""
    first = turns[0].word
    others = [t.word for t in turns[1:] if t.word not in (None, first)]
    return Turn(rng.choice(MEMORY_QUESTIONS), first,
                mistake=lambda r: others[-1] if others else r.choice([w for w in WORDS if w != first]))


@dataclass(frozen=True)
class Conversation:
    """An optional system prompt and the question/answer turns after it."""

    system: str | None
    turns: tuple[Turn, ...]

    def cased(self, answer: str) -> str:
        """`answer` as this conversation's system prompt asks for it."""
        return answer.upper() if self.system == CAPITALS else answer

    def messages(self) -> list[dict]:
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        for turn in self.turns:
            messages.append({"role": "user", "content": turn.question})
            messages.append({"role": "assistant", "content": self.cased(turn.answer)})
        return messages

    def record(self) -> dict:
        return {"messages": self.messages()}

    def pair(self, rng: random.Random) -> dict:
        """The last answer as a preference pair: every earlier message (the earlier turns answered
        right) is the prompt, the right answer is chosen and a wrong one of the same game rejected."""
        *prompt, chosen = self.messages()
        rejected = self.cased(self.turns[-1].mistake(rng))
        assert rejected != chosen["content"], (chosen, rejected)
        return {"prompt": prompt, "chosen": [chosen], "rejected": [{"role": "assistant", "content": rejected}]}


def make_conversation(rng: random.Random) -> Conversation:
    """One conversation: an optional system prompt, then 2-4 user/assistant exchanges."""
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.35 else None
    turns = [rng.choice(TASKS)(rng)]
    for _ in range(rng.randint(2, 4) - 1):
        # Asking back for the first word needs attention across turns, not just within one.
        if turns[0].word is not None and rng.random() < 0.25:
            turns.append(_memory(rng, turns))
        else:
            turns.append(rng.choice(TASKS)(rng))
    return Conversation(system, tuple(turns))


def make_splits(seed: int = SEED, n_train: int = N_TRAIN, n_eval: int = N_EVAL
                ) -> tuple[list[Conversation], list[Conversation]]:
    """Train and held-out conversations, all distinct (no conversation is in both, or twice)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    conversations = []
    while len(conversations) < n_train + n_eval:
        conversation = make_conversation(rng)
        key = json.dumps(conversation.record(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            conversations.append(conversation)
    return conversations[n_eval:], conversations[:n_eval]


def make_pairs(train: list[Conversation], held_out: list[Conversation], seed: int = PAIRS_SEED,
               n_train: int = N_PAIRS_TRAIN) -> tuple[list[dict], list[dict]]:
    """Preference pairs from the first `n_train` training conversations, and held-out pairs from
    every held-out conversation: no stage of the quick start trains on a held-out pair's prompt."""
    rng = random.Random(seed)
    return [c.pair(rng) for c in train[:n_train]], [c.pair(rng) for c in held_out]


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")


def fixed_words(records: list[dict]) -> list[str]:
    """Every word of two or more letters in the roles and prompts that is not a payload word."""
    payload = set(WORDS)
    words = set(ROLES)
    for record in records:
        for message in record["messages"]:
            if message["role"] != "assistant":
                words.update(w for w in re.findall(r"[A-Za-z]{2,}", message["content"]) if w not in payload)
    # A payload word that is also a fixed word would be one token in some places and letters in
    # others.
    assert not payload & words, payload & words
    return sorted(words)


def build_tokenizer(words: list[str], model_max_length: int = 512):
    """Ids 0-255 are the bytes, then one id per word of `words`, then the special tokens.

    The pre-tokenizer cuts the text into whole fixed words (at word boundaries, so "the" in
    "theme" stays letters) and single characters; the byte-level step maps each piece to the
    printable stand-ins of its bytes. The BPE model has no merges and looks a piece up whole
    (`ignore_merges`): a fixed word is one token, anything else one token per byte, so any text
    round-trips.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _byte_alphabet()
    assert set(byte_chars) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(byte_chars)}
    vocab.update({w: len(byte_chars) + i for i, w in enumerate(words)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    # Longest first, so that a word is never cut short by one of its prefixes.
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=lambda w: (-len(w), w)))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\b(?:{alternatives})\b|[\s\S]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def _byte_alphabet() -> list[str]:
    """The byte-level pre-tokenizer's stand-in character for each byte value, indexed by byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) take the
    characters from U+0100 upward, in byte order.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_all(out: Path) -> None:
    """Write train.jsonl, eval.jsonl, pairs_train.jsonl, pairs_eval.jsonl and tokenizer/ under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_splits()
    records = [c.record() for c in train], [c.record() for c in held_out]
    write_jsonl(out / "train.jsonl", records[0])
    write_jsonl(out / "eval.jsonl", records[1])
    pairs_train, pairs_eval = make_pairs(train, held_out)
    write_jsonl(out / "pairs_train.jsonl", pairs_train)
    write_jsonl(out / "pairs_eval.jsonl", pairs_eval)
    # The chat template goes inside tokenizer_config.json (not a separate .jinja file) so the
    # bundled recipe data is only .json/.jsonl files.
    build_tokenizer(fixed_words(records[0] + records[1])).save_pretrained(out / "tokenizer", save_jinja_files=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parent.parent / "recipes" / "quickstart"
    parser.add_argument("--out", type=Path, default=default_out, help=f"output folder (default: {default_out})")
    args = parser.parse_args(argv)
    write_all(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
