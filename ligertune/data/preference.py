"""Preference data: records -> prompt and answers -> tokenized units with exact scored spans -> packs.

What DPO, IPO, SimPO and ORPO read is a pair of answers to one prompt; what KTO reads is one answer
with a verdict. Three record formats (`formats.detect_preference_format`, from a source's first
record, or `fmt`):

    paired                {"prompt": "2+2?", "chosen": "4.", "rejected": "5."}
    paired_conversations  {"chosen": [{"role": "user", ...}, {"role": "assistant", ...}],
                           "rejected": [{"role": "user", ...}, {"role": "assistant", ...}]}
    unpaired              {"prompt": "2+2?", "completion": "5.", "label": false}

A `prompt` is a string (one user turn, after an optional `system` string) or a list of messages (a
multi-turn prompt, a system turn first); an answer (`chosen`, `rejected`, `completion`) is a string
(one assistant turn) or a list of messages that opens with an assistant turn. In
`paired_conversations` each side is a whole conversation: they are split at the first message that
differs; the shared messages are the prompt, the rest of each is its answer. A `prompt` beside whole
conversations (UltraFeedback-binarized writes the first user turn there) is not read.

A record becomes a *unit* that packs whole, rendered with the tokenizer's own chat template:

    pair:  prompt tokens once, then the chosen answer's tokens, then the rejected answer's tokens
    KTO:   prompt tokens once, then the completion's tokens, then the mismatched completion's: another
           example's completion after this prompt (`mismatch_completions`), scored for KTO's KL
           estimate z0 and never trained; laid out as a pair's rejected answer (the step runs
           each unit's two completions in passes of their own: `PreferenceBatch.kto_parts`)
    KTO without a mismatched completion (a record read alone): prompt tokens, then the completion's

Each `prompt + answer` is exactly `chat.tokenize_conversation(prompt + answer)`: the conversation is
rendered and tokenized whole, and the unit's prompt is the longest run of tokens that both renderings
(for two answers) or the rendering and the prompt's own rendering with the generation prompt (for
one) begin with, ending before the first scored token. So a template that merges characters across the
prompt/answer boundary, or answers that open with the same words, cost nothing in exactness: what
is not shared is repeated in each answer, unscored. An answer's scored tokens are exactly those
supervised fine-tuning trains for its assistant turns (`train_on: assistant`): each turn's content
and the end-of-turn token(s) that close it; never the prompt, role headers, or user and tool turns
inside a multi-turn answer.

Attention inside a unit: the prompt is causal; each answer attends to the whole prompt and to itself,
causally, never to the other answer. Positions continue from the prompt for every answer, so each
answer sees exactly what it would see in its own conversation. The targets are shifted within
[prompt + that answer], which puts the first token of BOTH answers on the prompt's last position.
One pair (prompt p0 p1 p2; answers c0 c1 c2 and r0 r1; `-` is -100):

    row            0   1   2   3   4   5   6   7
    segment        P   P   P   C   C   C   R   R
    input_ids      p0  p1  p2  c0  c1  c2  r0  r1
    labels         -   -   -   c0  c1  c2  r0  r1      (unshifted; here every answer token is scored)
    position_ids   0   1   2   3   4   5   3   4
    scored (row -> target, answer):
        chosen    2 -> c0   3 -> c1   4 -> c2          answer 0
        rejected  2 -> r0   6 -> r1                    answer 1

Row 2 predicts both c0 and r0: its hidden state sees only the prompt, and the same hidden state is
scored twice. The scores are therefore a list of (row, target, answer) triples rather than one
target per row: the per-answer sums of log p are `index_add(answer, log_softmax(W h[row])[target])`,
one gather of the scored rows and one cross-entropy over them, with no special case.

Too long: a unit longer than `max_seq_len` is dropped and counted (`too_long`). Trailing turns are
not dropped as supervised fine-tuning does: the answers are the end of the conversation and the
thing compared, and cutting one (or the prompt's last turns, which the answers reply to) would
score an answer to a different question.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import torch

from ligertune.data.chat import (
    IGNORE_INDEX,
    ConversationError,
    check_renders_tools,
    check_roles,
    check_tokenizer,
    encode,
    fits,
    label_tokens,
    locate_turn,
    probe_chars,
    render,
    with_system,
)
from ligertune.data.formats import (
    PREFERENCE_FORMATS,
    Conversation,
    Message,
    RecordError,
    _kind,
    _messages,
    detect_preference_format,
    read_normalized,
    record_tools,
)
from ligertune.data.packing import best_fit_decreasing
from ligertune.data.stats import compact_count
from ligertune.errors import DataError

BAD_RECORD_EXAMPLES = 5


# --------------------------------------------------------------------------------------------------
# Records


@dataclass
class PreferencePair:
    """A prompt and two answers to it; each answer's first message is an assistant turn."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    origin: str = ""
    tools: list[dict] | None = None  # offered in the prompt (`formats.record_tools`)

    @property
    def answers(self) -> list[list[Message]]:
        return [self.chosen, self.rejected]


