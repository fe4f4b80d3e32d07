"""Run under `torchrun`: a preference step's loss and gradients, and the held-out metrics, after one
update (so that the policy is off the reference by more than rounding, and every reward is signed).

    torchrun --nproc_per_node 2 tests/training/distributed_preference.py RECIPE OUT.pt [KEY=VALUE ...]

Rank 0 saves {"loss", "grads" (gathered whole from the shards), "eval" (the held-out metrics),
"reference" (every pack's reference log-probabilities)} to OUT.pt, for the test to compare with
one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from cli_runs import leave_launched_process
from rich.console import Console

from ligertune.distributed import (
    all_reduce_sum,
    destroy_process_group,
    finished_together,
    full_tensor,
    topology_from_environment,
)
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, evaluate, forward_backward, next_batches, setup, train_step


def preference_step(recipe_path: str, overrides: list[str], out_dir: Path) -> dict:
    run = setup(load_recipe(recipe_path, [*overrides, f"output.dir={out_dir}"]), Console(quiet=True))
    try:
        train_step(run, next_batches(run))
        totals = forward_backward(run, next_batches(run), backward=True)
        names = run.objective.sums
        summed = all_reduce_sum(torch.stack([totals[k].double() for k in names])).tolist()
        grads = {name: full_tensor(p.grad).detach().double().clone()
                 for name, p in run.model.named_parameters() if p.requires_grad}
        return {"metrics": run.objective.summarize(dict(zip(names, summed))), "grads": grads,
                "eval": evaluate(run),
                "reference": [p.reference_logps for p in [*run.data.train_packs, *run.data.eval_packs]]}
    finally:
        cleanup(run)


if __name__ == "__main__":
    recipe_path, out, *overrides = sys.argv[1:]
    result = preference_step(recipe_path, overrides, Path(out).parent / "runs")
    if topology_from_environment().is_main:
        torch.save(result, out)
    finished_together()
    destroy_process_group()
    leave_launched_process()
