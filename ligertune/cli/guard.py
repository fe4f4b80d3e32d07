"""One place that turns user errors into one line and exit code 2."""

from __future__ import annotations

import functools
import os
from typing import Callable

import typer
from rich.console import Console

from ligertune.errors import EnvironmentFault, UserError


def debug_enabled() -> bool:
    """LIGERTUNE_DEBUG=1 in the environment (`--debug` sets it for the process it starts)."""
    return os.environ.get("LIGERTUNE_DEBUG", "").strip().lower() not in ("", "0", "false")


def guarded(fn: Callable) -> Callable:
    """Turn a `UserError` into red `error:` lines on stderr and exit code 2, an `EnvironmentFault`
    into the same with exit code 1 (the traceback with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, EnvironmentFault) as err:
            if debug_enabled():
                raise
            console = Console(stderr=True, highlight=False, soft_wrap=True)
            for line in str(err).splitlines() or [type(err).__name__]:
                console.print(f"[bold red]error:[/] {line}", markup=True)
            raise typer.Exit(2 if isinstance(err, UserError) else 1) from None

    return wrapper
