"""Writing a run's files so that none is ever left half-written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def write_atomic_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling directory with `write(tmp)`, then rename it onto `target`.

    A crash leaves either the previous `target` or the new one, never a mix; the temporary
    directory of a failed write is removed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def write_atomic_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_model(target: Path, model: Any, tokenizer: Any) -> Path:
    """`save_pretrained` of the model (or of its peft adapters) and the tokenizer, atomically."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_atomic_dir(target, write)


class MetricsLog:
    """`metrics.jsonl`: one JSON object per line, flushed as written so a crash keeps what was logged."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