@dataclass
class UnpairedPreference:
    """A prompt, one answer, and whether the answer is desirable (KTO's `label`); `mismatched`, once
    `mismatch_completions` has given it one, is another record's completion, the second answer."""

    prompt: list[Message]
    completion: list[Message]
    desirable: bool
    origin: str = ""
    mismatched: list[Message] | None = None
    tools: list[dict] | None = None  # offered in the prompt (`formats.record_tools`)

    @property
    def answers(self) -> list[list[Message]]:
        return [self.completion] if self.mismatched is None else [self.completion, self.mismatched]


PreferenceRecord = Union[PreferencePair, UnpairedPreference]


def normalize_preference(record: Any, fmt: str) -> PreferenceRecord:
    """The record as a prompt and its answer(s), or `RecordError` naming the problem."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {_kind(record)}")
    tools = record_tools(record)
    if fmt == "paired":
        prompt = _prompt(record, fmt)
        chosen, rejected = _answer(record, "chosen", fmt), _answer(record, "rejected", fmt)
        if chosen == rejected:
            raise RecordError("`chosen` and `rejected` are the same answer")
        return PreferencePair(prompt, chosen, rejected, tools=tools)
    if fmt == "paired_conversations":
        return dataclasses.replace(_split_conversations(record), tools=tools)
    if fmt == "unpaired":
        prompt = _prompt(record, fmt)
        completion = _answer(record, "completion", fmt)
        label = _required(record, "label", fmt)
        if not isinstance(label, bool):
            shown = repr(label) if isinstance(label, (str, int, float)) else _kind(label)
            raise RecordError(f"`label` must be true (desirable) or false (undesirable), got {shown}")
        return UnpairedPreference(prompt, completion, label, tools=tools)
    raise ValueError(f"unknown preference format {fmt!r} (expected one of {', '.join(PREFERENCE_FORMATS)})")


def unpair(pairs: Iterable[PreferencePair]) -> list[UnpairedPreference]:
    """Each pair as two KTO records: the chosen answer desirable, the rejected one not."""
    out = []
    for pair in pairs:
        out.append(UnpairedPreference(pair.prompt, pair.chosen, True, pair.origin, tools=pair.tools))
        out.append(UnpairedPreference(pair.prompt, pair.rejected, False, pair.origin, tools=pair.tools))
    return out


def mismatch_completions(records: Sequence[UnpairedPreference], rng: random.Random
                         ) -> list[UnpairedPreference]:
    """Each record with the completion of another as its `mismatched` completion (KTO's KL estimate
    scores log pi(y_j | x_i) - log pi_ref(y_j | x_i) over such mismatched pairs).

    The records are put in an order shuffled by `rng`, and each takes the completion of the one after
    it (the last, of the first): one cycle through all of them, so never a record's own completion,
    and every completion serves once. Needs at least 2 records.
    """
    if len(records) < 2:
        raise ValueError(f"mismatched completions need at least 2 records; got {len(records)}")
    order = list(range(len(records)))
    rng.shuffle(order)
    out = list(records)
    for k, i in enumerate(order):
        after = records[order[(k + 1) % len(order)]]
        out[i] = dataclasses.replace(records[i], mismatched=after.completion)
    return out


def _required(record: dict, key: str, fmt: str) -> Any:
    if key not in record:
        raise RecordError(f"missing `{key}` (format {fmt})")
    return record[key]


def _field_messages(items: list, key: str) -> list[Message]:
    """The messages of one field; problems are named with the field (`chosen` message 2 ...)."""
    if not items:
        raise RecordError(f"`{key}` is empty")
    try:
        return _messages(items, key)
    except RecordError as err:
        raise RecordError(f"`{key}` {err}") from None


def _text(value: str, key: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RecordError(f"`{key}` has invalid text: a lone surrogate {value[err.start]!r} at character "
                          f"{err.start + 1}") from None
    return value


def _prompt(record: dict, fmt: str) -> list[Message]:
    """A string (one user turn, after the optional `system` string) or a list of messages."""
    prompt = _required(record, "prompt", fmt)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": _text(prompt, "prompt")}]
        system = record.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise RecordError(f"`system` must be a string, got {_kind(system)}")
            messages.insert(0, {"role": "system", "content": _text(system, "system")})
        return messages
    if isinstance(prompt, list):
        messages = _field_messages(prompt, "prompt")
        _check_prompt(messages, "`prompt` ")
        return messages
    raise RecordError(f"`prompt` must be a string or a list of messages, got {_kind(prompt)}")


def _check_prompt(messages: list[Message], name: str) -> None:
    for number, message in enumerate(messages, 1):
        if message["role"] == "system" and number > 1:
            raise RecordError(f"{name}message {number}: a system message may only come first")


def _answer(record: dict, key: str, fmt: str) -> list[Message]:
    """A string (one assistant turn) or a list of messages opening with an assistant turn."""
    value = _required(record, key, fmt)
    if isinstance(value, str):
        return [{"role": "assistant", "content": _text(value, key)}]
    if not isinstance(value, list):
        raise RecordError(f"`{key}` must be a string or a list of messages, got {_kind(value)}")
    messages = _field_messages(value, key)
    role = messages[0]["role"]
    if role != "assistant":
        hint = " (whole conversations are format paired_conversations)" if fmt == "paired" and role in (
            "user", "system") else ""
        raise RecordError(f"`{key}` must open with an assistant message, got a {role} message{hint}")
    _check_answer(messages, f"`{key}` ", 1)
    return messages


def _check_answer(messages: list[Message], name: str, first_number: int) -> None:
    for number, message in enumerate(messages, first_number):
        if message["role"] == "system":
            raise RecordError(f"{name}message {number}: a system message may only open the prompt")


def _split_conversations(record: dict) -> PreferencePair:
    """Two whole conversations split at the first message that differs."""
    sides = {}
    for key in ("chosen", "rejected"):
        value = _required(record, key, "paired_conversations")
        if not isinstance(value, list):
            raise RecordError(f"`{key}` must be a whole conversation (a list of messages), "
                              f"got {_kind(value)}")
        sides[key] = _field_messages(value, key)
    chosen, rejected = sides["chosen"], sides["rejected"]
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise RecordError("`chosen` and `rejected` share no prompt: their first messages differ")
    if shared == len(chosen) == len(rejected):
        raise RecordError("`chosen` and `rejected` are the same conversation")
    for (key, side), other in zip(sides.items(), ("rejected", "chosen")):
        if shared == len(side):
            raise RecordError(f"`{key}` has no answer: every one of its messages opens `{other}` too")
        role = side[shared]["role"]
        if role != "assistant":
            raise RecordError(f"the conversations first differ at message {shared + 1}, a {role} message in "
                              f"`{key}`: each answer must open with an assistant message")
        _check_answer(side[shared:], f"`{key}` ", shared + 1)
    _check_prompt(chosen[:shared], "")
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:])


@dataclass
class PreferenceReadResult:
    """The records of one source, with the malformed ones that were skipped (`path:line: problem`)."""

    records: list[PreferenceRecord]
    read: int
    bad: list[str]
    format: str | None


def read_preferences(path: str, *, fmt: str = "auto", split: str = "train",
                     on_bad_record: str = "error") -> PreferenceReadResult:
    """Every record of one source as a preference record (`read_normalized`)."""
    normalized, read, bad, fmt = read_normalized(path, detect_preference_format, normalize_preference,
                                                 fmt=fmt, split=split, on_bad_record=on_bad_record)
    for origin, record in normalized:
        record.origin = origin
    records = [record for _, record in normalized]
    return PreferenceReadResult(records, read, bad, None if fmt == "auto" else fmt)


# --------------------------------------------------------------------------------------------------
# Units


@dataclass(kw_only=True)
class PreferenceUnit:
    """A prompt and its answers laid end to end: `input_ids` = prompt + answer 0 + answer 1 ...

    `labels[i] == input_ids[i]` where token i is scored (an answer's assistant turns and their
    end-of-turn tokens), else -100; the prompt is never scored. Every answer's positions continue
    from the prompt (the module docstring draws the layout).
    """

    input_ids: list[int]
    labels: list[int]
    prompt_len: int
    answer_lens: tuple[int, ...]
    origin: str = ""
    source: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def position_ids(self) -> list[int]:
        """0 .. prompt_len-1, then prompt_len .. for each answer."""
        p = self.prompt_len
        return [*range(p), *(p + i for n in self.answer_lens for i in range(n))]

    @property
    def answer_spans(self) -> list[tuple[int, int]]:
        """`[start, end)` of each answer in the unit."""
        spans, start = [], self.prompt_len
        for n in self.answer_lens:
            spans.append((start, start + n))
            start += n
        return spans

    def scores(self) -> list[tuple[int, int, int]]:
        """`(row, target, answer)` for every scored token, the labels shifted within [prompt + answer]:
        the first token of each answer is predicted from the prompt's last row, any other from the
        row before it."""
        out = []
        for answer, (start, end) in enumerate(self.answer_spans):
            for i in range(start, end):
                if self.labels[i] != IGNORE_INDEX:
                    out.append((self.prompt_len - 1 if i == start else i - 1, self.labels[i], answer))
        return out

    def scored_tokens(self) -> list[int]:
        """How many tokens of each answer are scored."""
        return [sum(label != IGNORE_INDEX for label in self.labels[s:e]) for s, e in self.answer_spans]


@dataclass(kw_only=True)
class PreferenceExample(PreferenceUnit):
    """A pair: prompt + chosen answer + rejected answer (answer 0 is the chosen one)."""

    @property
    def chosen_len(self) -> int:
        return self.answer_lens[0]

    @property
    def rejected_len(self) -> int:
        return self.answer_lens[1]


@dataclass(kw_only=True)
class KTOExample(PreferenceUnit):
    """A prompt and one completion, and whether the completion is desirable. Answer 1, when there is
    one, is the mismatched completion (another example's): scored for the KL estimate, never trained."""

    desirable: bool

    @property
    def completion_len(self) -> int:
        return self.answer_lens[0]


def render_scored(tokenizer: Any, messages: Sequence[Message], first_answer: int, *,
                  tools: Sequence[dict] | None = None) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of a whole conversation, with the assistant turns from message index
    `first_answer` on scored: the turns and labels `tokenize_conversation(train_on="assistant")`
    finds, restricted to the answer (earlier turns are still located, so the search runs as there)."""
    check_roles(messages)
    text = render(tokenizer, messages, tools=tools)
    input_ids, offsets = encode(tokenizer, text)
    spans, cursor = [], 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = locate_turn(tokenizer, messages, k, text, cursor, tools=tools)
        if span is not None:
            if k >= first_answer:
                spans.append(span)
            cursor = span[1]
    labels = label_tokens(input_ids, offsets, spans)
    if labels:
        labels[0] = IGNORE_INDEX
    return input_ids, labels


def tokenize_preference(tokenizer: Any, record: PreferenceRecord) -> PreferenceExample | KTOExample:
    """The record as a unit (see the module docstring). A template that renders the prompt with no
    token in common before the two answers raises `ConversationError`."""
    n = len(record.prompt)
    rendered = [render_scored(tokenizer, record.prompt + answer, n, tools=record.tools)
                for answer in record.answers]
    firsts = [_first_scored(labels) for _, labels in rendered]
    if len(rendered) == 2:
        shared = _common_prefix(rendered[0][0], rendered[1][0])
    else:
        (ids, _), = rendered
        try:
            prompt = render(tokenizer, record.prompt, add_generation_prompt=True, tools=record.tools)
            prompt_ids, _ = encode(tokenizer, prompt)
            shared = _common_prefix(ids, prompt_ids)
        except ConversationError:  # a template that refuses a generation prompt after this prompt
            shared = len(ids)
    p = min([shared, *(f for f in firsts if f is not None)])
    if len(rendered) == 2 and p == 0:
        raise ConversationError("the chat template renders the prompt differently before the two answers "
                                "(the renderings share no first token)")
    layout = {
        "input_ids": rendered[0][0][:p] + [t for ids, _ in rendered for t in ids[p:]],
        "labels": [IGNORE_INDEX] * p + [label for _, labels in rendered for label in labels[p:]],
        "prompt_len": p, "answer_lens": tuple(len(ids) - p for ids, _ in rendered),
    }
    if isinstance(record, UnpairedPreference):
        return KTOExample(**layout, desirable=record.desirable)
    return PreferenceExample(**layout)


def _first_scored(labels: Sequence[int]) -> int | None:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------------------
# Many records: the length policy and the counts


@dataclass
class PreferenceOutcome:
    """What became of one record: kept (`ok`), dropped (`too_long`, `no_trained_tokens`) or `bad`."""

    status: str
    unit: PreferenceExample | KTOExample | None = None
    problem: str = ""


def process_preference(tokenizer: Any, record: PreferenceRecord, max_seq_len: int) -> PreferenceOutcome:
    """Tokenize one record and apply the length policy: a unit over `max_seq_len` tokens is dropped.

    A record of many more characters than `max_seq_len` could hold is measured first (`chat.fits`):
    when one of its conversations alone cannot fit, it is dropped without being tokenized whole.
    """
    try:
        conversations = [record.prompt + answer for answer in record.answers]
        for messages in conversations:
            if sum(len(m["content"]) for m in messages) > probe_chars(max_seq_len):
                check_roles(messages)
                if not fits(tokenizer, render(tokenizer, messages, tools=record.tools), max_seq_len):
                    return PreferenceOutcome("too_long")
        unit = tokenize_preference(tokenizer, record)
    except ConversationError as err:
        return PreferenceOutcome("bad", problem=f"{record.origin}: {err}")
    if min(unit.scored_tokens()) == 0:
        return PreferenceOutcome("no_trained_tokens")
    if len(unit) > max_seq_len:
        return PreferenceOutcome("too_long")
    unit.origin = record.origin
    return PreferenceOutcome("ok", unit)


@dataclass
class PreferenceStats:
    """One source's records through reading and tokenization.

    `dropped` counts units by reason: `too_long` (over `max_seq_len`), `no_trained_tokens` (an answer
    with no scored token: the template rendered nothing for it).
    """

    records: int = 0
    bad_records: int = 0
    bad_record_examples: list[str] = field(default_factory=list)  # the first few, with file:line
    dropped: dict[str, int] = field(default_factory=dict)
    kept: int = 0
    scored_tokens: int = 0
    total_tokens: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def added(cls, parts: Sequence[PreferenceStats]) -> PreferenceStats:
        """Several sources' counts together."""
        total = cls()
        for st in parts:
            total.records += st.records
            total.bad_records += st.bad_records
            total.bad_record_examples += st.bad_record_examples[:BAD_RECORD_EXAMPLES - len(total.bad_record_examples)]
            for reason, count in st.dropped.items():
                total.dropped[reason] = total.dropped.get(reason, 0) + count
            total.kept += st.kept
            total.scored_tokens += st.scored_tokens
            total.total_tokens += st.total_tokens
        return total

    def summary(self) -> str:
        """One line, e.g. `1200 read, 12 dropped (too_long 12), 1188 kept, 81k of 310k tokens scored`."""
        parts = [f"{self.records} read"]
        if self.bad_records:
            parts.append(f"{self.bad_records} bad skipped")
        if self.dropped:
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.dropped.items()))
            parts.append(f"{sum(self.dropped.values())} dropped ({reasons})")
        parts.append(f"{self.kept} kept")
        scored, total = compact_count(self.scored_tokens), compact_count(self.total_tokens)
        parts.append(f"{scored} of {total} tokens scored")
        return ", ".join(parts)


