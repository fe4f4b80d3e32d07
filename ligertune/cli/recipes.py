"""`ligertune recipes ls | show NAME | cp NAME FILE`: the bundled recipes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from ligertune.cli.guard import guarded
from ligertune.errors import UserError
from ligertune.recipe import bundled_recipe, bundled_recipes, recipe_description

app = typer.Typer(help="List, show and copy the bundled recipes.", no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(help="Bundled recipe name, as `ligertune recipes ls` lists it.")]


@app.command("ls")
@guarded
def ls() -> None:
    """List the bundled recipes.

    Example: [bold]ligertune recipes ls[/]
    """
    table = Table(title="bundled recipes", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description")
    for name, path in bundled_recipes().items():
        table.add_row(name, recipe_description(path))
    Console().print(table)


@app.command("show")
@guarded
def show(name: NameArg) -> None:
    """Print a bundled recipe.

    Example: [bold]ligertune recipes show quickstart[/]
    """
    path = bundled_recipe(name)
    Console().print(Syntax(path.read_text(encoding="utf-8"), "yaml", background_color="default"))


@app.command("cp")
@guarded
def cp(
    name: NameArg,
    file: Annotated[Path, typer.Argument(help="Where to write the copy: a file, or a folder to copy it into.")],
    force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists.")] = False,
) -> None:
    """Copy a bundled recipe to FILE to edit it; missing folders on the way are created.

    Example: [bold]ligertune recipes cp quickstart my-recipe.yaml[/]
    """
    path = bundled_recipe(name)
    target = file / path.name if file.is_dir() else file
    if target.is_dir():
        raise UserError(f"{target} is a folder; give a file name for the copy")
    if target.exists() and not force:
        raise UserError(f"{target} exists; pass --force to replace it")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    except OSError as err:
        raise UserError(f"{target}: cannot write the copy: {err.strerror or err}") from None
    Console().print(f"copied {name} to {target}", markup=False)
    if any(line.strip().startswith(("path:", "eval_path:", "tokenizer:")) for line in path.read_text().splitlines()):
        Console().print("[dim]relative data and tokenizer paths resolve next to the recipe file: adjust them if needed[/]")
