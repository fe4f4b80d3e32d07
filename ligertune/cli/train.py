"""`ligertune train`: run a recipe, or continue one with `--resume`."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ligertune.cli.guard import debug_enabled, print_error
from ligertune.cli.interrupts import INTERRUPTS, report_interrupted
from ligertune.cli.options import (
    NnodesOpt,
    NodeRankOpt,
    NprocOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    RdzvTimeoutOpt,
    RecipeArg,
    SetOpt,
)
from ligertune.errors import EnvironmentFault, UserError

RESUME_COMMAND_VARIABLE = "LIGERTUNE_RESUME_COMMAND"
"""How the launcher tells its processes the command that continues the run (printed on Ctrl-C)."""


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
    nproc: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_id: RdzvIdOpt = None,
    rdzv_timeout: RdzvTimeoutOpt = 300,
    checkpoint: Annotated[
        Optional[Path],
        typer.Argument(help="With --resume: the checkpoint or run directory to continue from.", show_default=False),
    ] = None,
) -> None:
    """Fine-tune the recipe's model on its data.

    Ctrl-C (or SIGTERM) finishes the step under way, writes a checkpoint and prints the command
    that continues the run: `ligertune train RECIPE --resume [CHECKPOINT]`.

    On several machines, start it on each with the same --nnodes and --rdzv-endpoint and its own
    --node-rank; under SLURM, `srun ligertune train RECIPE` finds the nodes itself (docs/distributed.md).

    Example: [bold]ligertune train recipes/quickstart.yaml --set optim.lr=1e-3 --max-steps 50[/]
    """
    from ligertune.distributed import PeersLost, Rendezvous, hand_over, is_main_process, launch, reports_lost
    from ligertune.recipe import load_recipe
    from ligertune.slurm import slurm_step

    overrides = list(set_ or [])
    if output_dir is not None:  # quoted: a folder name is text, never YAML ("runs/#1", "[x]")
        overrides.append(f"output.dir={json.dumps(str(output_dir))}")
    if max_steps is not None:
        overrides.append(f"train.max_steps={max_steps}")
    if checkpoint is not None and not resume:
        raise UserError(f"{checkpoint}: a checkpoint to continue from goes with --resume")
    # This command as the user gave it, less the launch options and --resume: what each process runs,
    # and what the resume line printed on Ctrl-C repeats. (No --nproc for the processes: torchrun's
    # own parser would take it for an abbreviation of --nproc-per-node.)
    command = ["train", str(recipe), *(arg for o in set_ or [] for arg in ("--set", o))]
    if output_dir is not None:
        command += ["-o", str(output_dir)]
    if max_steps is not None:
        command += ["--max-steps", str(max_steps)]
    by_hand = nnodes > 1 or rdzv_endpoint is not None
    if not by_hand and (node_rank or rdzv_id is not None):
        raise UserError("--node-rank and --rdzv-id go with --nnodes N and --rdzv-endpoint HOST:PORT")
    started = "RANK" in os.environ  # a process of the run, started by torchrun (or by this command)
    slurm = None if started or by_hand else slurm_step(os.environ)
    rendezvous, launch_options = None, []
    if slurm is not None and slurm.tasks_are_processes:  # srun started every process itself
        if nproc not in (None, 1):
            raise UserError(f"--nproc: srun started a task per process ({slurm.describe()}); "
                            "--nproc goes with one task per node")
        os.environ.update(slurm.process_environment())
        started = True
    elif slurm is not None:  # a task per node: this one starts its node's processes
        nproc = nproc or slurm.gpus_on_node or 1
        if slurm.nnodes > 1:
            rendezvous = Rendezvous(slurm.nnodes, slurm.node_rank, slurm.endpoint, run_id=slurm.job_id,
                                    timeout_s=rdzv_timeout)
    elif by_hand:
        if rdzv_endpoint is None:
            raise UserError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT, an address of node 0 that "
                            "every node reaches and a free port there (the same on every node)")
        rendezvous = Rendezvous(nnodes, node_rank, rdzv_endpoint, run_id=rdzv_id or "ligertune",
                                timeout_s=rdzv_timeout)
        launch_options = ["--nnodes", str(nnodes), "--node-rank", "0", "--rdzv-endpoint", rdzv_endpoint,
                          *(["--rdzv-id", rdzv_id] if rdzv_id else [])]
    nproc = nproc or 1
    if slurm is not None:  # srun gives every task its place again
        per_node = ["--nproc", str(nproc)] if nproc > 1 and not slurm.tasks_are_processes else []
        resume_command = shlex.join(["srun", "ligertune", *command, *per_node, "--resume"])
    elif started:  # by our launcher, which said how the run continues, or by torchrun itself
        world = int(os.environ.get("WORLD_SIZE", "1"))
        resume_command = os.environ.get(RESUME_COMMAND_VARIABLE) or shlex.join(
            ["ligertune", *command, *(["--nproc", str(world)] if world > 1 else []), "--resume"])
    else:
        resume_command = shlex.join(["ligertune", *command, *launch_options,
                                     *(["--nproc", str(nproc)] if nproc > 1 else []), "--resume"])
    if not started and (nproc > 1 or rendezvous is not None):
        checked = load_recipe(recipe, overrides)  # a mistake in the recipe is reported once, before any process starts
        resuming = ["--resume", *([str(checkpoint)] if checkpoint else [])] if resume else []
        try:
            code = launch(nproc, [*command, *resuming], rendezvous=rendezvous,
                          env={RESUME_COMMAND_VARIABLE: resume_command})
        except PeersLost as lost:  # this node's one line: its processes said nothing of it
            raise EnvironmentFault(after_lost(lost, Path(checked.output.dir), resume_command)) from None
        raise typer.Exit(code)
    # Imported here: a launcher of processes needs none of it (it would cost each launch seconds).
    from ligertune.training import RunInterrupted
    from ligertune.training import train as run_training

    console = Console()

    def report_lost(lost: PeersLost) -> None:
        line = after_lost(lost, Path(loaded.output.dir), resume_command)
        hand_over(lost, line)
        if reports_lost(lost):
            print_error(line, every_rank=True)

    try:
        loaded = load_recipe(recipe, overrides)
        run_training(loaded, console=console, resume=(checkpoint or "latest") if resume else None,
                     resume_command=resume_command, on_peers_lost=report_lost)
    except PeersLost as lost:  # another process of the run stopped
        if debug_enabled():
            raise
        report_lost(lost)
        raise typer.Exit(1) from None
    except RunInterrupted as stop:
        if is_main_process():
            Console(stderr=True, highlight=False).print(str(stop), markup=False)
        raise typer.Exit(stop.exit_code) from None
    except INTERRUPTS as err:  # before the loop, or a second signal within it
        code = report_interrupted(err, "nothing half-written was left (the last complete checkpoint, if any, "
                                       "is intact)")
        raise typer.Exit(code) from None


def after_lost(lost: BaseException, output_dir: Path, resume_command: str) -> str:
    """The line about lost processes, with what is left to continue from: the last checkpoint (a
    checkpoint is published only once complete, so a failure while saving leaves the one before)
    and the command that resumes it."""
    from ligertune.training.checkpoint import latest_checkpoint

    latest = latest_checkpoint(output_dir)
    if latest is None:
        return f"{lost}; no checkpoint was written in {output_dir}"
    return f"{lost}; the last checkpoint {latest} is intact; resume with: {resume_command}"
