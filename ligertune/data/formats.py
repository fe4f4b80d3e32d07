"""Reading chat records from files or the hub, and normalizing them to `{"role", "content"}` messages.

Three record formats are accepted (`data.format`, or detected from a source's first record):

    messages           {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", ...}]}
    sharegpt           {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", ...}]}
    prompt_completion  {"prompt": "Hi", "completion": "Hello!"}   (either side may be a message list)

Preference data has formats of its own (`detect_preference_format`; read by
`ligertune.data.preference`):

    paired                {"prompt": "2+2?", "chosen": "4.", "rejected": "5."}   (message lists too)
    paired_conversations  {"chosen": [user, assistant], "rejected": [user, assistant]}  (TRL style)
    unpaired              {"prompt": "2+2?", "completion": "5.", "label": false}  (KTO)

Every record keeps its origin (`path:line`, `path:row N` for Parquet and hub rows), so that a
malformed one is reported where a person can find it. Messages are counted from 1 in messages,
like lines.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ligertune import hub
from ligertune.errors import DataError, EnvironmentFault, first_line

FORMATS = ("messages", "sharegpt", "prompt_completion")
PREFERENCE_FORMATS = ("paired", "paired_conversations", "unpaired")
ROLES = ("system", "user", "assistant", "tool")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")

# ShareGPT speaker names, including the tool-calling variants some datasets use.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}

Message = dict[str, Any]  # role and content (a string); an assistant's tool_calls, a tool's tool_call_id


@dataclass
class Conversation:
    """One normalized conversation, where it came from, and the tools (function definitions) its
    record offers the model, rendered by the chat template (`apply_chat_template(tools=...)`)."""

    messages: list[Message]
    origin: str
    tools: list[dict] | None = None


class RecordError(ValueError):
    """A malformed record; the reader adds its origin before it reaches the user."""


@dataclass
class BadRecord:
    """A record that could not be parsed at all (invalid JSON, not UTF-8)."""

    problem: str


# --------------------------------------------------------------------------------------------------
# Reading raw records


def is_local(path: str) -> bool:
    """A source is a local file when it exists, names a data file, or is meant as a path
    (`ligertune.hub.meant_as_path`: `./x`, `a/b/c`, `data/x` beside a folder `data`, a pattern such
    as `shards/*.jsonl`); anything else is a hub dataset name."""
    return Path(path).suffix.lower() in LOCAL_SUFFIXES or hub.meant_as_path(path)


def is_pattern(path: str) -> bool:
    """`path` names several files by a glob pattern (`*`, `?`, `[...]`; `**` for any folders), and no
    file of that very name exists (`runs [old]/train.jsonl` is a path)."""
    return glob.has_magic(path) and not Path(path).expanduser().exists()


def local_files(path: str) -> list[Path]:
    """The files a local source names: the file itself, or every file a pattern matches, in name order.

    A folder is refused rather than read whole: a downloaded hub dataset keeps each split's files in
    one folder, and reading them all would train on the test split. Raises `DataError`.
    """
    expanded = str(Path(path).expanduser())
    if is_pattern(path):
        files = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"{path}: data file not found (read as a pattern, it matches no file)")
    else:
        files = [Path(expanded)]
        if not files[0].exists():
            raise DataError(f"{path}: data file not found")
        if files[0].is_dir():
            raise DataError(f"{path}: is a folder; name a .jsonl, .json or .parquet file in it, or its files "
                            f"by a pattern ({Path(path) / '*.jsonl'})")
    for file in files:
        if file.suffix.lower() not in LOCAL_SUFFIXES:
            named = f"{file} (matched by {path})" if is_pattern(path) else path
            raise DataError(f"{named}: unsupported file type {file.suffix.lower()!r} "
                            "(expected .jsonl, .json or .parquet)")
    return files


def iter_records(path: str, *, split: str = "train") -> Iterator[tuple[str, Any]]:
    """Yield `(origin, record)` for every record of a source, in order: a file's records, or those of
    each file a pattern matches, file by file in name order (origins name the file).

    A record that cannot be parsed comes back as a `BadRecord` so the caller can apply its
    `on_bad_record` policy; a source that cannot be opened raises `DataError`.
    """
    if not is_local(path):
        yield from _iter_hub(path, split)
        return
    pattern = is_pattern(path)
    for file in local_files(path):
        name = str(file) if pattern else path
        try:
            if file.suffix.lower() == ".parquet":
                yield from _iter_parquet(file, name)
            else:
                yield from _iter_json(file, name)
        except OSError as err:  # permission denied, a special file, an I/O error
            raise DataError(f"{name}: cannot read: {err.strerror or err}") from None


def _iter_json(file: Path, name: str) -> Iterator[tuple[str, Any]]:
    """JSON Lines, or one JSON array of records (a `.json` file whose first character is `[`)."""
    with file.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        yield from _iter_json_array(file, name)
        return
    with file.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                record = BadRecord("not valid UTF-8")
            except json.JSONDecodeError as err:
                record = BadRecord(f"invalid JSON: {err.msg} (column {err.colno})")
            except RecursionError:
                record = BadRecord("invalid JSON: nested too deeply")
            except ValueError as err:  # an integer of over 4300 digits
                record = BadRecord(f"invalid JSON: {first_line(err)}")
            yield f"{name}:{lineno}", record


def _iter_json_array(file: Path, name: str) -> Iterator[tuple[str, Any]]:
    """Decode a top-level array element by element, so each record knows the line it starts on; a
    record that starts on the line of an earlier one is told apart by its place in the array
    (`data.json:1 (record 3)`), so that no two records of a file share an origin.

    After a syntax error inside an array there is no next record to resynchronize on, so that error
    stops the read whatever `on_bad_record` says.
    """
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"{name}: not valid UTF-8 (byte {err.start})") from None
    decoder = json.JSONDecoder()
    # Lines are counted incrementally: counting from the start for every record is quadratic.
    counted, line = 0, 1

    def advance(to: int) -> None:
        nonlocal counted, line
        line += text.count("\n", counted, to)
        counted = to

    def skip_space(pos: int) -> int:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        return pos

    pos = skip_space(text.index("[") + 1)
    index, previous_line = 0, 0
    while pos < len(text) and text[pos] != "]":
        advance(pos)
        index += 1
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise DataError(f"{name}:{err.lineno}: invalid JSON: {err.msg} (column {err.colno})") from None
        except RecursionError:
            raise DataError(f"{name}:{line}: invalid JSON: nested too deeply") from None
        except ValueError as err:  # an integer of over 4300 digits
            raise DataError(f"{name}:{line}: invalid JSON: {first_line(err)}") from None
        yield (f"{name}:{line}" if line != previous_line else f"{name}:{line} (record {index})"), record
        previous_line = line
        pos = skip_space(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_space(pos + 1)
        elif pos < len(text) and text[pos] != "]":
            advance(pos)
            raise DataError(f"{name}:{line}: invalid JSON: expected ',' or ']' after a record")
    if pos >= len(text):
        advance(len(text))
        raise DataError(f"{name}:{line}: invalid JSON: the array is not closed")


def _iter_parquet(file: Path, name: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{name}: reading Parquet needs pyarrow (pip install 'ligertune[parquet]')") from None
    try:
        reader = pq.ParquetFile(file)
        row = 0
        for batch in reader.iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                row += 1
                yield f"{name}:row {row}", record
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{name}: cannot read Parquet: {err}") from None


def _iter_hub(name: str, split: str) -> Iterator[tuple[str, Any]]:
    """Rows of a hub dataset through `datasets.load_dataset` (imported only when needed).

    When the hub cannot be reached, `datasets` reads its local cache only if told so by
    `HF_HUB_OFFLINE=1` (else it retries for a minute): without that variable, an unreachable hub
    is reported at once.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{name}: no such local file, and reading it as a hub dataset needs the `datasets` "
            "package (pip install 'ligertune[hub]')"
        ) from None
    offline = hub.offline_reason()
    unreachable = (f"{name}: not found locally and the hub cannot be reached (offline: {offline}); "
                   "give a local file, or download the dataset while online")
    if offline is not None and hub.offline_by_env() is None:
        raise EnvironmentFault(f"{unreachable} (or set HF_HUB_OFFLINE=1 to read the `datasets` cache)")
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as err:  # the hub raises many kinds: connection, not found, unknown split
        if offline is not None:
            raise EnvironmentFault(f"{unreachable}: {first_line(err)}") from None
        raise DataError(
            f"{name}: cannot load the hub dataset (split {split!r}): {first_line(err)}"
        ) from None
    for row, record in enumerate(dataset, 1):
        yield f"{name}[{split}]:row {row}", record


