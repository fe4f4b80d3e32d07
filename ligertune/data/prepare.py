"""From the recipe's `data` section to tokenized training and evaluation examples.

For every source (`data.path`, or each of `data.sources`, and `data.eval_path`):

1. read and normalize its records (`formats`), applying `on_bad_record`;
2. render and mask each conversation (`chat.tokenize_conversation`), in parallel over
   `num_workers` processes when there is enough data to pay for them;
3. apply the length policy: a conversation longer than `max_seq_len` loses trailing turns until
   it fits, cutting after an assistant turn so it still ends on a trained answer
   (`truncation: drop_turns`; dropped when even the first answer does not fit), or is dropped
   (`truncation: drop`). A conversation with no trained token is dropped. All are counted;
4. cache the result per source (`cache`).

Then, deterministically under `seed`: `eval_fraction` holds out that share of every source, and
the training part of each source is resized by `weight` or `samples`. A source of n conversations
that must give m is repeated floor(m / n) times in full, plus a random m mod n of its conversations
without replacement: as close to the asked share as sampling with replacement, with less noise.
With weights, m_i = round(N * w_i / sum(w)) where N is the total number of training conversations.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ligertune.data import cache
from ligertune.data.chat import (
    ConversationError,
    TokenizedExample,
    check_renders_tools,
    check_roles,
    check_tokenizer,
    fits,
    probe_chars,
    render,
    tokenize_conversation,
    with_system,
)
from ligertune.data.formats import Conversation, read_conversations, source_fingerprint
from ligertune.data.stats import DataStats, SourceStats, merge_counts
from ligertune.errors import DataError
from ligertune.recipe import DataConfig, DataSource

# Below this many conversations per worker, starting processes costs more than it saves.
PARALLEL_MIN_PER_WORKER = 256
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
BAD_RECORD_EXAMPLES = 5


@dataclass
class PreparedData:
    """Tokenized conversations ready for packing, and what happened on the way."""

    train: list[TokenizedExample]
    eval: list[TokenizedExample]
    stats: DataStats


@dataclass(frozen=True)
class TokenizeSettings:
    """The settings that shape a tokenized example (and so key the cache)."""

    train_on: str
    max_seq_len: int
    truncation: str
    system_prompt: str | None = None


@dataclass
class Outcome:
    """What became of one conversation: kept (`ok`, `truncated`), dropped (a reason) or `bad`."""

    status: str
    example: TokenizedExample | None = None
    turns_removed: int = 0
    problem: str = ""


# --------------------------------------------------------------------------------------------------
# One conversation


def process_conversation(tokenizer: Any, conversation: Conversation, settings: TokenizeSettings) -> Outcome:
    """Tokenize, mask and fit one conversation to `max_seq_len`.

    A conversation of many more characters than `max_seq_len` could hold is measured before it is
    tokenized and masked (`chat.fits`); when it cannot fit, it goes straight to the length policy,
    and is counted as it would be after tokenizing it all.
    """
    messages, tools = conversation.messages, conversation.tools
    try:
        if sum(len(m["content"]) for m in messages) > probe_chars(settings.max_seq_len):
            check_roles(messages)
            if not fits(tokenizer, render(tokenizer, messages, tools=tools), settings.max_seq_len):
                return fit_too_long(tokenizer, conversation, settings)
        example = tokenize_conversation(tokenizer, messages, train_on=settings.train_on, tools=tools)
        if example.trained_tokens == 0:
            return Outcome("no_trained_tokens")
        if len(example) > settings.max_seq_len:
            return fit_too_long(tokenizer, conversation, settings)
    except ConversationError as err:
        return Outcome("bad", problem=f"{conversation.origin}: {err}")
    example.origin = conversation.origin
    return Outcome("ok", example)


def fit_too_long(tokenizer: Any, conversation: Conversation, settings: TokenizeSettings) -> Outcome:
    """The length policy for a conversation longer than `max_seq_len` (`truncation`)."""
    if settings.train_on != "all" and not any(m["role"] == "assistant" for m in conversation.messages):
        return Outcome("no_trained_tokens")  # what tokenizing it would have found first
    if settings.truncation == "drop":
        return Outcome("too_long")
    example, removed = drop_trailing_turns(tokenizer, conversation.messages, settings,
                                           tools=conversation.tools)
    if example is None:
        return Outcome("too_long")
    if example.trained_tokens == 0:
        return Outcome("no_trained_tokens")
    example.origin = conversation.origin
    return Outcome("truncated", example, removed)


def drop_trailing_turns(
    tokenizer: Any, messages: Sequence[dict], settings: TokenizeSettings, *,
    tools: Sequence[dict] | None = None,
) -> tuple[TokenizedExample | None, int]:
    """The longest prefix ending on an assistant turn that fits, and how many messages it lost.

    The rendered length grows with the number of messages, so the cut is found by bisection over
    the assistant turns: O(log turns) renderings instead of one per removed turn.
    """
    cuts = [k + 1 for k, m in enumerate(messages) if m["role"] == "assistant" and k + 1 < len(messages)]
    lo, hi, best = 0, len(cuts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(tokenizer, render(tokenizer, messages[: cuts[mid]], tools=tools), settings.max_seq_len):
            best, lo = cuts[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        return None, 0
    example = tokenize_conversation(tokenizer, messages[:best], train_on=settings.train_on, tools=tools)
    return example, len(messages) - best


# --------------------------------------------------------------------------------------------------
# Many conversations, possibly in parallel

# Per worker process: set once by the pool initializer (the tokenizer is sent once per worker, not
# once per task); the parent process never reads or writes it.
_worker_job: dict[str, Any] = {}


def _init_worker(tokenizer: Any, settings: TokenizeSettings) -> None:
    # Ctrl-C is the parent's to handle (a terminal sends it to every process of the command): it
    # stops the pool, and no worker prints a traceback of its own. SIGTERM, which the pool's
    # terminate() sends, ends a worker at once, whatever handler the fork copied from the parent.
    # Both were held back while the pool forked (`make_pool`): let them through now.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _worker_job["tokenizer"], _worker_job["settings"] = tokenizer, settings


def _process_chunk(chunk: list[Conversation]) -> list[Outcome]:
    tokenizer, settings = _worker_job["tokenizer"], _worker_job["settings"]
    return [process_conversation(tokenizer, c, settings) for c in chunk]


def worker_count(num_workers: int | None) -> int:
    if num_workers is not None:
        return num_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def make_pool(tokenizer: Any, settings: TokenizeSettings, workers: int):
    """A process pool whose workers hold the tokenizer.

    fork on Linux: no re-import, and the tokenizer is inherited rather than pickled. The pool is
    made before any progress display starts its thread, so no lock is copied mid-use.

    SIGINT and SIGTERM are held back while the workers fork: one that arrived then would be raised
    in a callback Python runs after each fork (logging's), where an exception is only printed, and
    the command would go on as if it had never come. Held back, it is raised here once the pool
    is made (whose workers then stop as the process exits).
    """
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    context = multiprocessing.get_context(method)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pool = context.Pool(workers, initializer=_init_worker, initargs=(tokenizer, settings))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # raises the signal held back, if any
    return pool


def tokenize_conversations(
    conversations: Sequence[Conversation],
    tokenizer: Any,
    settings: TokenizeSettings,
    *,
    pool: Any = None,
    workers: int = 1,
    on_progress: Any = None,
) -> list[Outcome]:
    """`process_conversation` over every conversation, in order; on `pool` when one is given."""
    on_progress = on_progress or (lambda n: None)
    if pool is None:
        outcomes = []
        for conversation in conversations:
            outcomes.append(process_conversation(tokenizer, conversation, settings))
            on_progress(1)
        return outcomes
    # Several chunks per worker keep them all busy to the end; chunks big enough to amortize IPC.
    size = max(16, min(2048, len(conversations) // (8 * workers) + 1))
    chunks = [list(conversations[i : i + size]) for i in range(0, len(conversations), size)]
    outcomes = []
    for result in pool.imap(_process_chunk, chunks):
        outcomes.extend(result)
        on_progress(len(result))
    return outcomes


# --------------------------------------------------------------------------------------------------
# Sources


@dataclass
class SourceData:
    """One source after tokenization: usable examples, counts, and the bad records (with file:line)."""

    examples: list[TokenizedExample]
    stats: SourceStats
    bad: list[str]


def collect(outcomes: Sequence[Outcome], data: SourceData, on_bad_record: str) -> None:
    """Keep the examples, count the rest; the first bad conversation raises under `on_bad_record: error`."""
    stats = data.stats
    for outcome in outcomes:
        if outcome.status == "bad":
            if on_bad_record == "error":
                raise DataError(outcome.problem)
            stats.bad_records += 1
            data.bad.append(outcome.problem)
        elif outcome.example is None:
            stats.dropped[outcome.status] = stats.dropped.get(outcome.status, 0) + 1
        else:
            data.examples.append(outcome.example)
            if outcome.status == "truncated":
                stats.truncated["trailing_turns"] = stats.truncated.get("trailing_turns", 0) + 1
                stats.turns_removed += outcome.turns_removed
    stats.kept = len(data.examples)


def load_sources(cfg: DataConfig, tokenizer: Any, sources: Sequence[DataSource], *,
                 show_progress: bool) -> list[SourceData]:
    """Every source tokenized: from the cache, or read, tokenized (one pool for all) and cached."""
    settings = TokenizeSettings(cfg.train_on, cfg.max_seq_len, cfg.truncation, cfg.system_prompt)
    tokenizer_fp = cache.tokenizer_fingerprint(tokenizer) if cfg.cache_dir is not None else None
    results: list[SourceData] = []
    todo: list[tuple[SourceData, list[Conversation], Path | None]] = []
    for source in sources:
        fmt = cfg.format if source.format == "auto" else source.format
        fingerprint = source_fingerprint(source.path) if tokenizer_fp is not None else None
        path = None
        if fingerprint is not None:
            key = cache.cache_key(source=fingerprint, format=fmt, split=source.split,
                                  on_bad_record=cfg.on_bad_record, settings=dataclasses.asdict(settings),
                                  tokenizer=tokenizer_fp)
            path = cache.cache_path(cfg.cache_dir, key)
        hit = cache.load(path) if path is not None else None
        if hit is not None:
            examples, meta = hit
            stats = SourceStats(**{**meta["stats"], "cached": True})
            results.append(SourceData(examples, stats, meta["bad"]))
            continue
        read = read_conversations(source.path, fmt=fmt, split=source.split, on_bad_record=cfg.on_bad_record)
        conversations = [dataclasses.replace(c, messages=with_system(c.messages, cfg.system_prompt))
                         for c in read.conversations]
        check_renders_tools(tokenizer, conversations)
        stats = SourceStats(source.path, records=read.records, bad_records=len(read.bad))
        data = SourceData([], stats, read.bad)
        results.append(data)
        todo.append((data, conversations, path))
    if not todo:
        return results

    total = sum(len(conversations) for _, conversations, _ in todo)
    workers = min(worker_count(cfg.num_workers), max(1, total // PARALLEL_MIN_PER_WORKER))
    pool = make_pool(tokenizer, settings, workers) if workers > 1 else None
    try:
        with _progress(show_progress) as progress:
            for data, conversations, path in todo:
                # The description is read as rich markup: the path is the user's, printed literally.
                task = progress.add_task(f"tokenizing {escape(_short(data.stats.path))}",
                                         total=len(conversations))
                outcomes = tokenize_conversations(
                    conversations, tokenizer, settings, pool=pool, workers=workers,
                    on_progress=lambda n, task=task: progress.advance(task, n),
                )
                collect(outcomes, data, cfg.on_bad_record)
                if path is not None:
                    meta = {"stats": dataclasses.asdict(data.stats), "bad": data.bad[:BAD_RECORD_EXAMPLES]}
                    try:
                        cache.save(path, data.examples, meta)
                    except OSError:
                        pass  # an unwritable cache only costs the next run its head start
    finally:
        if pool is not None:
            pool.terminate()
    return results


def _progress(show: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("conversations"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not show,
    )


def _short(path: str, width: int = 48) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3):]


# --------------------------------------------------------------------------------------------------
# Splitting and sampling


def hold_out(examples: list, fraction: float, rng: random.Random, *,
             record: Callable[[Any], str] | None = None) -> tuple[list, list]:
    """(train, eval): round(n * fraction) of the n records held out (at least one when fraction > 0
    and n >= 2). A record is one example, or with `record` the examples of one `record(example)` (a
    pair's two KTO examples), held out together so that no held-out prompt is trained on with its
    other answer; with one example a record the split is the same either way."""
    groups: dict[Any, list] = {}
    for i, example in enumerate(examples):
        groups.setdefault(record(example) if record is not None else i, []).append(example)
    records = list(groups.values())
    n = len(records)
    if fraction <= 0 or n < 2:
        return examples, []
    n_eval = min(n - 1, max(1, round(n * fraction)))
    chosen = set(rng.sample(range(n), n_eval))
    return ([e for i, r in enumerate(records) if i not in chosen for e in r],
            [e for i, r in enumerate(records) if i in chosen for e in r])


def take(examples: list[TokenizedExample], count: int, rng: random.Random) -> list[TokenizedExample]:
    """`count` examples: whole copies of the list, then a random subset (without replacement) of the rest."""
    n = len(examples)
    if count == n:
        return list(examples)
    whole, rest = divmod(count, n)
    picked = sorted(rng.sample(range(n), rest))
    return list(examples) * whole + [examples[i] for i in picked]


def target_counts(sources: list[DataSource], sizes: list[int]) -> list[int]:
    """Training conversations to take from each source, from its `samples` or `weight`."""
    if any(s.samples is not None for s in sources):
        return [s.samples if s.samples is not None else size for s, size in zip(sources, sizes)]
    if any(s.weight is not None for s in sources):
        weights = [s.weight if s.weight is not None else 1.0 for s in sources]
        # Shares relative to the largest weight: no sum of huge (or product of tiny) weights overflows.
        top = max(weights)
        shares = [w / top for w in weights]
        total = sum(sizes)
        return [round(total * (share / sum(shares))) for share in shares]
    return list(sizes)


# --------------------------------------------------------------------------------------------------
# Entry point


def prepare_data(cfg: DataConfig, tokenizer: Any, *, seed: int, show_progress: bool = True) -> PreparedData:
    """Read, tokenize, mask, fit, split and weight the recipe's data (see the module docstring).

    Raises `DataError` naming file and line for the first malformed record (unless
    `on_bad_record: skip`), and naming the file when a source (training or evaluation) is empty or
    has no usable conversation left.
    """
    check_tokenizer(tokenizer)
    if cfg.path is None and not cfg.sources:
        raise DataError("data: give `path` (one source) or `sources` (several)")
    train_sources = cfg.sources or [DataSource(path=cfg.path, format=cfg.format, split=cfg.split)]
    all_sources = list(train_sources)
    if cfg.eval_path is not None:
        all_sources.append(DataSource(path=cfg.eval_path, format=cfg.format, split=cfg.split))
    loaded = load_sources(cfg, tokenizer, all_sources, show_progress=show_progress)
    for i, data in enumerate(loaded):
        check_usable(data)
        for example in data.examples:  # fresh objects of this call (read or loaded from the cache)
            example.source = i

    train_parts, eval_parts = [], []
    for i, data in enumerate(loaded[: len(train_sources)]):
        rng = random.Random(f"ligertune-data:{seed}:eval:{i}")
        train_i, eval_i = hold_out(data.examples, cfg.eval_fraction, rng)
        data.stats.eval = len(eval_i)
        train_parts.append(train_i)
        eval_parts.append(eval_i)
    if cfg.eval_path is not None:
        eval_data = loaded[-1]
        eval_data.stats.eval = len(eval_data.examples)
        eval_parts.append(eval_data.examples)

    counts = target_counts(train_sources, [len(part) for part in train_parts])
    train: list[TokenizedExample] = []
    for i, (part, count) in enumerate(zip(train_parts, counts)):  # no part is empty (`check_usable`)
        taken = take(part, count, random.Random(f"ligertune-data:{seed}:take:{i}"))
        loaded[i].stats.taken = len(taken)
        train.extend(taken)
    eval_examples = [e for part in eval_parts for e in part]
    return PreparedData(train, eval_examples, summarize(loaded, train, eval_examples))


def check_usable(data: SourceData) -> None:
    """A source that gives no conversation at all is a mistake: say which, and what became of it."""
    stats = data.stats
    if data.examples:
        return
    if stats.records == 0:
        raise DataError(f"{stats.path}: no records (the file is empty)")
    fates = [f"{reason.replace('_', ' ')}: {count}" for reason, count in sorted(stats.dropped.items())]
    if stats.bad_records:
        fates.append(f"bad records skipped: {stats.bad_records}")
    records = f"{stats.records} record{'s' * (stats.records != 1)}"
    raise DataError(f"{stats.path}: no usable conversation among its {records} "
                    f"({'; '.join(fates) or 'none kept'})")


def summarize(loaded: list[SourceData], train: list[TokenizedExample], eval_examples: list[TokenizedExample]
              ) -> DataStats:
    stats = DataStats(sources=[data.stats for data in loaded])
    for data in loaded:
        s = data.stats
        stats.conversations_read += s.records
        stats.bad_records += s.bad_records
        merge_counts(stats.dropped, s.dropped)
        merge_counts(stats.truncated, s.truncated)
        stats.turns_removed += s.turns_removed
        stats.bad_record_examples.extend(data.bad[: BAD_RECORD_EXAMPLES - len(stats.bad_record_examples)])
    stats.train_conversations = len(train)
    stats.eval_conversations = len(eval_examples)
    stats.total_tokens = sum(len(e) for e in train)
    stats.trained_tokens = sum(e.trained_tokens for e in train)
    stats.eval_total_tokens = sum(len(e) for e in eval_examples)
    stats.eval_trained_tokens = sum(e.trained_tokens for e in eval_examples)
    return stats
