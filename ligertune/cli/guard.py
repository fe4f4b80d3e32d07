"""One place that turns known errors into one line: exit 2 for user errors, 1 for the environment,
130 or 143 for Ctrl-C or SIGTERM."""

from __future__ import annotations

import functools
import os
import traceback
from typing import Callable

import typer
from rich.console import Console
from rich.text import Text

from ligertune.cli.interrupts import INTERRUPTS, import_torch, report_interrupted
from ligertune.errors import EnvironmentFault, UserError, first_line


def debug_enabled() -> bool:
    """LIGERTUNE_DEBUG=1 in the environment (`--debug` sets it for the process it starts)."""
    return os.environ.get("LIGERTUNE_DEBUG", "").strip().lower() not in ("", "0", "false")


def guarded(fn: Callable, *, uses_torch: bool = False) -> Callable:
    """Report a `UserError` as red `error:` lines on stderr with exit code 2, an `EnvironmentFault`
    or an exhausted memory with exit code 1, Ctrl-C or SIGTERM as `interrupted (SIGINT)` with exit
    code 130 or 143 (the traceback with --debug). A command that `uses_torch` imports it first, in a
    way that no signal is lost (`ligertune.cli.interrupts.import_torch`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            if uses_torch:
                import_torch()
            return fn(*args, **kwargs)
        except (UserError, EnvironmentFault) as err:
            if debug_enabled():
                raise
            print_error(err)
            raise typer.Exit(2 if isinstance(err, UserError) else 1) from None
        except Exception as err:
            if debug_enabled() or not out_of_memory(err):
                raise
            print_error(f"out of memory: {first_line(err)}")
            raise typer.Exit(1) from None
        except INTERRUPTS as err:
            if debug_enabled():
                traceback.print_exc()  # where the signal landed
            raise typer.Exit(report_interrupted(err)) from None

    return wrapper


def print_error(err: BaseException | str, *, every_rank: bool = False) -> None:
    """Each line of the message after a red `error:`, printed literally (never read as rich markup:
    messages echo paths, keys and data that may hold brackets). With several processes, rank 0's
    only, unless `every_rank` (the caller chose the process that speaks)."""
    # Imported here, not at the top: `distributed` imports torch, and every command imports this module.
    from ligertune.distributed import is_main_process

    if not (every_rank or is_main_process()):  # with several processes every rank fails alike; rank 0 says why
        return
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in str(err).splitlines() or [type(err).__name__]:
        console.print(Text.assemble(("error:", "bold red"), " ", line))


def out_of_memory(err: BaseException) -> bool:
    """A failed allocation: `MemoryError`, torch's `OutOfMemoryError`, or the CPU allocator's refusal."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)