def source_fingerprint(path: str) -> str | None:
    """What identifies a local source's content for the cache: each file's resolved path, size and
    mtime (for a pattern, of every file it matches now: a new shard changes it).

    None for hub datasets: they are not cached here (`datasets` keeps its own download cache, and
    their version cannot be known without asking the hub).
    """
    if not is_local(path):
        return None
    try:
        files = local_files(path)
        stats = [(file.resolve(), file.stat()) for file in files]
    except (DataError, OSError):
        return None
    return ";".join(f"{file}|{st.st_size}|{st.st_mtime_ns}" for file, st in stats)


# --------------------------------------------------------------------------------------------------
# Normalizing records


def detect_format(record: Any) -> str:
    """The format a record is written in, from its keys."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {_kind(record)}")
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    keys = ", ".join(map(str, list(record)[:8])) or "none"
    hint = " (preference pairs, which supervised fine-tuning does not read)" if _is_pair(record) else ""
    raise RecordError(
        f"cannot tell the format: expected a `messages`, `conversations` or `prompt` + `completion` "
        f"key, got keys {keys}{hint}"
    )


def detect_preference_format(record: Any) -> str:
    """The preference format a record is written in, from its keys.

    `chosen` + `rejected` are whole conversations (`paired_conversations`) unless a `prompt` stands
    beside them and `chosen` is an answer (a string, or messages that do not open with a user or
    system turn): UltraFeedback-binarized writes a `prompt` string beside whole conversations, and
    is read as conversations.
    """
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {_kind(record)}")
    if _is_pair(record):
        if "prompt" in record and not is_conversation(record["chosen"]):
            return "paired"
        return "paired_conversations"
    if "completion" in record and "label" in record:
        return "unpaired"
    keys = ", ".join(map(str, list(record)[:8])) or "none"
    sft = "messages" in record or "conversations" in record or "completion" in record
    hint = " (chat data for supervised fine-tuning, not preferences)" if sft else ""
    raise RecordError(
        f"cannot tell the preference format: expected `chosen` + `rejected` (whole conversations, or "
        f"answers beside a `prompt`) or `prompt` + `completion` + `label`, got keys {keys}{hint}"
    )


def is_conversation(value: Any) -> bool:
    """Whether a `chosen` value is a whole conversation: a list of messages whose first is not an
    assistant turn (an answer opens with one)."""
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    return not (isinstance(first, dict) and first.get("role") == "assistant")


def _is_pair(record: dict) -> bool:
    return "chosen" in record and "rejected" in record


def normalize(record: Any, fmt: str) -> list[Message]:
    """The record as a list of `{"role", "content"}` messages, or `RecordError` naming the problem."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {_kind(record)}")
    if fmt == "messages":
        return _messages(_required(record, "messages", fmt), "messages")
    if fmt == "sharegpt":
        return _sharegpt(_required(record, "conversations", fmt))
    if fmt == "prompt_completion":
        return _prompt_completion(record)
    raise ValueError(f"unknown format {fmt!r}")


