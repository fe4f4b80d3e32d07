"""Sending the scalars of metrics.jsonl to TensorBoard and Weights & Biases (`output.report_to`).

    reporters = open_reporters(["tensorboard", "wandb"], run_dir, config=recipe.to_dict())
    reporters.log({"step": 10, "loss": 2.31, "lr": 2e-4, "grad_norm": 0.8})  # one metrics record
    reporters.close()

Every numeric value of a record is sent at `record["step"]`, under `train/<key>`, or `eval/<key>`
for the `eval_` keys of evaluation records (`eval_loss` -> `eval/loss`, beside `train/loss`).

- `tensorboard`: event files under `run_dir/tensorboard/`, written by `torch.utils.tensorboard`
  (the `tensorboard` package's own writer): `tensorboard --logdir runs/`.
- `wandb`: a W&B run named after the run directory, its files under `run_dir/wandb/`. Offline
  unless the user chose otherwise: `WANDB_MODE` when set, else online only with an API key
  (`WANDB_API_KEY` or a `wandb login`); an offline run uploads later with `wandb sync`.
"""

from __future__ import annotations

import difflib
import netrc
import os
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from ligertune.errors import UserError

KEY = "output.report_to"
TENSORBOARD_DIR = "tensorboard"
DEFAULT_WANDB_PROJECT = "ligertune"


class Reporter(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class Reporters:
    """The reporters of a run, fed one metrics record at a time."""

    def __init__(self, reporters: list[Reporter]):
        self.reporters = reporters

    def log(self, record: dict[str, Any]) -> None:
        """Send the numeric values of `record` (bools, strings and the step itself left out) at its step."""
        if not self.reporters:
            return
        step = int(record["step"])
        scalars = {scalar_name(key): float(value) for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if scalars:
            for reporter in self.reporters:
                reporter.log(step, scalars)

    def close(self) -> None:
        """Flush and close every reporter, each even when another fails; the first failure is raised."""
        failure = None
        for reporter in self.reporters:
            try:
                reporter.close()
            except Exception as err:  # noqa: BLE001 - the others must still close
                failure = failure or err
        self.reporters = []
        if failure is not None:
            raise failure

    def __enter__(self) -> Reporters:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scalar_name(key: str) -> str:
    """`eval_loss` -> `eval/loss`, `loss` -> `train/loss`: train and eval curves side by side."""
    if key.startswith("eval_"):
        return f"eval/{key.removeprefix('eval_')}"
    return f"train/{key}"


def open_reporters(names: list[str], run_dir: Path, config: dict) -> Reporters:
    """Start one reporter per name (`tensorboard`, `wandb`) for the run in `run_dir`.

    `config` (the resolved recipe as a dict) goes to W&B as the run's config. An unknown name or a
    missing package is a `UserError` naming `output.report_to` and the extra to install; nothing is
    started then.
    """
    unknown = [name for name in names if name not in OPENERS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(OPENERS), n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        raise UserError(f"{KEY}: unknown reporter {unknown[0]!r}{hint} (choices: {', '.join(OPENERS)})")
    names = list(dict.fromkeys(names))
    for name in names:
        _require(name)
    opened: list[Reporter] = []
    try:
        for name in names:
            opened.append(OPENERS[name](Path(run_dir), config))
    except BaseException:
        Reporters(opened).close()
        raise
    return Reporters(opened)


# --------------------------------------------------------------------------------------------------
# TensorBoard


class TensorBoardReporter:
    """Scalars as TensorBoard event files under `run_dir/tensorboard/`."""

    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


# --------------------------------------------------------------------------------------------------
# Weights & Biases


class WandbReporter:
    """A W&B run named after the run directory, its files under `run_dir/wandb/`."""

    def __init__(self, run_dir: Path, config: dict):
        import wandb

        self.mode = wandb_mode()
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT,
            name=os.environ.get("WANDB_NAME") or run_dir.resolve().name,
            dir=str(run_dir),
            config=config,
            mode=self.mode,
            # The run's own display and metrics.jsonl have the console; no captured stdout in W&B.
            settings=wandb.Settings(console="off", quiet=True),
        )

    @property
    def run_path(self) -> Path:
        """The folder W&B writes this run's files to (run_dir/wandb/offline-run-... when offline)."""
        return Path(self.run.dir).parent

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        # The run is closed; the wandb-core service writes its last records to the offline log on
        # its own time, at the latest when the process ends (`wandb.teardown()` waits for it).
        self.run.finish()


def wandb_mode() -> str:
    """`WANDB_MODE` when the user set it, else online with an API key, else offline: a run never
    waits on a network it cannot reach nor asks for a login."""
    chosen = os.environ.get("WANDB_MODE", "").strip()
    if chosen:
        return chosen
    return "online" if wandb_api_key_present() else "offline"


def wandb_api_key_present() -> bool:
    """An API key in `WANDB_API_KEY` or in ~/.netrc (where `wandb login` keeps it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return bool(host and netrc.netrc().authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


# --------------------------------------------------------------------------------------------------
# the table


OPENERS = {"tensorboard": TensorBoardReporter, "wandb": WandbReporter}
"""Each reporter by name; the package it needs and its extra carry the same name."""


def _require(name: str) -> None:
    """Fail before anything starts when the package a reporter needs is missing."""
    try:
        if name == "tensorboard":
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        else:
            import wandb  # noqa: F401
    except ImportError:
        raise UserError(
            f"{KEY}: {name} needs the {name} package (the `{name}` extra): pip install {name}"
        ) from None
