"""`ligertune train`: run a recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from ligertune.cli.options import RecipeArg, SetOpt


def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    output_dir: Annotated[
        Optional[Path], typer.Option("--output-dir", "-o", help="Write the run here (overrides output.dir).")
    ] = None,
    max_steps: Annotated[
        Optional[int], typer.Option("--max-steps", min=1, help="Stop after N optimizer steps (overrides train.max_steps).")
    ] = None,
) -> None:
    """Fine-tune the recipe's model on its data.

    Example: [bold]ligertune train recipes/quickstart.yaml --set optim.lr=1e-3 --max-steps 50[/]
    """
    from ligertune.recipe import load_recipe
    from ligertune.training import train as run_training

    overrides = list(set_ or [])
    if output_dir is not None:
        overrides.append(f"output.dir={output_dir}")
    if max_steps is not None:
        overrides.append(f"train.max_steps={max_steps}")
    run_training(load_recipe(recipe, overrides), console=Console())
