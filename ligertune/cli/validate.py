"""`ligertune validate`: check a recipe, its data and its model without training."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from ligertune.cli.options import RecipeArg, SetOpt


def validate(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Check a recipe, its data, tokenizer and model without training.

    Checks the schema, that the data files are readable and well-formed, and that the tokenizer
    and the model resolve (no weights are loaded).

    Example: [bold]ligertune validate recipes/quickstart.yaml --set data.max_seq_len=512[/]
    """
    from ligertune.data import prepare_data
    from ligertune.models import check_model, load_tokenizer
    from ligertune.recipe import load_recipe

    console = Console()
    loaded = load_recipe(recipe, list(set_ or []))
    # Paths and names are the user's: escaped, so that brackets in them print as written.
    console.print(f"[green]ok[/] recipe {escape(str(recipe))}")
    tokenizer = load_tokenizer(loaded.model)
    console.print(f"[green]ok[/] tokenizer {type(tokenizer).__name__}, {len(tokenizer)} tokens")
    console.print(f"[green]ok[/] model {escape(check_model(loaded.model, vocab_size=len(tokenizer)))}")
    data = prepare_data(loaded.data, tokenizer, seed=loaded.train.seed, show_progress=False)
    stats = data.stats
    console.print(
        f"[green]ok[/] data: {len(data.train)} train and {len(data.eval)} eval conversations "
        f"({stats.summary()})"
    )
