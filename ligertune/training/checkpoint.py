"""A run's files, written so that none is ever left half-written.

    OUTPUT/
      recipe.yaml                 the resolved recipe
      metrics.jsonl               one JSON object per record, strict JSON (no NaN literals)
      checkpoints/
        step-000200/              model (or LoRA adapters) + tokenizer, Hugging Face format,
          optimizer/              the optimizer state (torch.distributed.checkpoint, any world size)
          trainer_state.pt        and the rest of the run: schedule, RNG, data position
        step-000400/
        latest -> step-000400     a symbolic link, moved only once its target is complete
      final/                      the model at the end of the run
      .lock                       the PID of the process writing here

A directory is written into a temporary sibling (`.step-000400.tmp-*`), every file fsynced, then
renamed into place; `latest` is then replaced by a new link in one rename. A crash or a failed write
at any point leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ligertune.distributed import barrier, broadcast_from_main, is_main_process, together
from ligertune.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
OPTIMIZER = "optimizer"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


# --------------------------------------------------------------------------------------------------
# atomic writes


def write_atomic_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling directory with `write(tmp)`, fsync it, then rename it onto `target`.

    A crash leaves either the previous `target` or the new one, never a mix; the temporary
    directory of a failed (or interrupted) write is removed. With several processes, every rank
    calls this together: each runs `write` into the same temporary directory, and rank 0 renames it
    once every rank has succeeded.
    """
    main = is_main_process()
    tmp = None
    if main:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp = Path(broadcast_from_main(str(tmp)))
    try:
        together(lambda: write(tmp))
        if main:
            _settle_tree(tmp)
            if target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
            _fsync_dir(target.parent)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def write_atomic_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _settle_tree(root: Path) -> None:
    """Give every folder and file the mode the umask sets (mkdtemp and some writers, safetensors
    among them, create theirs private), and fsync each, so the rename publishes complete files."""
    mask = _umask()
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            os.chmod(path, 0o666 & ~mask)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# checkpoints


def save_pretrained(folder: Path, model: Any, tokenizer: Any, *, state_dict: dict | None = None) -> None:
    """The model (or its peft adapters) and the tokenizer in Hugging Face format, written by rank 0;
    `state_dict` is the whole model's, gathered on rank 0 from a sharded model."""
    if is_main_process():
        model.save_pretrained(folder, **({"state_dict": state_dict} if state_dict is not None else {}))
        tokenizer.save_pretrained(folder)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_steps(folder: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under `folder` (`step-*` directories), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], *, keep: int) -> Path:
    """Write checkpoint `step` with `write(folder)` (on every rank), point `latest` at it, then remove
    the oldest checkpoints beyond `keep`."""
    folder = run_dir / CHECKPOINTS
    target = write_atomic_dir(folder / checkpoint_name(step), write)
    if is_main_process():
        point_latest(folder, target.name)
        for _, old in checkpoint_steps(folder)[:-keep]:
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return target


def point_latest(folder: Path, name: str) -> None:
    """Make `folder/latest` a link to `name`, replacing the old link in one rename."""
    tmp = folder / f".{LATEST}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    try:
        os.replace(tmp, folder / LATEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` points at, if it is complete."""
    link = run_dir / CHECKPOINTS / LATEST
    if not link.is_symlink():
        return None
    target = link.resolve()
    return target if (target / TRAINER_STATE).is_file() else None


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / TRAINER_STATE, map_location="cpu", weights_only=True)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Temporary directories and links left by a process that was killed mid-write."""
    for folder in (run_dir, run_dir / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".") and (".tmp-" in path.name or ".old-" in path.name):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------
# metrics


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
