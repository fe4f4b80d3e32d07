"""`ligertune validate`: check a recipe, its data and its model without training."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from ligertune.cli.options import RecipeArg, SetOpt


def validate(recipe: RecipeArg, set_: SetOpt = None) -> None:
    """Check a recipe, its data, tokenizer and model without training.

    Runs every check `ligertune train` runs before its first step: the schema, the output folder,
    that the data files are readable and leave trainable conversations, that the tokenizer and the
    model resolve, that the LoRA adapters fit the model, and that a quantized base can train (LoRA,
    one process, bitsandbytes installed); no weights are loaded. Warns, without failing, of optimizer
    settings that run but probably not as meant: a Lion learning rate of AdamW's size, 16-bit weights
    or AdamW states without master weights (docs/optim.md).

    Example: [bold]ligertune validate recipes/quickstart.yaml --set data.max_seq_len=512[/]
    """
    from pathlib import Path

    from ligertune.distributed import topology_from_environment
    from ligertune.models import check_model, load_tokenizer
    from ligertune.recipe import load_recipe
    from ligertune.training.build import (
        build_data,
        check_model_skeleton,
        optimizer_warnings,
        schedule_warnings,
        total_steps,
        trainable_dtypes,
    )
    from ligertune.training.run_dir import check_output_dir

    console = Console()
    loaded = load_recipe(recipe, list(set_ or []))
    # Paths and names are the user's: escaped, so that brackets in them print as written.
    console.print(f"[green]ok[/] recipe {escape(str(recipe))}")
    for warning in optimizer_warnings(loaded, trainable_dtypes(loaded)):
        console.print(f"[yellow]warning[/] {escape(warning)}")
    tokenizer = load_tokenizer(loaded.model)
    console.print(f"[green]ok[/] tokenizer {type(tokenizer).__name__}, {len(tokenizer)} tokens")
    console.print(f"[green]ok[/] model {escape(check_model(loaded.model, vocab_size=len(tokenizer)))}")
    check_model_skeleton(loaded, vocab_size=len(tokenizer))
    if loaded.lora is not None:
        console.print(f"[green]ok[/] lora: r={loaded.lora.r} on {escape(str(loaded.lora.target_modules))}")
    if loaded.model.quantization is not None:
        import bitsandbytes  # check_model_skeleton found it

        console.print(f"[green]ok[/] quantization: the decoder's linear layers in {loaded.model.quantization} "
                      f"(bitsandbytes {bitsandbytes.__version__})")
    data = build_data(loaded, tokenizer, show_progress=False)
    stats = data.prepared.stats
    units = loaded.objective.units  # conversations (sft, distill, medusa), examples (kto) or pairs
    console.print(
        f"[green]ok[/] data: {len(data.train_examples)} train and {len(data.prepared.eval)} eval "
        f"{units}, {len(data.train_packs)} packs ({stats.summary()})"
    )
    steps = total_steps(loaded.train, len(data.train_packs), topology_from_environment().world_size)
    for warning in [*data.warnings, *schedule_warnings(loaded.optim, steps)]:
        console.print(f"[yellow]warning[/] {escape(warning)}")
    check_output_dir(Path(loaded.output.dir), resume=False, overwrite=loaded.output.overwrite)
    console.print(f"[green]ok[/] output {escape(loaded.output.dir)}")
