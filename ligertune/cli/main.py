"""The `ligertune` console script: Ctrl-C and SIGTERM are taken in hand first, then the commands load.

Loading the commands takes a while (typer, rich, the recipe schema; then torch inside a command):
the signal handlers go in before, so that a Ctrl-C in the first second stops the command with
exit 130 and one line, like one in the middle (`ligertune.cli.interrupts`).
"""

from __future__ import annotations

import sys

from ligertune.cli.interrupts import INTERRUPTS, report_interrupted, stop_on_signals
from ligertune.quiet import quiet_optional_libraries


def main() -> None:
    """Console-script entry point."""
    stop_on_signals()
    try:  # from the moment the handlers are in: a signal anywhere after gets its one line
        quiet_optional_libraries()
        from ligertune.cli.app import app

        sys.exit(app())
    except INTERRUPTS as err:  # while the commands load or typer parses; inside one, `guarded` reports it
        sys.exit(report_interrupted(err))


def __getattr__(name: str):
    """`app`, loaded on first use: importing this module must stay instant (see the docstring)."""
    if name == "app":
        from ligertune.cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
