"""Ctrl-C and SIGTERM from a command's first moment, through the console script in a subprocess:
exit 130 (143), one line, no traceback, and for `train` no step trained.

Each signal is sent at a moment the test sees, never after a sleep: once the process has put in
its handlers (its SIGTERM is caught: `/proc/PID/status`), once data preparation runs its worker
processes, once `train` printed its first line. Each case runs with SIGINT as a terminal leaves it
and ignored, as a shell leaves it for the background jobs of a script (`ligertune train r.yaml &`).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_recipe import ROOT

QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
WAIT = 60.0  # seconds: the longest any moment, or the exit after the signal, may take
# Tokenize the whole quick-start data (no cache) in 2 worker processes: the moment data
# preparation runs lasts seconds.
DATA = ["--set", "data.cache_dir=null", "--set", "data.num_workers=2"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")


def start(args: list, out: Path, *, sigint_ignored: bool) -> subprocess.Popen:
    """`ligertune ARGS` in a session of its own (a signal to its group reaches its workers too)."""
    env = {k: v for k, v in os.environ.items() if k != "LIGERTUNE_DEBUG"}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return subprocess.Popen([sys.executable, "-m", "ligertune", *map(str, args), "--set", f"output.dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=ignore, start_new_session=True)


def wait_until(proc: subprocess.Popen, ready, what: str):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ended before {what}: {proc.communicate()}"
        found = ready()
        if found:
            return found
        time.sleep(0.005)
    proc.kill()
    pytest.fail(f"not {what} within {WAIT:.0f} s")


def handlers_in(proc: subprocess.Popen) -> bool:
    """The process catches SIGTERM: `main()` has put in its handlers (Python alone leaves it default)."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def first_line(proc: subprocess.Popen) -> str:
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    assert selector.select(timeout=WAIT), f"no line within {WAIT:.0f} s"
    return proc.stdout.readline()


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {WAIT:.0f} s after the signal: {proc.communicate()}")
    return proc.returncode, err


def assert_stopped(code: int, err: str, signum: int) -> None:
    assert code == 128 + signum, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"interrupted ({signal.Signals(signum).name})"), err


def assert_nothing_trained(out: Path) -> None:
    metrics = out / "metrics.jsonl"
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    assert not metrics.exists() or '"step"' not in metrics.read_text()


IGNORED = pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored"])


@IGNORED
@pytest.mark.parametrize("command", [["data"], ["train"]], ids=["data", "train"])
def test_a_signal_as_soon_as_the_command_starts(tmp_path, command, sigint_ignored):
    proc = start([*command, QUICKSTART], tmp_path / "run", sigint_ignored=sigint_ignored)
    wait_until(proc, lambda: handlers_in(proc), "handling signals")
    proc.send_signal(signal.SIGINT)  # while the commands load: typer, then torch
    assert_stopped(*finish(proc), signal.SIGINT)
    assert_nothing_trained(tmp_path / "run")


@pytest.mark.parametrize("command, sigint_ignored", [
    (["data"], True), (["data", "--order"], False), (["train"], True),
], ids=["data-sigint-ignored", "data-order-sigint-default", "train-sigint-ignored"])
def test_ctrl_c_while_the_data_is_prepared(tmp_path, command, sigint_ignored):
    """As a terminal sends it: to the command and its tokenizing workers, which stop without a word."""
    proc = start([*command, QUICKSTART, *DATA], tmp_path / "run", sigint_ignored=sigint_ignored)
    workers = wait_until(proc, lambda: children(proc.pid), "tokenizing in worker processes")
    os.killpg(proc.pid, signal.SIGINT)
    assert_stopped(*finish(proc), signal.SIGINT)
    assert_nothing_trained(tmp_path / "run")
    assert not [pid for pid in workers if alive(pid)]


def test_sigterm_while_the_data_is_prepared(tmp_path):
    proc = start(["train", QUICKSTART, *DATA], tmp_path / "run", sigint_ignored=False)
    workers = wait_until(proc, lambda: children(proc.pid), "tokenizing in worker processes")
    proc.send_signal(signal.SIGTERM)  # a job scheduler's: to the command alone
    assert_stopped(*finish(proc), signal.SIGTERM)
    assert_nothing_trained(tmp_path / "run")
    assert not [pid for pid in workers if alive(pid)]


def test_ctrl_c_once_train_printed_its_first_line(tmp_path):
    """The first line comes as the model is built, just before the loop: the signal stops the run
    there, or the loop takes it at the end of its first step and saves it (docs/checkpoints.md).
    With SIGINT ignored as the process started, as in the report of a run that trained on."""
    out = tmp_path / "run"
    proc = start(["train", QUICKSTART], out, sigint_ignored=True)
    assert first_line(proc).strip()
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 130 and "Traceback" not in err, err
    if (out / "checkpoints").exists():  # stopped by the loop: after one step, saved
        assert "SIGINT: stopped after step 1" in err and "resume with: ligertune train" in err, err
    else:
        assert err.strip().startswith("interrupted (SIGINT)"), err
        assert_nothing_trained(out)


LOST_IN_A_FINALIZER = """
import os, signal, sys, time
from ligertune.cli.interrupts import INTERRUPTS, report_interrupted, stop_on_signals

class Finalized:
    def __del__(self):  # the handler runs here, where Python can only print what it raises
        os.kill(os.getpid(), signal.SIGTERM)

stop_on_signals()
try:
    del_me = Finalized()
    del del_me
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("the signal was lost")
except INTERRUPTS as err:
    sys.exit(report_interrupted(err))
"""


def test_a_signal_raised_in_a_finalizer_is_sent_again():
    """What forking the data workers did to a signal that came meanwhile (logging's after-fork
    callback): the command went on and trained."""
    done = subprocess.run([sys.executable, "-c", LOST_IN_A_FINALIZER], capture_output=True, text=True,
                          timeout=WAIT)
    assert done.stdout == ""
    assert_stopped(done.returncode, done.stderr, signal.SIGTERM)