def _required(record: dict, key: str, fmt: str) -> Any:
    if key not in record:
        raise RecordError(f"missing `{key}` (format {fmt})")
    return record[key]


def _messages(items: Any, key: str, *, first_number: int = 1) -> list[Message]:
    """OpenAI-style `{"role", "content"}` messages."""
    return _turns(items, key, "messages", {r: r for r in ROLES}, "role", "role", "content", first_number)


def _sharegpt(items: Any) -> list[Message]:
    """ShareGPT `{"from", "value"}` turns, speakers mapped to roles."""
    return _turns(items, "conversations", "turns", SHAREGPT_ROLES, "from", "`from`", "value", 1)


def _turns(
    items: Any, key: str, noun: str, roles: dict[str, str], role_key: str, role_name: str, content_key: str,
    first_number: int,
) -> list[Message]:
    """The messages of a list of turn objects; `roles` maps each accepted `role_key` value to a role."""
    if not isinstance(items, list):
        raise RecordError(f"`{key}` must be a list of {noun}, got {_kind(items)}")
    if not items:
        raise RecordError("empty conversation")
    out = []
    for number, item in enumerate(items, first_number):
        if not isinstance(item, dict):
            raise RecordError(f"message {number} is not an object (got {_kind(item)})")
        if role_key not in item:
            raise RecordError(f"message {number} has no `{role_key}`")
        speaker = item[role_key]
        if not isinstance(speaker, str) or speaker not in roles:
            raise RecordError(
                f"message {number} has unknown {role_name} {speaker!r} (expected {', '.join(roles)})"
            )
        role = roles[speaker]
        calls = None
        if role == "assistant" and item.get("tool_calls"):
            calls = _tool_calls(item["tool_calls"], number)
        message = {"role": role, "content": _content(item, content_key, number, optional=calls is not None)}
        if calls is not None:
            message["tool_calls"] = calls
        if role == "tool":
            message.update({k: item[k] for k in ("tool_call_id", "name") if isinstance(item.get(k), str)})
        out.append(message)
    return out


