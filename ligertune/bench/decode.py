"""`ligertune bench decode RUN`: answers/s at batch 1 with each draft against plain decoding.

Each draft answers the same prompts greedily through `generate_reply`, the function `chat` calls
(what is timed is what answers); `none` is plain `model.generate`. The drafts take turns on each
prompt. Per draft: reply tokens per second over all prompts (the median of `repeats` timings of each
prompt), reply tokens per model forward, drafted tokens kept per forward, the share kept at each
depth, and whether every answer is the plain greedy one (it must be: verification keeps only what
greedy decoding would write).

A prompt is a list of messages: a `-p` string is one user turn; a conversation of a chat-data file
(`--prompts-from`) is its messages before its last assistant turn, so the model answers its last
user turn in context.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from ligertune.data.formats import Message, read_conversations
from ligertune.decoding import DRAFTS, DecodeStats, make_drafter
from ligertune.errors import DataError, UserError

DEFAULT_PROMPTS = (
    "Repeat this list exactly, twice: apples, pears, plums, figs, apples, pears, plums, figs.",
    "Rewrite in capital letters: the quick brown fox jumps over the lazy dog.",
    "what comes after d?",
    "Write a short poem about the sea.",
)
"""Two prompts whose answers copy the prompt (where n-gram drafts shine) and two open ones."""

Prompt = list[Message]
"""The messages a reply answers: the last is the user turn (or a tool result) to answer."""


def user_prompt(text: str) -> Prompt:
    return [{"role": "user", "content": text}]


def prompt_of(messages: list[Message]) -> Prompt:
    """A conversation's messages before its last assistant turn, or all of them when no assistant turn
    follows its last user turn (a conversation that ends on the question)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[:last_assistant] if last_assistant > last_user else list(messages)


