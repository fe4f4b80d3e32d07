"""The metrics file of a run, `metrics.jsonl`: one strict JSON object per record, flushed as written.

Written by the training loop (rank 0), read by `ligertune plot` and by anything that studies a run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ligertune.errors import UserError
from ligertune.files import write_atomic_text


def strict_json(record: dict) -> dict:
    """The record with non-finite numbers as null: JSON has no NaN or Infinity."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl. A cut last line (a run killed mid-write) is skipped; any
    other line that is not a JSON object with a numeric `step` is an error naming the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read: {err}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                break
            raise UserError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            raise UserError(f"{path}:{number}: a record needs a numeric `step`")
        records.append(record)
    return records


class MetricsLog:
    """`metrics.jsonl`: one JSON object per line, flushed as written so a crash keeps what was logged.

    `resume_after=k` continues a run from its checkpoint at step k: the records the interrupted run
    wrote after step k are dropped, so the file reads as one run.
    """

    def __init__(self, path: Path | None, *, resume_after: int | None = None):
        self._file = None
        if path is None:  # a rank other than 0: nothing is written
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after is not None:
            records = read_metrics(path) if path.exists() else []
            kept = [r for r in records if r["step"] <= resume_after]
            write_atomic_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = path.open("a" if resume_after is not None else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
