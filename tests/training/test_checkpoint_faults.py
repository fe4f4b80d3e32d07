"""Faults on a run's saved files: a damaged checkpoint is found before it is used, a full disk is one
line, and a second signal during a save leaves `latest` complete; through the CLI where the process's
limits or signals are involved."""

from __future__ import annotations

import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from tiny_recipe import write_recipe

from ligertune.errors import UserError
from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop
from ligertune.training.checkpoint import find_checkpoint, latest_checkpoint, load_trainer_state

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LIGERTUNE_DEBUG": ""}


def ligertune(*args: str, timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ligertune", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def train(path: Path, *overrides: str) -> None:
    run = setup(load_recipe(path, list(overrides)), Console(quiet=True))
    try:
        train_loop(run)
    finally:
        cleanup(run)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 4 (copied by each test that damages one)."""
    folder = tmp_path_factory.mktemp("saved")
    path = write_recipe(folder, train={"max_steps": 6, "save_every": 2, "eval_every": None, "keep_checkpoints": 3},
                        optim={"schedule": "constant"})
    train(path)
    return folder


def copy_run(saved: Path, to: Path) -> Path:
    """A copy of the saved run's folder at `to/run` (`latest` a relative link, as written); the
    saved recipe, whose `output.dir` the commands below override with `-o`."""
    subprocess.run(["cp", "-a", str(saved / "run"), str(to / "run")], check=True)
    return saved / "recipe.yaml"


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


class Evil:
    def __reduce__(self):
        return (os.system, ("true",))


DAMAGES = {
    "weights-truncated": lambda c: truncate(c / "model.safetensors"),
    "weights-empty": lambda c: (c / "model.safetensors").write_bytes(b""),
    "state-truncated": lambda c: truncate(c / "trainer_state.pt"),
    "state-garbage": lambda c: (c / "trainer_state.pt").write_bytes(os.urandom(4096)),
    "state-refused-pickle": lambda c: (c / "trainer_state.pt").write_bytes(pickle.dumps(Evil())),
    "optimizer-empty": lambda c: (c / "optimizer" / ".metadata").write_bytes(b""),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_latest_gives_way_to_the_newest_complete_checkpoint(saved_run: Path, tmp_path: Path, damage: str):
    copy_run(saved_run, tmp_path)
    run_dir = tmp_path / "run"
    latest = latest_checkpoint(run_dir)
    assert latest.name == "step-000004"
    DAMAGES[damage](latest)
    notices = []
    checkpoint, saved = find_checkpoint(run_dir, "latest", notice=notices.append)
    assert checkpoint.name == "step-000002" and saved["run"]["step"] == 2
    assert len(notices) == 1 and "step-000004" in notices[0] and "resuming from" in notices[0]
    # Named on the command line, a damaged checkpoint is refused, naming the file.
    with pytest.raises(UserError, match="damaged.*step-000004"):
        find_checkpoint(run_dir, latest, notice=notices.append)


def test_resume_passes_over_a_damaged_checkpoint_and_refuses_when_none_is_left(saved_run: Path, tmp_path: Path):
    recipe = copy_run(saved_run, tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    truncate(checkpoints / "step-000004" / "model.safetensors")
    result = ligertune("train", str(recipe), "-o", str(tmp_path / "run"), "--resume", "--max-steps", "7")
    assert result.returncode == 0, result.stderr[-3000:]
    out = "".join((result.stdout + result.stderr).split())  # the console wraps long lines
    assert "damaged" in out and "step-000004" in out and "resumedfrom" in out and "step-000002" in out
    assert "Traceback" not in out
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 7

    for folder in checkpoints.glob("step-*"):
        (folder / "trainer_state.pt").write_bytes(b"not a pickle at all")
    result = ligertune("train", str(recipe), "-o", str(tmp_path / "run"), "--resume", "--max-steps", "9")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and "trainer_state.pt" in lines[0], result.stderr


def limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_checkpoint_on_a_full_disk_is_one_line_and_the_previous_stays_latest(saved_run: Path, tmp_path: Path):
    recipe = copy_run(saved_run, tmp_path)
    run_dir = tmp_path / "run"
    model_bytes = (latest_checkpoint(run_dir) / "model.safetensors").stat().st_size
    # Files of at most half the model's size: the next checkpoint's weights cannot be written
    # (EFBIG, the error a full disk's ENOSPC also takes through the same path).
    result = ligertune("train", str(recipe), "-o", str(run_dir), "--resume", "--max-steps", "9",
                       "--set", "train.save_every=1",
                       preexec_fn=limit_file_size(model_bytes // 2))
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cannot write the checkpoint" in lines[0] and "ulimit -f" in lines[0]
    assert "step-000004 is intact" in lines[0]
    assert latest_checkpoint(run_dir).name == "step-000004"
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]


SLOW_SAVE = """
import sys, time
import torch
real = torch.save
written = []
def slow_second(obj, f, *args, **kwargs):
    if str(f).endswith("trainer_state.pt"):
        written.append(f)
        if len(written) == 2:
            print("writing the second trainer state", file=sys.stderr, flush=True)
            time.sleep(60)
    return real(obj, f, *args, **kwargs)
torch.save = slow_second
from ligertune.cli.main import main
sys.argv = ["ligertune", "train", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_during_a_save_exits_quietly_and_keeps_latest(tmp_path: Path, signum: int):
    path = write_recipe(tmp_path, train={"max_steps": 1000, "save_every": 2, "eval_every": None, "log_every": 1})
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(path)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # Once the first checkpoint is complete, ask the run to stop: it finishes its step and writes
        # a second checkpoint, slow to write, which a second signal interrupts.
        while latest_checkpoint(run_dir) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)
        line = ""
        while "writing the second trainer state" not in line and proc.poll() is None:
            line = proc.stderr.readline()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    assert latest_checkpoint(run_dir) is not None
    load_trainer_state(latest_checkpoint(run_dir))  # complete
    assert not [p for p in run_dir.rglob("*") if ".tmp-" in p.name]
