"""Run under `torchrun`: a whole run with the loss of one step made 20x larger on every process.

    torchrun --nproc_per_node 2 tests/training/distributed_spike.py RECIPE STEP [KEY=VALUE ...]
"""

from __future__ import annotations

import sys

from cli_runs import leave_launched_process
from rich.console import Console
from test_spikes import spike_at

from ligertune.distributed import destroy_process_group, finished_together
from ligertune.recipe import load_recipe
from ligertune.training import cleanup, setup, train_loop

if __name__ == "__main__":
    recipe_path, step, *overrides = sys.argv[1:]
    run = setup(load_recipe(recipe_path, overrides), Console(quiet=True))
    spike_at(run, {int(step)})
    try:
        train_loop(run)
        finished_together()
    finally:
        cleanup(run)
        destroy_process_group()
    leave_launched_process()
