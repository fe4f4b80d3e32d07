"""Rendering a conversation with the tokenizer's own chat template and marking the trained tokens.

`input_ids` are exactly the tokens of `tokenizer.apply_chat_template(messages, tokenize=False)`
tokenized without extra special tokens (which is also what `tokenize=True` returns). The labels
follow `train_on`:

    assistant       every assistant turn: its content and the end-of-turn token(s) the template
                    writes to close it (<|im_end|>, <|eot_id|>, </s>, <end_of_turn>, ...), so the
                    model learns to stop. Role headers, system, user and tool turns are not trained.
    last_assistant  the same, for the last assistant turn only.
    all             every token.

The first token is never trained whatever `train_on` says: nothing precedes it to predict it from.

Templates need no `{% generation %}` markers. For assistant message k the template is rendered
twice more: up to message k-1 with the generation prompt (P), and up to message k (Q). The text Q
adds after its common prefix with P is the turn's body: content + closing. Trailing whitespace of
the body is left untrained (it is layout, not a stop signal). The body is then found in the full
rendering R:

- right after P's text, when that text is a prefix of R (every common template);
- otherwise (a template that renders earlier turns differently once later ones exist, e.g. one
  that moves the system prompt to the last user turn) by searching R after the previous turn for
  the first occurrence whose preceding text agrees with P's over more than the assistant header.
  An occurrence inside a user message that repeats the answer is preceded by the user header and
  is skipped; a later copy of a repeated exchange is never reached first.

Token i is trained when its character span (the fast tokenizer's offset mapping) overlaps a
trained body; the checks above make the spans exact, whatever the tokenizer.

Example, ChatML (trained characters underlined):

    <|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\nHello!<|im_end|>\\n
                           ^^^^^^^^^^^^^^^^
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional, Sequence

from ligertune.data.formats import Message
from ligertune.errors import DataError, UserError
from ligertune.recipe import IGNORE_INDEX

# A text longer than PROBE_CHARS_PER_TOKEN * (limit + BOUNDARY_TOKENS) characters is measured on
# prefixes before it is tokenized in full (`fits`): chat text runs at 3-5 characters per token, so the
# first prefix almost always settles it. BOUNDARY_TOKENS covers what cutting a text can add at the cut
# (a word split in two, a special token cut open; WordPiece's [UNK] for a long word, at most 100).
PROBE_CHARS_PER_TOKEN = 8
BOUNDARY_TOKENS = 128

TrainOn = Literal["assistant", "last_assistant", "all"]
# One exchange, which every template takes (some refuse a system turn): what a template is tried on.
ONE_EXCHANGE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"})
Tools = Optional[Sequence[dict]]


@dataclass
class TokenizedExample:
    """One rendered conversation: `labels[i] == input_ids[i]` where token i is trained, else -100."""

    input_ids: list[int]
    labels: list[int]
    origin: str = ""
    source: int = 0
    """Index of the source it came from: `data.sources` in order (0 for `data.path`), `eval_path` last."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


class ConversationError(DataError):
    """The role rules or the chat template reject a conversation; the caller prefixes file and line."""


def check_tokenizer(tokenizer: Any, subject: str | None = None) -> None:
    """Rendering needs a chat template and character offsets (a fast tokenizer).

    `subject` names the tokenizer in the message (`models.load_tokenizer` gives `model.tokenizer:
    the tokenizer of DIR`); by default, `the tokenizer NAME_OR_PATH`.
    """
    if subject is None:
        subject = f"the tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{subject} has no chat template: name one with `model.chat_template` (chatml, llama3, "
            "a .jinja file), or use a chat/instruct tokenizer"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"{subject} is not a fast (Rust `tokenizers`) tokenizer: masking needs its character offsets"
        )


def check_renders_tools(tokenizer: Any, conversations: Iterable[Any]) -> None:
    """Refuse data whose `tools` or tool calls the chat template leaves out of the text (it renders the
    first conversation that has them the same without them): the model would learn the calls' answers
    without the calls, or call tools it was never shown. `conversations` are `formats.Conversation`s,
    read once."""
    offered = called = None
    for conversation in conversations:
        offered = offered or (conversation if conversation.tools else None)
        called = called or (conversation if any("tool_calls" in m for m in conversation.messages) else None)
        if offered and called:
            break
    if offered is not None and renders_alike(tokenizer, offered.messages, offered.tools,
                                             offered.messages, None):
        raise _ignored(offered.origin, "`tools`")
    if called is not None:
        without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in called.messages]
        if renders_alike(tokenizer, called.messages, called.tools, without, called.tools):
            raise _ignored(called.origin, "`tool_calls`")


