"""The output directory of a run: one run per directory, and nothing overwritten by surprise.

Before anything is built, `check_output_dir` refuses a directory that cannot be written, one that
another live process is writing (its `.lock`), the current folder and a folder that holds files but
no run (the run's files would land among the user's), and a new run into a folder that holds a
finished or an unfinished run (unless `--resume` continues it or `output.overwrite` replaces it).
Once the run is built, `claim_output_dir` creates the directory, moves a replaced run aside to
`DIR.previous`, and takes the lock, released by `RunLock.release` at the end.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from ligertune.errors import UserError

CHECKPOINTS = "checkpoints"
LOCK = ".lock"
RUN_FILES = ("metrics.jsonl", CHECKPOINTS, "final")


def check_output_dir(path: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse, with the reason and the way out, an output directory this run must not write."""
    if path.exists() and not path.is_dir():
        raise UserError(f"output.dir: {path} is a file, not a directory")
    _check_writable(path)
    owner = lock_owner(path)
    if owner is not None:
        raise UserError(f"output.dir: {path} is being written by another run (process {owner}); "
                        "wait for it or choose another directory with --output-dir")
    if _is_current_folder(path):
        raise UserError(f"output.dir: {path} is the current folder: the run's files (recipe.yaml, "
                        "metrics.jsonl, checkpoints/, final/) would land among yours; name a folder for "
                        "the run, e.g. runs/NAME")
    others = _not_a_run(path)
    if others:
        raise UserError(f"output.dir: {path} holds files that are not a ligertune run ({others}): the run's "
                        "files would land among them; choose a new or empty folder")
    if resume or overwrite or not path.is_dir():
        return
    if (path / "final").exists():
        raise UserError(
            f"output.dir: {path} already holds a finished run (final/); choose another with "
            "--output-dir or allow it with --set output.overwrite=true"
        )
    if any((path / name).exists() for name in RUN_FILES):
        raise UserError(
            f"output.dir: {path} holds an unfinished run; continue it with --resume, or replace it "
            "with --set output.overwrite=true"
        )


def _is_current_folder(path: Path) -> bool:
    try:
        return path.resolve() == Path.cwd().resolve()
    except OSError:  # the current folder was removed
        return False


def _not_a_run(path: Path, shown: int = 3) -> str:
    """The first names in `path` when it holds entries but none of a run's (`RUN_FILES`, the lock),
    e.g. `data/, notes.txt, recipe.yaml, ...`; empty when it is a run, empty or missing."""
    try:
        entries = sorted(path.iterdir()) if path.is_dir() else []
    except OSError:  # not readable: nothing to tell of it (writing is checked by `_check_writable`)
        return ""
    if not entries or any(entry.name in (*RUN_FILES, LOCK) for entry in entries):
        return ""
    names = [_short(entry.name) + ("/" if entry.is_dir() else "") for entry in entries[:shown]]
    return ", ".join(names + ["..."] * (len(entries) > shown))


def _short(name: str, width: int = 40) -> str:
    return name if len(name) <= width else f"{name[: width - 3]}..."


def _check_writable(path: Path) -> None:
    """Find out now, not after the model is built, whether `path` can be created and written: a
    missing folder is created and removed again (permissions alone do not tell: /proc, a
    read-only mount, a file in the way), an existing one must grant write access."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        if existing == path:
            if not os.access(path, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "permission denied")
            return
        path.mkdir(parents=True)
    except OSError as err:
        raise UserError(f"output.dir: {path} cannot be created or written: {err.strerror or err}") from None
    for created in (path, *path.parents):  # leave no empty folder behind if the run fails later
        if created == existing:
            break
        created.rmdir()


@dataclass
class RunLock:
    path: Path

    def release(self) -> None:
        try:
            if self.path.read_text().split()[0] == str(os.getpid()):
                self.path.unlink()
        except (OSError, IndexError):
            pass


def claim_output_dir(path: Path, *, replace: bool, notice=print) -> RunLock:
    """Create `path` (moving a run it held aside when `replace`) and lock it for this process."""
    if replace and path.is_dir() and any((path / name).exists() for name in RUN_FILES):
        previous = path.with_name(path.name + ".previous")
        if previous.exists():
            shutil.rmtree(previous)
        os.replace(path, previous)
        notice(f"output.overwrite: the previous run in {path} was moved to {previous}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        return _take_lock(path / LOCK, notice)
    except OSError as err:
        raise UserError(f"output.dir: cannot write {path}: {err.strerror or err}") from None


def lock_owner(path: Path) -> int | None:
    """The PID of a live process on this host holding `path/.lock`, else None."""
    try:
        pid_text, host = (path / LOCK).read_text().split()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if host != socket.gethostname() or pid == os.getpid():
        return None
    return pid if _alive(pid) else None


def _take_lock(lock: Path, notice) -> RunLock:
    text = f"{os.getpid()} {socket.gethostname()}\n"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        owner = lock_owner(lock.parent)
        if owner is not None:
            raise UserError(f"output.dir: {lock.parent} is being written by another run (process {owner})") from None
        notice(f"output.dir: taking over the lock left by a process that is gone ({lock})")
        lock.write_text(text)
        return RunLock(lock)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return RunLock(lock)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM  # alive, owned by another user
    return True
