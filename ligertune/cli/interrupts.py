"""Ctrl-C and SIGTERM honoured from a command's first moment: exit 130 or 143, one line, no traceback.

Left alone, Python turns SIGINT into `KeyboardInterrupt` only when the process did not inherit it
ignored, and a shell starts the background jobs of a script with SIGINT ignored: `ligertune train
r.yaml &` then sat through `kill -INT` until the training loop put in its own handler, and trained
on. SIGTERM ended the process at once, its `finally` blocks unrun. And typer turns a
`KeyboardInterrupt` raised while it parses the command line (where it imports pydantic: up to a
second) into a silent exit 130.

So `main()` calls `stop_on_signals()` before it imports any command: SIGINT and SIGTERM then raise
`Interrupted` wherever the command is, and `main()` or `guarded` prints one line and exits
128 + the signal. The training loop puts its own handlers (finish the step, save) over these, and
these back after.

Python runs a signal's handler at the next line of Python code of the main thread, and that may be
code whose exceptions it can only print ("Exception ignored in ..."): a finalizer, or a callback
it runs after each fork (logging's, as the data workers start). Such a signal would be lost, the
command going on as if it had never come: it is sent again instead, a moment later. torch's own
start-up is worse: it drops such an exception in C++ (as it imports numpy) or aborts on it (as it
initializes torch.distributed), so commands import it with both signals held back (`import_torch`).

Imports nothing heavy: it runs before the commands load.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A `BaseException`, which `except Exception` lets through as it does
    a `KeyboardInterrupt`; not a `KeyboardInterrupt`, which typer would swallow (see the module)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


INTERRUPTS = (Interrupted, KeyboardInterrupt)
"""What a signal raises: `Interrupted`, or Python's own `KeyboardInterrupt` (the training loop's
second Ctrl-C, or a process in which `stop_on_signals` did not run)."""


RESEND_DELAY_S = 0.01
"""How long after a signal lost in a finalizer it is sent again: long enough for the finalizer (or
the fork) under way to end."""


def stop_on_signals() -> None:
    """Make SIGINT and SIGTERM raise `Interrupted` in the main thread, whatever this process
    inherited, and send again a signal whose exception Python could only print."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_interrupted)
    sys.unraisablehook = _send_again


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


def _send_again(unraisable) -> None:
    """`sys.unraisablehook`: an interrupt raised where Python can only print it is sent again from a
    thread (sent from this one, its handler would run inside this hook, and be lost again)."""
    err = unraisable.exc_value
    if not isinstance(err, INTERRUPTS):
        sys.__unraisablehook__(unraisable)
        return
    resend = threading.Timer(RESEND_DELAY_S, os.kill, (os.getpid(), exit_code(err) - 128))
    resend.daemon = True
    resend.start()


def import_torch() -> None:
    """Import torch (a second or two) with SIGINT and SIGTERM held back; one that came meanwhile is
    raised as the import ends. Raised during it, torch's C++ start-up would drop it (the command went
    on as if it had never come) or abort ("terminate called after throwing an instance of
    'pybind11::error_already_set'")."""
    if "torch" in sys.modules:
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def exit_code(err: BaseException) -> int:
    """The shell's code for a process stopped by a signal, 128 + its number: 130 for SIGINT (and a
    `KeyboardInterrupt`), 143 for SIGTERM."""
    return 128 + getattr(err, "signum", signal.SIGINT)


def is_ctrl_c(err: BaseException) -> bool:
    """SIGINT (Ctrl-C), which an interactive loop may take as "drop this", rather than SIGTERM."""
    return exit_code(err) == 128 + signal.SIGINT


def report_interrupted(err: BaseException, detail: str = "") -> int:
    """Say on stderr, in one line, which signal stopped the command (rank 0 only, with several
    processes); return its exit code."""
    code = exit_code(err)
    if os.environ.get("RANK", "0") == "0":
        name = signal.Signals(code - 128).name
        print(f"interrupted ({name}){'; ' + detail if detail else ''}", file=sys.stderr, flush=True)
    return code
