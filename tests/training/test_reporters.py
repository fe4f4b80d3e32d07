"""Reporters: the scalars of metrics records in TensorBoard event files and an offline W&B run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from ligertune.errors import UserError
from ligertune.training.reporters import Reporters, open_reporters, scalar_name, wandb_mode

RECORDS = [
    {"step": 0, "eval_loss": 5.7, "eval_token_accuracy": 0.0},
    {"step": 1, "loss": 5.5, "z_loss": 0.0, "tokens": 300, "lr": 1e-4, "grad_norm": 1.5,
     "tokens_per_s": 900.0},
    {"step": 2, "loss": 5.25, "z_loss": 0.0, "tokens": 280, "lr": 2e-4, "grad_norm": math.nan,
     "tokens_per_s": 950.0, "skipped": True, "note": "spike"},
    {"step": 2, "eval_loss": 5.0, "eval_token_accuracy": 0.125},
]


def test_scalar_names_put_train_and_eval_side_by_side():
    assert scalar_name("loss") == "train/loss"
    assert scalar_name("eval_loss") == "eval/loss"
    assert scalar_name("eval_token_accuracy") == "eval/token_accuracy"
    assert scalar_name("grad_norm") == "train/grad_norm"


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open_reporters(["tensorboard"], tmp_path, config={"optim": {"lr": 2e-4}}) as reporters:
        for record in RECORDS:
            reporters.log(record)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted([
        "eval/loss", "eval/token_accuracy", "train/loss", "train/z_loss", "train/tokens", "train/lr",
        "train/grad_norm", "train/tokens_per_s",
    ])  # the bool and the string were left out

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert series("train/loss") == [(1, 5.5), (2, 5.25)]
    assert series("eval/loss") == [(0, pytest.approx(5.7)), (2, 5.0)]
    assert series("train/lr") == [(1, pytest.approx(1e-4)), (2, pytest.approx(2e-4))]
    assert series("train/tokens") == [(1, 300.0), (2, 280.0)]
    grad = series("train/grad_norm")
    assert grad[0] == (1, 1.5) and grad[1][0] == 2 and math.isnan(grad[1][1])


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch) -> Path:
    """No W&B settings of the machine's user: no mode, key, login or config directory."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    return home


def test_wandb_is_offline_unless_the_user_chose_otherwise(wandb_env: Path, monkeypatch):
    assert wandb_mode() == "offline"
    (wandb_env / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (wandb_env / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"  # `wandb login` keeps the key there
    (wandb_env / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_wandb_offline_run_is_written_under_the_run_dir(tmp_path: Path, wandb_env: Path):
    """Runs only where wandb is installed (the `wandb` extra; not in the `test` extra: it is large)."""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    reporters = open_reporters(["wandb"], run_dir, config={"optim": {"lr": 2e-4}, "train": {"seed": 0}})
    (reporter,) = reporters.reporters
    assert reporter.mode == "offline"
    for record in RECORDS:
        reporters.log(record)
    reporters.close()
    import wandb

    # finish() returns once the run is closed; the wandb-core service writes the log on its own
    # time. Stopping the service (as the end of a process does) flushes it.
    wandb.teardown()
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    assert reporter.run_path.resolve() == offline.resolve()
    (log,) = offline.glob("run-*.wandb")
    data = log.read_bytes()  # W&B's record log, protobuf: keys and config appear as they are
    for key in (b"train/loss", b"train/grad_norm", b"eval/loss", b"eval/token_accuracy", b"optim"):
        assert key in data, key
    assert b"train/skipped" not in data and b"train/note" not in data


def test_unknown_reporter_names_the_key_and_suggests(tmp_path: Path):
    with pytest.raises(UserError, match=r"output.report_to: unknown reporter 'tensorbord'; did you mean "
                                        r"`tensorboard`\? \(choices: tensorboard, wandb\)"):
        open_reporters(["tensorbord"], tmp_path, config={})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_package_names_the_key_and_the_extra(tmp_path: Path, monkeypatch, name: str):
    monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    with pytest.raises(UserError, match=rf"output.report_to: {name} needs the {name} package "
                                        rf"\(the `{name}` extra\): pip install {name}"):
        open_reporters(["tensorboard", "wandb"], tmp_path, config={})
    assert not list(tmp_path.iterdir())  # nothing was started


def test_no_reporter_is_a_no_op(tmp_path: Path):
    reporters = open_reporters([], tmp_path, config={})
    reporters.log({"step": 1, "loss": 1.0})
    reporters.close()
    assert not list(tmp_path.iterdir())


def test_close_closes_every_reporter_even_when_one_fails():
    closed = []

    class Fake:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def log(self, step, scalars):
            pass

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise OSError(f"{self.name} failed")

    reporters = Reporters([Fake("a", fail=True), Fake("b")])
    with pytest.raises(OSError, match="a failed"):
        reporters.close()
    assert closed == ["a", "b"]