@dataclass
class PreparedPreferences:
    units: list[PreferenceExample | KTOExample]
    stats: PreferenceStats


def tokenize_preferences(
    records: Sequence[PreferenceRecord], tokenizer: Any, *, max_seq_len: int, on_bad_record: str = "error",
    stats: PreferenceStats | None = None,
) -> PreparedPreferences:
    """Every record as a unit, in order, with the dropped ones counted by reason.

    A record the chat template rejects raises `DataError("path:line: problem")` under
    `on_bad_record="error"`; under `"skip"` it is counted with the malformed records.
    """
    check_tokenizer(tokenizer)
    stats = stats if stats is not None else PreferenceStats(records=len(records))
    units = []
    for record in records:
        outcome = process_preference(tokenizer, record, max_seq_len)
        if outcome.status == "bad":
            if on_bad_record == "error":
                raise DataError(outcome.problem)
            stats.bad_records += 1
            if len(stats.bad_record_examples) < BAD_RECORD_EXAMPLES:
                stats.bad_record_examples.append(outcome.problem)
        elif outcome.unit is None:
            stats.dropped[outcome.status] = stats.dropped.get(outcome.status, 0) + 1
        else:
            units.append(outcome.unit)
    stats.kept = len(units)
    stats.scored_tokens = sum(sum(u.scored_tokens()) for u in units)
    stats.total_tokens = sum(len(u) for u in units)
    return PreparedPreferences(units, stats)


