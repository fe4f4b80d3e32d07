"""Errors that are the user's to fix, and faults of the machine.

The CLI prints each exception here as one line: a `UserError` exits with code 2, an
`EnvironmentFault` with code 1. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (recipe, data, arguments): reported in one line, exit 2."""


class RecipeError(UserError):
    """One or more problems in a recipe, each naming its YAML key path."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__("\n".join(f"{where}{p}" for p in self.problems))


class DataError(UserError):
    """Malformed or unreadable training data; the message names the file and line."""


class EnvironmentFault(Exception):
    """A fault of the machine, not of the input (a full disk, a folder that cannot be written, a hub
    that cannot be reached): reported in one line naming the path and the cause, exit 1."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty): what a
    one-line report quotes of an error raised by a library."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
