"""`ligertune plot`: a run's loss, learning rate and grad norm curves as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console


def plot(
    run: Annotated[
        Path, typer.Argument(help="A run directory (or its metrics.jsonl).", show_default=False)
    ],
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="PNG to write (default: RUN/loss.png).",
                                     show_default=False)
    ] = None,
) -> None:
    """Draw train and eval loss against step, and the learning rate and grad norm below, from metrics.jsonl.

    Needs matplotlib: pip install 'ligertune[plot]'.

    Example: [bold]ligertune plot runs/quickstart --output loss.png[/]
    """
    from ligertune.errors import UserError
    from ligertune.plotting import plot_metrics, require_matplotlib

    require_matplotlib()
    metrics = run / "metrics.jsonl" if run.is_dir() else run
    if not metrics.is_file():
        raise UserError(f"{run}: no metrics.jsonl there (expected a run directory or a metrics.jsonl)")
    target = output if output is not None else metrics.parent / "loss.png"
    # A path is not rich markup: a folder named `x[/y]` prints as it is.
    Console(highlight=False, soft_wrap=True).print(f"wrote {plot_metrics(metrics, target)}", markup=False)