def load_preferences(path: str, tokenizer: Any, *, max_seq_len: int, fmt: str = "auto", split: str = "train",
                     on_bad_record: str = "error", source: int = 0,
                     check_format: Callable[[str], None] | None = None, kto: bool = False,
                     seed: int = 0, system_prompt: str | None = None) -> PreparedPreferences:
    """Read one source and tokenize it: `read_preferences` then `tokenize_preferences`.

    `check_format(fmt)`, when given, sees the source's format (detected from its first record under
    `fmt="auto"`) once it is read, before any record is tokenized: the trainer refuses there a format
    its objective cannot read (`recipe.check_objective_data`).
    `kto=True` makes every record a KTO example (a pair gives two: `unpair`) with a mismatched
    completion, another example's, from a permutation of the source drawn from `seed`
    (`mismatch_completions`); a source of fewer than 2 examples raises `DataError` naming it.
    `system_prompt` opens every prompt that has no system message (`data.system_prompt`).
    A source that gives no unit at all raises `DataError` naming it and what became of its records.
    """
    read = read_preferences(path, fmt=fmt, split=split, on_bad_record=on_bad_record)
    if check_format is not None and read.format is not None:
        check_format(read.format)
    records = [dataclasses.replace(r, prompt=with_system(r.prompt, system_prompt)) for r in read.records]
    check_renders_tools(tokenizer, (Conversation(r.prompt + r.answers[0], r.origin, r.tools)
                                    for r in records))
    if kto:
        records = [u for r in records for u in (unpair([r]) if isinstance(r, PreferencePair) else [r])]
        if len(records) == 1:  # none: reported below as a source with no unit
            raise DataError(f"{path}: KTO needs at least 2 examples (each is scored beside another's "
                            "completion, for the KL estimate z0); it has 1")
        if records:
            records = mismatch_completions(records, random.Random(f"ligertune-data:{seed}:mismatch:{source}"))
    stats = PreferenceStats(records=read.read, bad_records=len(read.bad),
                            bad_record_examples=read.bad[:BAD_RECORD_EXAMPLES])
    prepared = tokenize_preferences(records, tokenizer, max_seq_len=max_seq_len,
                                    on_bad_record=on_bad_record, stats=stats)
    for unit in prepared.units:
        unit.source = source
    if not prepared.units:
        if stats.records == 0:
            raise DataError(f"{path}: no records (the file is empty)")
        fates = [f"{reason.replace('_', ' ')}: {count}" for reason, count in sorted(stats.dropped.items())]
        if stats.bad_records:
            fates.append(f"bad records skipped: {stats.bad_records}")
        records = f"{stats.records} record{'s' * (stats.records != 1)}"
        raise DataError(f"{path}: no usable preference record among its {records} "
                        f"({'; '.join(fates) or 'none kept'})")
    return prepared