def prompt_text(prompt: Prompt) -> str:
    """What the report shows of a prompt: its last user turn."""
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def prompts_from(path: Path, *, limit: int | None = None) -> list[Prompt]:
    """A prompt (`prompt_of`) from each conversation of a local chat-data file, the first `limit` of
    them when given; any format `data.path` reads (`ligertune.data.formats`)."""
    if not path.is_file():
        raise UserError(f"--prompts-from {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        conversations = read_conversations(str(path)).conversations
    except DataError as err:
        raise UserError(f"--prompts-from {err}") from None
    prompts = []
    for conversation in conversations[:limit]:
        if not any(m["role"] == "user" for m in conversation.messages):
            raise UserError(f"--prompts-from {conversation.origin}: no user turn to answer")
        prompts.append(prompt_of(conversation.messages))
    if not prompts:
        raise UserError(f"--prompts-from {path}: no conversations")
    return prompts


def bench_prompts(texts: Sequence[str] = (), file: Path | None = None, *, max_prompts: int | None = None
                  ) -> tuple[Prompt, ...]:
    """The `-p` prompts, then those of `--prompts-from` (its first `max_prompts`); the defaults when
    neither is given."""
    if max_prompts is not None and file is None:
        raise UserError("--max-prompts: give --prompts-from FILE to take the prompts from")
    prompts = [user_prompt(t) for t in texts]
    if file is not None:
        prompts += prompts_from(file, limit=max_prompts)
    return tuple(prompts or (user_prompt(t) for t in DEFAULT_PROMPTS))


@dataclass
class DecodeBenchConfig:
    drafts: tuple[str, ...] = ("none", "ngram")
    prompts: tuple[Prompt, ...] = field(default_factory=bench_prompts)
    max_new_tokens: int = 128
    repeats: int = 3
    """Timed answers of each prompt; the median counts."""
    warmup: int = 1
    """Untimed answers first, per draft (the first prompt)."""
    depth: int = 5
    """Tokens ahead an n-gram draft proposes."""
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False


@dataclass
class DecodeRow:
    draft: str
    tokens: int
    """Reply tokens over all prompts."""
    seconds: float
    """Sum over the prompts of each one's median time."""
    forwards: int
    tokens_per_s: float
    tokens_per_step: float
    mean_accepted: float
    acceptance_per_depth: list[float]
    speedup: float | None
    """tokens/s against the `none` row (when there is one)."""
    same_as_plain: bool | None
    """Every answer is token for token the `none` row's (when there is one)."""


@dataclass
class DecodeReport:
    model: str
    device: str
    dtype: str
    max_new_tokens: int
    repeats: int
    prompts: list[str]
    """Each prompt's last user turn."""
    rows: list[DecodeRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def check_drafts(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in DRAFTS]
    if unknown or not names:
        raise UserError(f"--drafts: expected some of {', '.join(DRAFTS)}, got {', '.join(names) or 'none'}")


def run_decode_bench(path: Path, config: DecodeBenchConfig, *, log: Callable[[str], None] = print) -> DecodeReport:
    """Load the model of `path` (a run, a checkpoint or a model folder) and time each draft on the prompts."""
    from ligertune.inference import generate_reply, load_for_inference, require_chat_template

    check_drafts(config.drafts)
    if not config.prompts:
        raise UserError("--prompt: give at least one prompt")
    loaded = load_for_inference(path, device=config.device, dtype=config.dtype,
                                trust_remote_code=config.trust_remote_code)
    require_chat_template(loaded)
    report = DecodeReport(model=str(path), device=loaded.device.type, dtype=str(loaded.dtype).removeprefix("torch."),
                          max_new_tokens=config.max_new_tokens, repeats=config.repeats,
                          prompts=[prompt_text(p) for p in config.prompts])
    drafters = {name: None if name == "none" else make_drafter(name, model_dir=loaded.source.model_dir,
                                                                depth=config.depth)
                for name in config.drafts}

    def answer(prompt: Prompt, name: str):
        return generate_reply(loaded.model, loaded.tokenizer, prompt, max_new_tokens=config.max_new_tokens,
                              draft=drafters[name])

    for name in config.drafts:
        for _ in range(config.warmup):
            answer(config.prompts[0], name)
    # The drafts take turns on each prompt, so a drift of the machine's speed (clocks, other
    # processes, the host's scheduling) falls on every draft alike rather than on whichever ran last.
    timed = {name: [[] for _ in config.prompts] for name in config.drafts}  # [prompt][repeat]
    for i, prompt in enumerate(config.prompts):
        for _ in range(config.repeats):
            for name in config.drafts:
                timed[name][i].append(answer(prompt, name))
    answers: dict[str, list[str]] = {}
    for name in config.drafts:
        replies = [runs[0] for runs in timed[name]]
        seconds = sum(statistics.median(r.seconds for r in runs) for runs in timed[name])
        answers[name] = [r.text for r in replies]
        stats = DecodeStats.pooled([r.stats for r in replies])
        row = DecodeRow(
            draft=name, tokens=stats.tokens, seconds=seconds, forwards=stats.forwards,
            tokens_per_s=stats.tokens / seconds if seconds > 0 else 0.0, tokens_per_step=stats.tokens_per_step,
            mean_accepted=stats.mean_accepted, acceptance_per_depth=stats.acceptance_per_depth(),
            speedup=None, same_as_plain=None,
        )
        report.rows.append(row)
        log(f"{name}: {row.tokens_per_s:.1f} tokens/s, {row.tokens_per_step:.2f} tokens per forward")
    plain = next((r for r in report.rows if r.draft == "none"), None)
    if plain is not None:
        for row in report.rows:
            row.speedup = row.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else None
            row.same_as_plain = answers[row.draft] == answers["none"]
    return report


def decode_table(report: DecodeReport) -> Table:
    table = Table(title=f"decoding at batch 1: {report.model}, {report.device}, {report.dtype}, "
                        f"{len(report.prompts)} prompts, up to {report.max_new_tokens} tokens each")
    for column in ("draft", "tokens/s", "speedup", "tokens/fwd", "kept/fwd", "kept by depth", "same"):
        table.add_column(column, justify="left" if column in ("draft", "kept by depth") else "right")
    for row in report.rows:
        table.add_row(
            row.draft, f"{row.tokens_per_s:.1f}", "" if row.speedup is None else f"{row.speedup:.2f}x",
            f"{row.tokens_per_step:.2f}", f"{row.mean_accepted:.2f}",
            " ".join(f"{r:.0%}" for r in row.acceptance_per_depth),
            "" if row.same_as_plain is None else ("yes" if row.same_as_plain else "NO"),
        )
    return table