def renders_alike(tokenizer: Any, messages: Sequence[Message], tools: Tools, other: Sequence[Message],
                  other_tools: Tools, *, add_generation_prompt: bool = False) -> bool:
    """The template writes the same text for both conversations (it leaves out what tells them
    apart); False when it refuses either."""
    try:
        return (render(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
                == render(tokenizer, other, tools=other_tools, add_generation_prompt=add_generation_prompt))
    except ConversationError:
        return False  # a bad record: reported as such when it is tokenized


def _ignored(origin: str, what: str) -> DataError:
    return DataError(f"{origin}: the record has {what}, which the chat template does not write into the "
                     "text: use a template that renders them (model.chat_template)")


def with_system(messages: list[Message], system: str | None) -> list[Message]:
    """`messages` opened by the system message `system` (`data.system_prompt`), unless they have one."""
    if not system or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def check_roles(messages: Sequence[Message]) -> None:
    """Role order every template accepts: a non-empty list whose only system message comes first."""
    if not messages:
        raise ConversationError("empty conversation")
    for number, message in enumerate(messages, 1):
        if message["role"] == "system" and number > 1:
            raise ConversationError(f"message {number}: a system message may only come first")


def render(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = False,
           tools: Tools = None) -> str:
    """The chat template's text for `messages` (and the `tools` offered, which the template writes
    where it will); a template error becomes `ConversationError`."""
    extra = {"tools": list(tools)} if tools else {}
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except Exception as err:  # a template is user code: jinja's raise_exception, TypeError, ...
        raise ConversationError(f"the chat template rejects this conversation: {err}") from None


def encode(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of rendered text (no special tokens added: the template wrote them) and their offsets.

    `verbose=False`: `transformers` would warn of "indexing errors" for a text longer than the
    model's context, but too-long conversations are truncated or dropped here, never fed whole.
    """
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(encoding["input_ids"]), list(encoding["offset_mapping"])


def count_tokens(tokenizer: Any, text: str) -> int:
    """The number of tokens `encode` gives for `text` (no offsets computed)."""
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def probe_chars(limit: int) -> int:
    """Texts of more characters than this are measured on prefixes first (`fits`)."""
    return PROBE_CHARS_PER_TOKEN * (limit + BOUNDARY_TOKENS)


def fits(tokenizer: Any, text: str, limit: int) -> bool:
    """Whether `text` has at most `limit` tokens, without tokenizing all of a text far too long.

    A long text (over `probe_chars(limit)` characters) is tokenized on prefixes of doubling length
    first: a prefix of more than `limit + BOUNDARY_TOKENS` tokens settles it (the whole text has at
    least `limit + 1`), at a cost in proportion to `limit` rather than to the text: a 50 MB record
    is not tokenized in full to be dropped. Otherwise the whole text is counted.
    """
    size = probe_chars(limit)
    while size < len(text):
        if count_tokens(tokenizer, text[:size]) > limit + BOUNDARY_TOKENS:
            return False
        size *= 2
    return count_tokens(tokenizer, text) <= limit


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[Message], *, train_on: TrainOn = "assistant", tools: Tools = None
) -> TokenizedExample:
    """Render `messages` with the tokenizer's chat template and label the trained tokens.

    `messages` are normalized `{"role", "content"}` dicts. A conversation without an assistant turn
    comes back with no trained token (the caller drops and counts it); a broken role order or a
    template error raises `ConversationError`.
    """
    check_roles(messages)
    text = render(tokenizer, messages, tools=tools)
    input_ids, offsets = encode(tokenizer, text)
    if train_on == "all":
        labels = list(input_ids)
    else:
        spans = trained_spans(tokenizer, messages, text, train_on=train_on, tools=tools)
        labels = label_tokens(input_ids, offsets, spans)
    if labels:
        labels[0] = IGNORE_INDEX
    return TokenizedExample(input_ids, labels)


def trained_spans(
    tokenizer: Any, messages: Sequence[Message], text: str, *, train_on: TrainOn = "assistant",
    tools: Tools = None,
) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of `text` (the full rendering) that carry loss."""
    turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if train_on == "last_assistant":
        turns = turns[-1:]
    spans = []
    cursor = 0
    for k in turns:
        span = locate_turn(tokenizer, messages, k, text, cursor, tools=tools)
        if span is not None:
            spans.append(span)
            cursor = span[1]
    return spans


def locate_turn(
    tokenizer: Any, messages: Sequence[Message], k: int, text: str, cursor: int, *, tools: Tools = None
) -> tuple[int, int] | None:
    """Where assistant message k's body (content + closing) lies in `text`, searching from `cursor`.

    None when the template renders nothing for the turn (nothing to train).
    """
    turn = render(tokenizer, messages[: k + 1], tools=tools)
    try:
        prompt = render(tokenizer, messages[:k], add_generation_prompt=True, tools=tools)
    except ConversationError:  # some templates refuse an empty list, or a prompt ending on a tool turn
        prompt = None
    content = messages[k]["content"].strip()
    candidates: list[tuple[str, str]] = []  # (text to find, the text that precedes it in `turn`)
    if prompt is not None:
        shared = _common_prefix_len(prompt, turn)
        body = turn[shared:]
        candidates.append((body.rstrip(), turn[:shared]))
        # A template that writes something before the content of the final turn only (an empty
        # reasoning block, say): that text is absent from earlier turns of the full rendering.
        at = body.find(content) if content else -1
        if at > 0:
            candidates.append((body[at:].rstrip(), turn[:shared]))
    else:
        # No prompt to diff against: the turn's content is the last thing the template wrote.
        at = turn.rfind(content) if content else -1
        body = turn[at:] if at >= 0 else ""
        if at >= 0:
            candidates.append((body.rstrip(), turn[:at]))
    candidates = [(piece, context) for piece, context in candidates if piece]
    for piece, context in candidates:
        if len(context) >= cursor and text.startswith(context) and text.startswith(piece, len(context)):
            return len(context), len(context) + len(piece)
    # The template renders earlier turns differently once later ones exist (a system prompt moved
    # to the last user turn, say): search the text instead.
    header = _generation_header(tokenizer, messages, k, prompt, tools)
    for piece, context in candidates:
        start = _search(text, piece, context, cursor, len(header) + 1)
        if start is not None:
            return start, start + len(piece)
    if not body.strip():
        return None
    raise ConversationError(
        f"message {k + 1}: cannot find this assistant turn of the template's rendering in the rendering "
        "of the whole conversation (the template renders it differently in context)"
    )


def _generation_header(tokenizer: Any, messages: Sequence[Message], k: int, prompt: str | None,
                       tools: Tools) -> str:
    """What the generation prompt adds after message k-1 (`<|im_start|>assistant\\n`; empty for Mistral)."""
    if prompt is None:
        return ""
    try:
        before = render(tokenizer, messages[:k], tools=tools)
    except ConversationError:
        return ""
    return prompt[_common_prefix_len(before, prompt):]


def label_tokens(
    input_ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """`labels[i] = input_ids[i]` when token i's characters overlap a span (sorted, disjoint), else -100.

    Overlap rather than containment: a token that starts with the space before an answer ("Ġanswer")
    is the answer's first token and must be trained.
    """
    labels = [IGNORE_INDEX] * len(input_ids)
    j = 0
    for i, (start, end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j == len(spans):
            break
        # A zero-width token counts as the point `start`.
        if start < spans[j][1] and max(end, start + 1) > spans[j][0]:
            labels[i] = input_ids[i]
    return labels


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens, added ones (a base vocabulary's `<|im_end|>`) included."""
    return set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))


def turn_end_ids(tokenizer: Any) -> list[int]:
    """The special token(s) the chat template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`,
    `</s>`, `<end_of_turn>`): a reply is over when the model writes one, whatever the tokenizer's EOS.

    Read from the trained tokens of a one-exchange conversation; empty when the template closes the
    turn with plain text, or refuses the conversation.
    """
    special = special_ids(tokenizer)
    try:
        example = tokenize_conversation(tokenizer, ONE_EXCHANGE)
    except ConversationError:
        return []
    trained = [t for t in example.labels if t != IGNORE_INDEX]
    return list(dict.fromkeys(t for t in trained if t in special))


def trained_segments(tokenizer: Any, example: TokenizedExample) -> list[tuple[str, bool]]:
    """The example's text as runs `(text, trained)`, decoded run by run (for `ligertune data --show`)."""
    segments: list[tuple[str, bool]] = []
    start = 0
    n = len(example.input_ids)
    for i in range(1, n + 1):
        if i == n or (example.labels[i] != IGNORE_INDEX) != (example.labels[start] != IGNORE_INDEX):
            text = tokenizer.decode(
                example.input_ids[start:i], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            segments.append((text, example.labels[start] != IGNORE_INDEX))
            start = i
    return segments


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    # Binary search on slice equality: a C-speed compare per step instead of a Python loop per char.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix_len(text: str, end: int, context: str) -> int:
    """Length of the longest common suffix of `text[:end]` and `context`."""
    lo, hi = 0, min(end, len(context))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text[end - mid : end] == context[len(context) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _search(text: str, piece: str, context: str, cursor: int, enough: int) -> int | None:
    """The first occurrence of `piece` in `text[cursor:]` whose preceding text agrees with `context`
    on at least `enough` characters (the assistant header and more), else the best-agreeing one.

    Taking the first good occurrence rather than the best one matters when an exchange repeats
    word for word: the later copy may agree with the context even further back.
    An occurrence inside a user message agrees only up to the role header, which differs.
    """
    best, best_score = None, -1
    start = text.find(piece, cursor)
    while start != -1:
        score = _common_suffix_len(text, start, context)
        if score >= enough:
            return start
        if score > best_score:
            best, best_score = start, score
        start = text.find(piece, start + 1)
    return best