# --------------------------------------------------------------------------------------------------
# Packs


@dataclass
class VarlenSegments:
    """A pack's attention as varlen segments with separate query and key ranges.

    Segment s has the queries `rows[cu_seqlens_q[s]:cu_seqlens_q[s+1]]` (consecutive rows of the
    pack) and the keys `key_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]` (rows of the pack: gather K and
    V by `key_index`). Attention is causal aligned to the end, as FlashAttention's is when there are
    more keys than queries: query j of a segment of q queries and k keys sees keys 0 .. k - q + j.
    A prompt and its first answer are one plain causal segment; each further answer (a pair's
    rejected one, a KTO example's mismatched completion) is one segment whose keys are the prompt's
    rows then its own.
    """

    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    key_index: list[int]
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_segments(prompt_lens: Sequence[int], answer_lens: Sequence[Sequence[int]]) -> VarlenSegments:
    """The segments of units laid end to end, unit u being a prompt of `prompt_lens[u]` tokens then
    answers of `answer_lens[u]` tokens: the prompt and the first answer are one causal segment (the
    prompt's rows see only the prompt before them, as if alone), and each further answer one more
    whose keys are the prompt's rows then its own. The prompt's keys are thus gathered once for each
    answer after the first, not for the prompt's own rows too."""
    cu_q, cu_k, keys = [0], [0], []
    offset = 0
    for p, lens in zip(prompt_lens, answer_lens):
        first = offset + p + (lens[0] if lens else 0)
        segments = [(first, [range(offset, first)])]
        start = first
        for n in lens[1:]:
            segments.append((start + n, [range(offset, offset + p), range(start, start + n)]))
            start += n
        for q_end, key_ranges in segments:
            cu_q.append(q_end)
            for r in key_ranges:
                keys.extend(r)
            cu_k.append(len(keys))
        offset += p + sum(lens)
    widths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    widths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return VarlenSegments(cu_q, cu_k, keys, max(widths_q, default=0), max(widths_k, default=0))


