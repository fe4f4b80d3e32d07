"""What a person watches during a run: a progress bar with a live metrics line, and a summary."""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text


def format_metrics(record: dict) -> str:
    parts = [f"loss {record['loss']:.4f}"]
    if "token_accuracy" in record:
        parts.append(f"acc {record['token_accuracy']:.1%}")
    if "reward_accuracy" in record:  # preference objectives: how often the chosen answer wins
        parts.append(f"pairs won {record['reward_accuracy']:.1%}  margin {record['reward_margin']:.3f}")
    if "reward_desirable" in record:  # KTO: the reference point, and each kind's reward
        parts.append(f"kl {record['kl']:.3f}  reward desirable {record['reward_desirable']:.3f} "
                     f"undesirable {record['reward_undesirable']:.3f}")
    if record.get("z_loss"):
        parts.append(f"z {record['z_loss']:.2e}")
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    parts.append(f"lr {record['lr']:.2e}")
    parts.append(f"grad {record['grad_norm']:.3f}")
    for units in ("pairs", "examples"):  # preference objectives: their own rate, before the tokens'
        if f"{units}_per_s" in record:
            parts.append(f"{record[f'{units}_per_s']:,.2f} {units}/s")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("spikes"):
        parts.append(f"spikes {record['spikes']}")
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu']:.0%}")
    if record.get("peak_mem_gib"):
        parts.append(f"mem {record['peak_mem_gib']:.1f} GiB")
    return "  ".join(parts)


class TrainProgress:
    """A rich progress bar over optimizer steps, with the latest metrics on a line below it."""

    def __init__(self, console: Console, total_steps: int, initial_step: int = 0):
        self.console = console
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=None),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=initial_step)
        self._metrics = Text("", style="cyan")
        self._live = Live(Group(self._progress, self._metrics), console=console, refresh_per_second=4)

    def __enter__(self) -> TrainProgress:
        self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        self._live.stop()
        if not self.console.is_terminal:
            self.console.line()

    def advance(self, step: int, record: dict | None = None) -> None:
        self._progress.update(self._task, completed=step)
        if record:
            self._metrics.plain = format_metrics(record)

    def log(self, message: str) -> None:
        self._live.console.print(message)


def summary_table(rows: list[tuple[str, str]], title: str = "run summary") -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text(value))  # values echo paths: printed literally, never as markup
    return table


def sample_table(prompt: str, reference: str, answer: str, *, preference: bool = False) -> Table:
    """The greedy answer to a held-out conversation beside its reference turn (preference data: to a
    held-out prompt, beside its chosen answer)."""
    title = "held-out prompt: greedy answer" if preference else "held-out conversation: greedy answer"
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("prompt (end)" if preference else "conversation so far (end)", overflow="fold")
    table.add_column("chosen answer" if preference else "reference", overflow="fold")
    table.add_column("model", overflow="fold")
    answer_style = "green" if answer.strip() == reference.strip() else "yellow"
    table.add_row(Text(prompt), Text(reference), Text(answer, style=answer_style))
    return table
