"""`ligertune verify-loss`: prove on a recipe that packing and batching leave the loss unchanged."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from ligertune.cli.options import JsonOpt, RecipeArg, SetOpt
from ligertune.errors import UserError


def verify_loss(
    recipe: RecipeArg,
    set_: SetOpt = None,
    json_: JsonOpt = False,
    samples: Annotated[int, typer.Option("--samples", "-n", help="Conversations (preference recipes: pairs) in the compared step.")] = 8,
    modes: Annotated[
        str, typer.Option("--modes", help="Normalization modes to check, comma-separated: token,sequence,sum.")
    ] = "token,sequence",
    nproc: Annotated[
        int,
        typer.Option("--nproc", min=1, help="Also deal the step out to N processes, sharded as `train --nproc N` does."),
    ] = 1,
) -> None:
    """Compare ligertune's packed and accumulated loss and gradients with each conversation run alone.

    Exits 0 when every ligertune case passes, 1 otherwise; the naive cases show the error avoided.

    Example: [bold]ligertune verify-loss recipes/quickstart.yaml --modes token,sequence --samples 8 --nproc 2[/]
    """
    import transformers

    from ligertune.distributed import destroy_process_group, finished_together, is_main_process, launch
    from ligertune.recipe import load_recipe
    from ligertune.verify import verify_loss as run

    transformers.utils.logging.disable_progress_bar()  # the report is the command's output
    overrides = list(set_ or [])
    loaded = load_recipe(recipe, overrides)
    if nproc > 1 and "RANK" not in os.environ:  # not yet started by torchrun
        if samples % nproc:
            raise UserError(f"--samples: {samples} conversations do not split evenly over {nproc} processes; "
                            f"use a multiple of {nproc}")
        command = ["verify-loss", str(recipe), *(arg for o in overrides for arg in ("--set", o)),
                   "--samples", str(samples), "--modes", modes, *(["--json"] if json_ else [])]
        raise typer.Exit(launch(nproc, command))
    try:
        report = run(loaded, samples=samples, modes=[m.strip() for m in modes.split(",") if m.strip()])
        finished_together()
    finally:
        destroy_process_group()
    if not is_main_process():
        raise typer.Exit(0 if report.passed else 1)
    if json_:
        print(json.dumps(report.to_json(), indent=2))
    else:
        loss_tol, grad_tol = report.tolerances
        table = Table(
            title=f"verify-loss: {report.samples} {report.unit}, {report.dtype} on {report.device}"
            + (f" x {report.processes} processes" if report.processes > 1 else "") + " "
            f"(tolerances: loss {loss_tol:g} relative, gradient {grad_tol:g} relative)",
            title_justify="left",
            box=box.SIMPLE_HEAD,
        )
        for column in ("case", "mode", "reference", "candidate", "|dloss|", "grad err", "result"):
            left = column in ("case", "mode", "result")
            table.add_column(column, justify="left" if left else "right", no_wrap=True)
        for case in report.cases:
            if case.kind == "naive":
                result = "[dim]differs[/]" if not case.passed else "[dim]equal[/]"
            else:
                result = "[bold green]PASS[/]" if case.passed else "[bold red]FAIL[/]"
            table.add_row(case.name, case.mode, f"{case.loss_reference:.5f}", f"{case.loss_candidate:.5f}",
                          f"{case.abs_diff:.1e}", f"{case.grad_rel_err:.1e}", result)
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
        console.print(table)
        console.print("[bold green]PASS[/]: every ligertune case matches the reference" if report.passed
                      else "[bold red]FAIL[/]: a ligertune case differs from the reference")
        console.print("[dim]naive cases are what packing without ligertune's care computes; "
                      "they are expected to differ[/]")
    raise typer.Exit(0 if report.passed else 1)
