"""Run under `torchrun`: one step of a LoRA recipe sharded by FSDP2 with the mixed-precision policy
of CUDA, on the CPU; the dtype of every parameter's local shard, the loss and the full gradients.

    torchrun --nproc_per_node 2 tests/training/distributed_lora_dtypes.py RECIPE OUT.pt [KEY=VALUE ...]

`setup` gives FSDP on the CPU no mixed-precision policy (a CPU run keeps `model.dtype` as it is), so
this script hands it the dtypes it chooses on CUDA (`fsdp_dtypes`): everything else, the build, the
sharding and the step, is the trainer's own. Rank 0 saves {"dtypes": {name: (local shard dtype,
trainable)}, "loss": float, "grads": {name: gradient}} to OUT.pt.
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
from ligertune.training import build, forward_backward, next_batches, trainer
from ligertune.training.precision import local


def one_step(recipe_path: str, overrides: list[str], out_dir: Path) -> dict:
    """The step's loss (summed over the ranks) and gradients, and the parameters' local dtypes."""
    recipe = load_recipe(recipe_path, [*overrides, f"output.dir={out_dir}"])
    run = trainer.setup(recipe, Console(quiet=True))
    try:
        dtypes = {name: (local(p).dtype, p.requires_grad) for name, p in run.model.named_parameters()}
        totals = forward_backward(run, next_batches(run), backward=True)
        loss = full_tensor(totals["loss"]).double()
        if run.topology.distributed:
            torch.distributed.all_reduce(loss)
        grads = {name: full_tensor(p.grad).detach().double().clone()
                 for name, p in run.model.named_parameters() if p.requires_grad}
        return {"dtypes": dtypes, "loss": loss.item(), "grads": grads}
    finally:
        trainer.cleanup(run)


def as_on_cuda(recipe, device_type: str, *, sharded: bool) -> build.FsdpDtypes:
    return build.fsdp_dtypes(recipe, "cuda", sharded=sharded)


if __name__ == "__main__":
    recipe_path, out, *overrides = sys.argv[1:]
    trainer.fsdp_dtypes = as_on_cuda
    result = one_step(recipe_path, overrides, Path(out).parent / "run-two")
    if topology_from_environment().is_main:
        torch.save(result, out)
    finished_together()
    destroy_process_group()
    leave_launched_process()
