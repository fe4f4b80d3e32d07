"""`ligertune train`: run a recipe, or continue one with `--resume`."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ligertune.cli.interrupts import INTERRUPTS, report_interrupted
from ligertune.cli.options import RecipeArg, SetOpt
from ligertune.errors import UserError


def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    output_dir: Annotated[
        Optional[Path], typer.Option("--output-dir", "-o", help="Write the run here (overrides output.dir).")
    ] = None,
    max_steps: Annotated[
        Optional[int], typer.Option("--max-steps", min=1, help="Stop after N optimizer steps (overrides train.max_steps).")
    ] = None,
    resume: Annotated[
        bool,
        typer.Option("--resume", help="Continue the run in output.dir from its latest checkpoint (or from CHECKPOINT)."),
    ] = False,
    nproc: Annotated[
        int,
        typer.Option("--nproc", min=1, help="Train with N processes (one per GPU; gloo on the CPU), as torchrun does."),
    ] = 1,
    checkpoint: Annotated[
        Optional[Path],
        typer.Argument(help="With --resume: the checkpoint or run directory to continue from.", show_default=False),
    ] = None,
) -> None:
    """Fine-tune the recipe's model on its data.

    Ctrl-C (or SIGTERM) finishes the step under way, writes a checkpoint and prints the command
    that continues the run: `ligertune train RECIPE --resume [CHECKPOINT]`.

    Example: [bold]ligertune train recipes/quickstart.yaml --set optim.lr=1e-3 --max-steps 50[/]
    """
    from ligertune.distributed import is_main_process, launch, topology_from_environment
    from ligertune.recipe import load_recipe
    from ligertune.training import RunInterrupted
    from ligertune.training import train as run_training

    overrides = list(set_ or [])
    if output_dir is not None:  # quoted: a folder name is text, never YAML ("runs/#1", "[x]")
        overrides.append(f"output.dir={json.dumps(str(output_dir))}")
    if max_steps is not None:
        overrides.append(f"train.max_steps={max_steps}")
    if checkpoint is not None and not resume:
        raise UserError(f"{checkpoint}: a checkpoint to continue from goes with --resume")
    # This command as the user gave it, less --nproc and --resume: what each process runs, and what
    # the resume line printed on Ctrl-C repeats. (No --nproc for the processes: torchrun's own
    # parser would take it for an abbreviation of --nproc-per-node.)
    command = ["train", str(recipe), *(arg for o in set_ or [] for arg in ("--set", o))]
    if output_dir is not None:
        command += ["-o", str(output_dir)]
    if max_steps is not None:
        command += ["--max-steps", str(max_steps)]
    processes = topology_from_environment().world_size if "RANK" in os.environ else nproc
    resume_command = shlex.join(["ligertune", *command, *(["--nproc", str(processes)] if processes > 1 else []),
                                 "--resume"])
    if nproc > 1 and "RANK" not in os.environ:  # not yet started by torchrun
        load_recipe(recipe, overrides)  # a mistake in the recipe is reported once, before any process starts
        resuming = ["--resume", *([str(checkpoint)] if checkpoint else [])] if resume else []
        raise typer.Exit(launch(nproc, [*command, *resuming]))
    console = Console()
    try:
        run_training(load_recipe(recipe, overrides), console=console,
                     resume=(checkpoint or "latest") if resume else None,
                     resume_command=resume_command)
    except RunInterrupted as stop:
        if is_main_process():
            Console(stderr=True, highlight=False).print(str(stop), markup=False)
        raise typer.Exit(stop.exit_code) from None
    except INTERRUPTS as err:  # before the loop, or a second signal within it
        code = report_interrupted(err, "nothing half-written was left (the last complete checkpoint, if any, "
                                       "is intact)")
        raise typer.Exit(code) from None