@dataclass
class PreferencePack:
    """Whole units laid end to end (each unit as drawn in the module docstring, shifted by its offset).

    `score_rows[i]` is the row whose output predicts `score_targets[i]`, a token of answer
    `score_answers[i]` (answers numbered through the pack: unit u of a pair pack holds answers 2u
    (chosen) and 2u+1 (rejected); of a KTO pack, answer u). `desirable` gives each KTO answer's
    label (None in a pair pack).
    """

    input_ids: list[int]
    prompt_lens: list[int]
    answer_lens: list[tuple[int, ...]]
    score_rows: list[int]
    score_targets: list[int]
    score_answers: list[int]
    desirable: list[bool] | None = None
    example_indices: list[int] = field(default_factory=list)  # which units, in order
    sources: list[int] = field(default_factory=list)  # the source of each unit
    reference_logps: list[float] | None = None
    """The reference model's sum of log p of each answer, in answer order (None until computed,
    and for the reference-free losses): `training.reference` fills it before the first step."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> list[int]:
        """The length of every unit (what packing and the step order read)."""
        return [p + sum(lens) for p, lens in zip(self.prompt_lens, self.answer_lens)]

    @property
    def cu_seqlens(self) -> list[int]:
        """Start offset of every unit, then the total."""
        out = [0]
        for n in self.seq_lens:
            out.append(out[-1] + n)
        return out

    @property
    def position_ids(self) -> list[int]:
        """Every unit's positions: its prompt's from 0, each of its answers' on from the prompt's end."""
        out: list[int] = []
        for p, lens in zip(self.prompt_lens, self.answer_lens):
            out += range(p)
            for n in lens:
                out += range(p, p + n)
        return out

    @property
    def num_answers(self) -> int:
        return sum(len(lens) for lens in self.answer_lens)

    @property
    def trained_tokens(self) -> int:
        """The scored tokens (the prompt's last row counts once per answer it predicts)."""
        return len(self.score_rows)

    def varlen(self) -> VarlenSegments:
        return varlen_segments(self.prompt_lens, self.answer_lens)

    def attention_mask(self) -> torch.Tensor:
        """`[L, L]` bool, True where query row i may attend to key row j (the CPU reference)."""
        mask = torch.zeros(len(self), len(self), dtype=torch.bool)
        for offset, p, lens in zip(self.cu_seqlens, self.prompt_lens, self.answer_lens):
            n = p + sum(lens)
            start = offset + p
            mask[offset:start, offset:start] = torch.ones(p, p, dtype=torch.bool).tril()
            if len(lens) == 1:
                mask[offset:offset + n, offset:offset + n] = torch.ones(n, n, dtype=torch.bool).tril()
                continue
            for m in lens:
                mask[start:start + m, offset:offset + p] = True
                mask[start:start + m, start:start + m] = torch.ones(m, m, dtype=torch.bool).tril()
                start += m
        return mask


def make_preference_pack(units: Sequence[PreferenceUnit], indices: Sequence[int]) -> PreferencePack:
    """The units at `indices`, in that order, as one pack."""
    input_ids: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    answers: list[int] = []
    answers_before = 0
    for i in indices:
        unit = units[i]
        offset = len(input_ids)
        for row, target, answer in unit.scores():
            rows.append(offset + row)
            targets.append(target)
            answers.append(answers_before + answer)
        answers_before += len(unit.answer_lens)
        input_ids += unit.input_ids
    kto = [isinstance(units[i], KTOExample) for i in indices]
    desirable = [units[i].desirable for i in indices] if all(kto) else None
    return PreferencePack(
        input_ids, [units[i].prompt_len for i in indices], [tuple(units[i].answer_lens) for i in indices],
        rows, targets, answers, desirable, list(indices), [units[i].source for i in indices],
    )


def pack_preferences(units: Sequence[PreferenceUnit], max_seq_len: int, *, packing: bool = True
                     ) -> list[PreferencePack]:
    """Whole units best-fit decreasing into packs of at most `max_seq_len` tokens (`packing=False`:
    one pack per unit, in order). Pairs and KTO units are not mixed; a unit longer than
    `max_seq_len` is an error (`tokenize_preferences` drops those first)."""
    if len({type(u) for u in units}) > 1:
        raise ValueError("pairs and KTO examples go in separate packs: give one kind of unit")
    lengths = [len(u) for u in units]
    for i, n in enumerate(lengths):
        if n > max_seq_len:
            raise ValueError(f"unit {i} ({units[i].origin or 'no origin'}) has {n} tokens, more than "
                             f"max_seq_len={max_seq_len}; tokenize_preferences drops such units")
    if not packing:
        return [make_preference_pack(units, [i]) for i in range(len(units))]
    return [make_preference_pack(units, group) for group in best_fit_decreasing(lengths, max_seq_len)]