def _tool_calls(calls: Any, number: int) -> list[dict]:
    """An assistant's tool calls as chat templates take them: `{"type": "function", "function": {"name",
    "arguments"}}` with the arguments an object (OpenAI writes them as a JSON string), and `id` when given."""
    if not isinstance(calls, list):
        raise RecordError(f"message {number}: `tool_calls` must be a list of calls, got {_kind(calls)}")
    out = []
    for index, call in enumerate(calls, 1):
        where = f"message {number}, tool call {index}"
        function = call.get("function", call) if isinstance(call, dict) else None  # OpenAI nests it
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RecordError(f"{where}: expected an object with a function `name`, got {_kind(call)}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError, ValueError):
                raise RecordError(f"{where}: `arguments` is a string but no JSON object") from None
        if not isinstance(arguments, dict):
            raise RecordError(f"{where}: `arguments` must be an object, got {_kind(arguments)}")
        normalized = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            normalized["id"] = call["id"]
        out.append(normalized)
    return out


def record_tools(record: Any) -> list[dict] | None:
    """The function definitions a record offers (`tools`: a list of objects, or that list as a JSON
    string, as some datasets store it); None without any."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise RecordError("`tools` is a string but no JSON list") from None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecordError(f"`tools` must be a list of function definitions (objects), got {_kind(tools)}")
    return tools or None


def _prompt_completion(record: dict) -> list[Message]:
    """A prompt and its completion: plain strings (one user and one assistant turn) or message lists."""
    for key in ("prompt", "completion"):
        if key not in record:
            raise RecordError(f"missing `{key}` (format prompt_completion)")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str):
        head = [{"role": "user", "content": prompt}]
        system = record.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise RecordError(f"`system` must be a string, got {_kind(system)}")
            head.insert(0, {"role": "system", "content": system})
    elif isinstance(prompt, list):
        head = _messages(prompt, "prompt")
    else:
        raise RecordError(f"`prompt` must be a string or a list of messages, got {_kind(prompt)}")
    if isinstance(completion, str):
        tail = [{"role": "assistant", "content": completion}]
    elif isinstance(completion, list):
        tail = _messages(completion, "completion", first_number=len(head) + 1)
    else:
        raise RecordError(f"`completion` must be a string or a list of messages, got {_kind(completion)}")
    return head + tail


def _content(item: dict, key: str, number: int, *, optional: bool = False) -> str:
    """The text of a message: a string, or the text parts of a list (`[{"type": "text", "text": ...}]`);
    `optional` (an assistant turn of tool calls) lets it be absent or null."""
    content = item.get(key)
    if content is None and optional:
        return ""
    if key not in item:
        raise RecordError(f"message {number} has no `{key}`")
    if isinstance(content, list):
        content = _text_parts(content, key, number)
    if not isinstance(content, str):
        raise RecordError(f"message {number} has non-string `{key}` (got {_kind(content)})")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON's "\ud800" escapes decode to lone surrogates
        raise RecordError(f"message {number} has invalid text in `{key}`: a lone surrogate "
                          f"{content[err.start]!r} at character {err.start + 1}") from None
    return content


def _text_parts(parts: list, key: str, number: int) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise RecordError(f"message {number} has a `{key}` part of type {kind!r}: only text parts are "
                              "read")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RecordError(f"message {number} has {_kind(part)} in its `{key}` list, where text parts "
                              '{"type": "text", "text": ...} were expected')
        texts.append(part["text"])
    return "".join(texts)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


# --------------------------------------------------------------------------------------------------
# Records -> conversations


@dataclass
class ReadResult:
    """The conversations of one source, with the malformed records that were skipped."""

    conversations: list[Conversation]
    records: int
    bad: list[str]


def read_normalized(path: str, detect: Callable[[Any], str], normalize: Callable[[Any, str], Any], *,
                    fmt: str = "auto", split: str = "train",
                    on_bad_record: str = "error") -> tuple[list[tuple[str, Any]], int, list[str], str]:
    """Read every record of one source (local file or hub dataset, `iter_records`) and normalize it:
    `([(origin, normalize(record, fmt)), ...], records read, bad records' messages, fmt)`.

    `fmt="auto"` takes `detect` of the first record that is an object. With `on_bad_record="error"`
    the first malformed record raises `DataError("path:line: problem")`; with `"skip"` it is counted
    and listed as bad.
    """
    normalized: list[tuple[str, Any]] = []
    bad: list[str] = []
    records = 0
    for origin, record in iter_records(path, split=split):
        records += 1
        try:
            if isinstance(record, BadRecord):
                raise RecordError(record.problem)
            if fmt == "auto":
                fmt = detect(record)
            normalized.append((origin, normalize(record, fmt)))
        except RecordError as err:
            message = f"{origin}: {err}"
            if on_bad_record == "error":
                raise DataError(message) from None
            bad.append(message)
    return normalized, records, bad, fmt


def read_conversations(path: str, *, fmt: str = "auto", split: str = "train",
                       on_bad_record: str = "error") -> ReadResult:
    """Every record of one source as a conversation (`read_normalized`)."""
    def conversation(record: Any, fmt: str) -> tuple[list[Message], list[dict] | None]:
        return normalize(record, fmt), record_tools(record)

    normalized, records, bad, _ = read_normalized(path, detect_format, conversation, fmt=fmt, split=split,
                                                  on_bad_record=on_bad_record)
    return ReadResult([Conversation(messages, origin, tools) for origin, (messages, tools) in normalized],
                      records, bad)
