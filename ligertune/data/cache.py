"""A cache of tokenized sources, so that a second run with the same data starts at once.

One file per source, named by a SHA-256 over everything that changes the tokenized result: the
source (path, size and mtime of the file; format; split), the tokenizer (its serialized vocabulary,
merges and normalizers, its chat template and special tokens), the settings that shape the
examples (`train_on`, `max_seq_len`, `truncation`, `on_bad_record`) and this file's format version.
Seed, weights, samples and the eval split are applied after the cache, so changing them reuses it.

File layout (no pickle: loading a cache never runs code):

    b"LTDCACHE" | header length (8 bytes, little endian) | header JSON | lengths | input_ids | labels

the last three as native int32 arrays (the header records the byte order). Files are written to a
temporary name and renamed into place, so a run that dies mid-write leaves no half file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

from ligertune.data.chat import TokenizedExample

CACHE_VERSION = 1
MAGIC = b"LTDCACHE"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of what decides a tokenizer's output: the serialized backend, chat template, specials."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer).encode())
    template = tokenizer.chat_template
    h.update(json.dumps(template, sort_keys=True).encode())
    specials = {name: str(getattr(tokenizer, name, None)) for name in ("bos_token", "eos_token", "unk_token",
                                                                      "pad_token")}
    h.update(json.dumps(specials, sort_keys=True).encode())
    return h.hexdigest()


def cache_key(**parts: Any) -> str:
    """SHA-256 of the parts (JSON, sorted keys) and the cache format version."""
    blob = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir).expanduser() / "tokenized" / f"{key[:40]}.bin"


def save(path: Path, examples: list[TokenizedExample], meta: dict) -> None:
    """Write examples and `meta` (JSON-able) atomically: temporary file in the same folder, then rename."""
    lengths = array("i", (len(e.input_ids) for e in examples))
    input_ids, labels = array("i"), array("i")
    for e in examples:
        input_ids.extend(e.input_ids)
        labels.extend(e.labels)
    header = json.dumps({
        "version": CACHE_VERSION,
        "byteorder": sys.byteorder,
        "itemsize": lengths.itemsize,
        "origins": [e.origin for e in examples],
        "meta": meta,
    }).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for part in (lengths, input_ids, labels):
                part.tofile(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> tuple[list[TokenizedExample], dict] | None:
    """The examples and meta stored at `path`, or None when absent, stale or unreadable."""
    try:
        with path.open("rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            if (header.get("version"), header.get("byteorder")) != (CACHE_VERSION, sys.byteorder):
                return None
            lengths = array("i")
            if lengths.itemsize != header.get("itemsize"):
                return None
            origins = header["origins"]
            lengths.fromfile(f, len(origins))
            total = sum(lengths)
            input_ids, labels = array("i"), array("i")
            input_ids.fromfile(f, total)
            labels.fromfile(f, total)
    except (OSError, EOFError, ValueError, KeyError):  # absent, truncated or corrupt: rebuild it
        return None
    ids_list, labels_list = input_ids.tolist(), labels.tolist()
    examples = []
    start = 0
    for n, origin in zip(lengths, origins):
        examples.append(TokenizedExample(ids_list[start : start + n], labels_list[start : start + n], origin))
        start += n
    return examples, header["meta"]
