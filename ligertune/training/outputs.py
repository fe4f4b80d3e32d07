"""What a run prints and writes once, whatever the number of processes.

Rank 0 holds the real `Outputs`: the console, the run folder's lock, `metrics.jsonl`, `spikes.jsonl`
and the reporters of `output.report_to`. Every other rank holds an inert one that prints and writes
nothing, so the loop calls the same methods on every rank and no `if rank == 0` is spread through it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rich.console import Console

from ligertune.errors import UserError
from ligertune.files import write_atomic_text
from ligertune.metrics import MetricsLog
from ligertune.plotting import plot_metrics
from ligertune.training.reporters import Reporters, open_reporters
from ligertune.training.run_dir import RunLock, claim_output_dir

METRICS = "metrics.jsonl"
SPIKES = "spikes.jsonl"
RECIPE = "recipe.yaml"


class Outputs:
    """The run's console and files (rank 0), or nothing (`Outputs.inert()`, every other rank)."""

    def __init__(self, console: Console, *, output_dir: Path | None = None, lock: RunLock | None = None,
                 metrics: MetricsLog | None = None, spikes: MetricsLog | None = None,
                 reporters: Reporters | None = None):
        self.console = console
        self.output_dir = output_dir
        self._lock = lock
        self._metrics = metrics or MetricsLog(None)
        self._spikes = spikes or MetricsLog(None)
        self._reporters = reporters

    @classmethod
    def inert(cls) -> "Outputs":
        return cls(Console(quiet=True))

    @classmethod
    def open(cls, output_dir: Path, console: Console, *, recipe_text: str, replace: bool,
             resume_after: int | None, spike_watch: bool, report_to: list[str], config: dict) -> "Outputs":
        """Claim `output_dir` (`run_dir.claim_output_dir`), write the resolved recipe and open the
        run's logs. `resume_after=k` continues the logs of a run resumed at step k; the spike log is
        opened when the spike watch is on or the resumed run left one (cut back like metrics.jsonl:
        the resumed run flags those steps again)."""
        lock = claim_output_dir(output_dir, replace=replace,
                                notice=lambda text: console.print(text, markup=False))
        try:
            write_atomic_text(output_dir / RECIPE, recipe_text)
            metrics = MetricsLog(output_dir / METRICS, resume_after=resume_after)
            spikes_path = output_dir / SPIKES
            keep_spikes = spike_watch or (resume_after is not None and spikes_path.exists())
            spikes = MetricsLog(spikes_path, resume_after=resume_after) if keep_spikes else None
        except OSError as err:
            lock.release()
            raise UserError(f"output.dir: cannot write {output_dir}: {err.strerror or err}") from None
        try:
            reporters = open_reporters(report_to, output_dir, config) if report_to else None
        except BaseException:
            metrics.close()
            lock.release()
            raise
        return cls(console, output_dir=output_dir, lock=lock, metrics=metrics, spikes=spikes, reporters=reporters)

    def print(self, text, *, style: str | None = None, markup: bool = False) -> None:
        self.console.print(text, style=style, markup=markup)

    def warn(self, text: str) -> None:
        self.console.print(f"warning: {text}", style="yellow", markup=False)

    def record(self, record: dict) -> None:
        """One record to `metrics.jsonl` and to the reporters of `output.report_to`."""
        self._metrics.write(record)
        if self._reporters is not None:
            self._reporters.log(record)

    def spike(self, record: dict) -> None:
        self._spikes.write(record)

    def plot(self) -> None:
        """`loss.png` beside `metrics.jsonl`, when matplotlib is installed."""
        if self.output_dir is None or importlib.util.find_spec("matplotlib") is None:
            return
        self._metrics.close()  # flushed and complete before it is read
        plot_metrics(self.output_dir / METRICS, self.output_dir / "loss.png")

    def close(self) -> None:
        self._metrics.close()
        self._spikes.close()
        if self._reporters is not None:
            self._reporters.close()
            self._reporters = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
