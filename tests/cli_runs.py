"""`ligertune` run as a user runs it, and the checks on what its runs wrote: the helpers of the tests
that train with several processes through the CLI (2 gloo processes on the CPU; NCCL on GPUs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import pytest


def ligertune(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`ligertune ARGS` in a process of its own: one thread a process (2 processes on 2 cores, each its
    own) and NVLink multicast off (the GPU machines these tests run on run NCCL without it); `env`
    added to the environment."""
    return subprocess.run([sys.executable, "-m", "ligertune", *args], env=_environment(env), capture_output=True,
                          text=True, timeout=timeout)


def start_ligertune(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`ligertune ARGS` started as `ligertune` does, not waited for (`.communicate(timeout=...)` does)."""
    return subprocess.Popen([sys.executable, "-m", "ligertune", *args], env=_environment(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def torchrun(script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`script ARGS` under `torchrun` with two processes on this machine, `tests` and `tests/training`
    importable. Each process's lines come back marked with its rank (`[default1]:...`), so a failed
    launch says which process said what; a process that dies of a signal (a native abort) first
    writes where each of its threads was (`PYTHONFAULTHANDLER`)."""
    tests = Path(__file__).resolve().parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--tee", "3", str(script), *args]
    env = _environment({"PYTHONPATH": f"{tests / 'training'}:{tests}", "PYTHONFAULTHANDLER": "1"})
    return subprocess.run(command, env=env,
                          capture_output=True, text=True, timeout=timeout)


def leave_launched_process() -> NoReturn:
    """End a process that `torchrun` started, its results written and its process group destroyed,
    without Python's shutdown: gloo's threads, still letting go of tensors there, at times abort a
    process whose work is done (SIGABRT, "terminate called without an active exception": seen twice
    in some three hundred launches, in full suites under load). What the tests check is written
    before."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def failed_launch(result: subprocess.CompletedProcess) -> str:
    """What a failed launch left on stderr: each rank's last lines and the launcher's summary."""
    lines = result.stderr.splitlines()
    ranks = sorted({line.split("]:", 1)[0] + "]" for line in lines if line.startswith("[default")})
    tails = ["\n".join([line for line in lines if line.startswith(rank)][-40:]) for rank in ranks]
    return "\n".join([*tails, *[line for line in lines if not line.startswith("[default")][-40:]])


def _environment(extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", **(extra or {})}


def free_port() -> int:
    """A TCP port free on this machine a moment ago (for a rendezvous on localhost)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_records(run_dir: Path) -> list[dict]:
    """The training steps' records of a run's metrics.jsonl (not evaluations or checkpoints)."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [record for record in map(json.loads, filter(str.strip, lines)) if "loss" in record]


def assert_resume_continues_the_run(recipe: Path, run_dir: Path, *, processes: int, steps: int, save_at: int,
                                    loss_rtol: float, grad_norm_rtol: float, overrides: tuple[str, ...] = (),
                                    timeout: float = 240, resume_processes: int | None = None) -> Path:
    """Train `recipe` with `processes` processes for `steps` steps straight into `run_dir`, with a
    checkpoint after step `save_at`; then train again from that checkpoint (`--resume`, with
    `resume_processes` processes, by default as many) to step `steps`.

    The resumed run must say where it resumed, its metrics.jsonl must read as one run (steps
    1..`steps`, the straight run's records after `save_at` dropped), and each of its steps after
    `save_at` must have the straight run's supervised tokens (the data position) and learning rate
    (the schedule) exactly, and its loss and gradient norm within the relative tolerances (0: to the
    bit). Returns the folder the straight run's final model was moved to.
    """
    args = ["train", str(recipe), "-o", str(run_dir), "--max-steps", str(steps),
            "--set", f"train.save_every={save_at}", *(arg for item in overrides for arg in ("--set", item))]
    result = ligertune(*args, "--nproc", str(processes), timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    straight = train_records(run_dir)
    assert [r["step"] for r in straight] == list(range(1, steps + 1))
    straight_final = run_dir.with_name(f"{run_dir.name}-straight-final")
    shutil.move(run_dir / "final", straight_final)

    checkpoint = run_dir / "checkpoints" / f"step-{save_at:06d}"
    result = ligertune(*args, "--nproc", str(resume_processes or processes), "--resume", str(checkpoint),
                       timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = re.search(r"resumed from .*? at step (\d+) ", " ".join(result.stdout.split()))  # however it wrapped
    assert said and int(said.group(1)) == save_at, result.stdout[-3000:]
    resumed = train_records(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    for before, after in zip(straight[save_at:], resumed[save_at:]):
        assert after["tokens"] == before["tokens"] and after["lr"] == before["lr"], after["step"]
        assert after["loss"] == pytest.approx(before["loss"], rel=loss_rtol, abs=0), after["step"]
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=grad_norm_rtol, abs=0), after["step"]
    return straight_final


def process_of_rank(launcher: subprocess.Popen, rank: int) -> int:
    """The PID of the process of `rank` (its `RANK` variable) that `launcher` started, found among its
    descendants in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [launcher.pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in variables and b"ligertune" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    assert len(found) == 1, f"processes of rank {rank} under {launcher.pid}: {found}"
    return found[0]


def ligertune_here(*args: str | Path):
    """`ligertune ARGS` in this process (one process; no interpreter to start), which must exit 0: its
    result (`.output`, `.stdout`)."""
    from typer.testing import CliRunner

    from ligertune.cli.main import app

    result = CliRunner().invoke(app, [*map(str, args)])
    assert result.exit_code == 0, result.output[-3000:] + repr(result.exception)
    return result


def train_here(*args: str | Path) -> str:
    """`ligertune train ARGS` in this process: what it printed."""
    return ligertune_here("train", *args).output


def two_processes_then_one(recipe: Path, folder: Path, *, save_at: int) -> tuple[Path, Path, Path]:
    """Train `recipe` (its `train.grad_accum_steps` 1) with 2 processes into `folder/two`, with a
    checkpoint after step `save_at`; continue a copy of that run (`folder/resumed`) from the
    checkpoint with 1 process and twice the accumulation; and train straight with 1 process and twice
    the accumulation into `folder/one`. The three run folders, whose steps should match: `two`'s
    final model is the one its 2 processes gathered from their shards."""
    two, resumed, one = folder / "two", folder / "resumed", folder / "one"
    result = ligertune("train", str(recipe), "--nproc", "2", "-o", str(two),
                       "--set", f"train.save_every={save_at}")
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(two, resumed, ignore=shutil.ignore_patterns("final"))
    once = ("--set", "train.grad_accum_steps=2")
    checkpoint = resumed / "checkpoints" / f"step-{save_at:06d}"
    said = train_here(recipe, "-o", resumed, "--resume", checkpoint, *once)
    at = re.search(r"resumed from .*? at step (\d+) ", " ".join(said.split()))  # however it wrapped
    assert at and int(at.group(1)) == save_at and (resumed / "final").is_dir(), said[-3000:]
    train_here(recipe, "-o", one, *once)
    return two, resumed, one
