"""Files written so that none is ever left half-written: a directory filled in a temporary sibling
and renamed into place, a text file likewise, everything fsynced before the rename.

A crash or a failed write at any point leaves the previous file or directory as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ligertune.distributed import broadcast_from_main, is_main_process, together


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
            fsync_dir(target.parent)
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
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
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
