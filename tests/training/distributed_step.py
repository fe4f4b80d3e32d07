"""Run under `torchrun`: one optimizer step's loss and full gradients for each loss normalization.

    torchrun --nproc_per_node 2 tests/training/distributed_step.py RECIPE OUT.pt [KEY=VALUE ...]

Rank 0 saves {mode: (loss, {parameter name: gradient})} to OUT.pt, the gradients gathered whole
from the shards, for the test to compare with one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from cli_runs import leave_launched_process
from rich.console import Console

from ligertune.distributed import (
    destroy_process_group,
    finished_together,
    full_tensor,
    topology_from_environment,
)
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, forward_backward, next_batches, setup

MODES = ("token", "sequence", "sum")


def step_gradients(recipe_path: str, overrides: list[str], out_dir: Path) -> dict:
    results = {}
    for mode in MODES:
        recipe = load_recipe(recipe_path, [*overrides, f"loss.normalization={mode}",
                                           f"output.dir={out_dir / mode}"])
        run = setup(recipe, Console(quiet=True))
        try:
            totals = forward_backward(run, next_batches(run), backward=True)
            loss = full_tensor(totals["loss"]).double()
            if run.topology.distributed:
                torch.distributed.all_reduce(loss)
            grads = {name: full_tensor(p.grad).detach().double().clone()
                     for name, p in run.model.named_parameters() if p.requires_grad}
            results[mode] = (loss.item(), grads)
        finally:
            cleanup(run)
    return results


if __name__ == "__main__":
    recipe_path, out, *overrides = sys.argv[1:]
    results = step_gradients(recipe_path, overrides, Path(out).parent / "runs")
    if topology_from_environment().is_main:
        torch.save(results, out)
    finished_together()
    destroy_process_group()
    leave_launched_process()
