"""Runs that survive: exact resume, interrupts, failed writes, the non-finite guard, one run per folder."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_recipe import write_recipe

from ligertune.errors import EnvironmentFault, UserError
from ligertune.metrics import read_metrics
from ligertune.recipe import load_recipe
from ligertune.training import RunInterrupted, TrainingDiverged, cleanup, setup, train_loop
from ligertune.training import checkpoint as checkpoint_module
from ligertune.training.checkpoint import latest_checkpoint, load_trainer_state

TIMINGS = ("tokens_per_s", "trained_tokens_per_s", "pairs_per_s", "examples_per_s", "eval_s", "save_s",
           "peak_mem_gib")
# 16 packs of the tiny data, 4 packs a step: an epoch is 4 steps, so step 5 is inside the second.
STEPS, STOP_AT = 8, 5


class StopAt:
    """Stands in for the signal handler: asks the loop to stop once `run` has done `step` steps."""

    def __init__(self, run, step: int, signum: int = signal.SIGINT):
        self.run, self.step, self.signum = run, step, signum

    @property
    def requested(self):
        return self.signum if self.run.state.step >= self.step else None


def start(path: Path, *overrides: str, resume=None):
    return setup(load_recipe(path, list(overrides)), Console(quiet=True), resume=resume)


def finish(run, stop=None):
    try:
        return train_loop(run, stop)
    finally:
        cleanup(run)


def records_after(run_dir: Path, step: int) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS}
            for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > step and "checkpoint" not in r]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_interrupted_and_resumed_run_equals_the_straight_run_bitwise(tmp_path: Path, lora: bool):
    sections = {"lora": {"r": 4, "alpha": 8}} if lora else {}
    path = write_recipe(tmp_path, train={"max_steps": STEPS, "eval_every": 4, "save_every": 3}, **sections)
    straight = start(path, f"output.dir={tmp_path / 'straight'}")
    finish(straight)

    interrupted = start(path, f"output.dir={tmp_path / 'resumed'}")
    with pytest.raises(RunInterrupted) as stopped:
        finish(interrupted, StopAt(interrupted, STOP_AT))
    assert stopped.value.exit_code == 130
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    assert checkpoint.name == "step-000005"
    position = load_trainer_state(checkpoint)["run"]
    assert (position["epoch"], position["index"]) == (1, 4)  # inside the second epoch

    resumed = start(path, f"output.dir={tmp_path / 'resumed'}", resume="latest")
    assert resumed.state.step == STOP_AT
    finish(resumed)

    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    assert records_after(tmp_path / "resumed", STOP_AT) == records_after(tmp_path / "straight", STOP_AT)
    assert len(records_after(tmp_path / "resumed", 0)) == len(records_after(tmp_path / "straight", 0))
    # the resumed metrics read as one run: every train step once
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, STEPS + 1))


def test_keep_checkpoints_and_latest(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 7, "save_every": 2, "keep_checkpoints": 2,
                                         "eval_every": None})
    finish(start(path))
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-000004", "step-000006"]
    assert os.readlink(folder / "latest") == "step-000006"
    state = load_trainer_state(folder / "step-000006")
    assert {"scheduler", "rng", "run", "recipe"} <= state.keys()
    assert (folder / "step-000006" / "optimizer" / ".metadata").exists()
    assert (folder / "step-000006" / "model.safetensors").exists()
    assert (folder / "step-000006" / "tokenizer.json").exists()


def test_resume_refuses_a_recipe_with_other_math_and_a_missing_checkpoint(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 4, "save_every": 2, "eval_every": None})
    with pytest.raises(UserError, match="no checkpoint"):
        start(path, resume="latest")
    finish(start(path))
    with pytest.raises(UserError, match=r"optim\.lr .*train\.grad_accum_steps "):
        start(path, "optim.lr=1e-2", "train.grad_accum_steps=1", resume="latest")
    # How long to run and how often to log may change.
    run = start(path, "train.max_steps=6", "train.log_every=2", resume="latest")
    assert run.state.step == 2
    cleanup(run)


def test_resume_refuses_training_data_changed_since_the_checkpoint(tmp_path: Path):
    """The data position counts packs: over a data file edited since, it would count other packs."""
    path = write_recipe(tmp_path, train={"max_steps": 4, "save_every": 2, "eval_every": None})
    finish(start(path))
    data = tmp_path / "train.jsonl"
    original = data.read_text(encoding="utf-8")
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["data"]["packs"] == 16
    data.write_text(original.replace('"content": "', '"content": "Now ', 1), encoding="utf-8")
    with pytest.raises(UserError, match=r"training data differ .*step-000002.*\(as many packs \(16\), with "
                                        r"other contents\)"):
        start(path, "train.max_steps=6", resume="latest")
    lines = original.splitlines(keepends=True)
    data.write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    with pytest.raises(UserError, match=r"training data differ .*\(16 packs then, \d+ now\)"):
        start(path, "train.max_steps=6", resume="latest")
    data.write_text(original, encoding="utf-8")  # the same data again: the run continues
    run = start(path, "train.max_steps=6", resume="latest")
    assert run.state.step == 2
    cleanup(run)


def test_the_packs_digest_sees_every_field_but_the_reference_values():
    import dataclasses

    from ligertune.data import Pack
    from ligertune.data.preference import PreferencePack
    from ligertune.data import packs_digest

    pack = Pack(input_ids=[5, 6, 7, 8], targets=[6, 7, -100, -100], seq_lens=[3, 1], example_indices=[0, 1])
    digest = packs_digest([pack])
    assert packs_digest([dataclasses.replace(pack)]) == digest
    for change in ({"input_ids": [5, 6, 7, 9]}, {"targets": [6, -100, -100, -100]}, {"seq_lens": [2, 2]},
                   {"example_indices": [1, 0]}):
        assert packs_digest([dataclasses.replace(pack, **change)]) != digest, change
    pair = PreferencePack(input_ids=[1, 2, 3, 4], prompt_lens=[2], answer_lens=[(1, 1)], score_rows=[1, 2],
                          score_targets=[3, 4], score_answers=[0, 1])
    scored = dataclasses.replace(pair, reference_logps=[-1.5, -2.5])  # computed from the packs, later
    assert packs_digest([scored]) == packs_digest([pair])
    assert packs_digest([dataclasses.replace(pair, answer_lens=[(2, 0)])]) != packs_digest([pair])


def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp_path: Path, monkeypatch):
    path = write_recipe(tmp_path, train={"max_steps": 6, "save_every": 2, "eval_every": None})
    run = start(path)
    real_save = checkpoint_module.torch.save

    def full_disk(obj, f, *args, **kwargs):
        if run.state.step == 4:  # the second checkpoint
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
    with pytest.raises(EnvironmentFault, match="No space left on device.*step-000002 is intact"):
        finish(run)
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-000002"]
    assert load_trainer_state(latest_checkpoint(tmp_path / "run"))["run"]["step"] == 2
    assert not (tmp_path / "run" / ".lock").exists()


def poison(run, steps: set[int]) -> None:
    """Make the loss of the given steps (1-based) NaN."""
    forward = run.head.forward

    def nan_at_some_steps(*args, **kwargs):
        out = forward(*args, **kwargs)
        if run.state.step + 1 in steps:
            out.loss = out.loss * float("nan")
        return out

    run.head.forward = nan_at_some_steps


def test_a_non_finite_step_is_skipped_and_counted(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 3, "eval_every": None})
    run = start(path)
    poison(run, {2})
    before = {}

    original_step = run.optimizer.step

    def remember(*args, **kwargs):
        before[run.state.step + 1] = [p.detach().clone() for p in run.trainable]
        return original_step(*args, **kwargs)

    run.optimizer.step = remember
    result = finish(run)
    assert sorted(before) == [1, 3]  # no update at step 2
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    step2 = next(r for r in records if r["step"] == 2)
    assert step2["skipped"] == "nonfinite" and step2["loss"] is None  # strict JSON: null, not NaN
    assert result.skipped_steps == 1
    assert "NaN" not in (tmp_path / "run" / "metrics.jsonl").read_text()
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())


def test_consecutive_non_finite_steps_stop_the_run(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 10, "save_every": 2, "max_skipped_steps": 3,
                                         "eval_every": None})
    run = start(path)
    poison(run, {3, 4, 5, 6, 7, 8})
    with pytest.raises(TrainingDiverged, match="step 5: 3 steps in a row.*optim.lr.*step-000004"):
        finish(run)
    assert latest_checkpoint(tmp_path / "run").name == "step-000004"
    assert not (tmp_path / "run" / "final").exists()


def test_one_run_per_directory(tmp_path: Path):
    path = write_recipe(tmp_path, train={"max_steps": 2, "save_every": 1, "eval_every": None})
    out = tmp_path / "run"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (out / ".lock").write_text(f"{sleeper.pid} {socket.gethostname()}\n")
        with pytest.raises(UserError, match=f"another run \\(process {sleeper.pid}\\)"):
            start(path)
    finally:
        sleeper.kill()
        sleeper.wait()
    # The lock of a process that is gone is taken over.
    run = start(path)
    assert (out / ".lock").read_text().split()[0] == str(os.getpid())
    with pytest.raises(RunInterrupted):
        finish(run, StopAt(run, 1))
    # An unfinished run is neither continued nor overwritten by surprise.
    with pytest.raises(UserError, match="unfinished run.*--resume.*output.overwrite"):
        start(path)
    run = start(path, "output.overwrite=true")
    finish(run)
    assert (tmp_path / "run.previous" / "checkpoints" / "step-000001").is_dir()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]


def test_output_dir_that_cannot_be_written_is_refused_before_building(tmp_path: Path, monkeypatch):
    import ligertune.training.trainer as trainer_module

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the output folder was checked")

    monkeypatch.setattr(trainer_module, "build_model", never)
    path = write_recipe(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        start(path, f"output.dir={tmp_path / 'file'}")
    with pytest.raises(UserError, match="cannot be created or written"):
        start(path, f"output.dir={tmp_path / 'file' / 'run'}")
    if Path("/proc/self").is_dir():  # a folder that no permission bit forbids, yet cannot hold one
        with pytest.raises(UserError, match="cannot be created or written"):
            start(path, "output.dir=/proc/ligertune-run")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UserError, match="cannot be created or written"):
            start(path, f"output.dir={locked / 'run'}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_after_a_checkpoint_and_the_run_resumes_to_the_same_end(tmp_path: Path, signum):
    # A constant schedule, so that the shorter resumed run below follows the same learning rates.
    path = write_recipe(tmp_path, train={"max_steps": 400, "save_every": 2, "eval_every": None,
                                         "log_every": 50}, optim={"schedule": "constant"})
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LIGERTUNE_DEBUG": ""}
    proc = subprocess.Popen([sys.executable, "-m", "ligertune", "train", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while latest_checkpoint(out) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stdout + stderr
    assert "--resume" in stderr
    stopped_at = load_trainer_state(latest_checkpoint(out))["run"]["step"]
    assert 2 <= stopped_at < 400
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]  # no temporaries
    assert not (out / ".lock").exists()

    # Resume, to a shorter end so the test stays quick, and compare with a straight run to it.
    end = stopped_at + 2
    resumed = start(path, f"train.max_steps={end}", resume="latest")
    finish(resumed)
    straight = start(path, f"train.max_steps={end}", f"output.dir={tmp_path / 'straight'}",
                     "train.save_every=1000")
    finish(straight)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_a_second_ctrl_c_during_a_checkpoint_write_leaves_nothing_half_written(tmp_path: Path, monkeypatch):
    path = write_recipe(tmp_path, train={"max_steps": 6, "save_every": 2, "eval_every": None})
    run = start(path)
    real_save = checkpoint_module.torch.save

    def interrupted(obj, f, *args, **kwargs):
        if run.state.step == 4 and str(f).endswith("trainer_state.pt"):  # the second checkpoint's last file
            raise KeyboardInterrupt
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        finish(run)
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-000002"]
    assert latest_checkpoint(tmp_path / "run").name == "step-000002"


def test_run_files_follow_the_umask_and_a_failed_start_leaves_no_folder(tmp_path: Path):
    previous = os.umask(0o022)
    try:
        path = write_recipe(tmp_path, train={"max_steps": 2, "save_every": 1, "eval_every": None})
        finish(start(path))
        out = tmp_path / "run"
        for item in [out / "final", *(out / "final").iterdir(), *(out / "checkpoints" / "step-000001").iterdir()]:
            expected = 0o755 if item.is_dir() else 0o644
            assert item.stat().st_mode & 0o777 == expected, item
        with pytest.raises(UserError):
            start(path, f"output.dir={tmp_path / 'never'}", "data.path=missing.jsonl")
        assert not (tmp_path / "never").exists()
    finally:
        os.umask(previous)
