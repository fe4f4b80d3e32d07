"""`ligertune merge`: a LoRA run's adapters merged into its base, as one standalone model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.text import Text

from ligertune.cli.guard import print_error
from ligertune.cli.options import DeviceOpt, JsonOpt, TrustRemoteCodeOpt


def merge(
    run: Annotated[
        Path, typer.Argument(help="A LoRA run, its final/ or one of its checkpoints/step-N.",
                             show_default=False)
    ],
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Where to write the merged model "
                                     "(default: RUN/merged; RUN/merged-step-N for a checkpoint).",
                                     show_default=False)
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="Dtype of the written weights: bf16, fp16, fp32, or auto (the "
                          "base model's own).")
    ] = "auto",
    device: DeviceOpt = "auto",
    json_: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Merge a run's LoRA adapters into its base model and write a standalone Hugging Face model.

    The folder holds safetensors weights, the tokenizer and its chat template, and loads with
    `from_pretrained` alone. Before it is moved into place it is loaded back and its logits are
    checked against base + adapters.

    Example: [bold]ligertune merge runs/quickstart-lora --dtype bf16[/]
    """
    import json

    import transformers

    from ligertune.merge import MergeCheckError, merge_adapters

    transformers.utils.logging.disable_progress_bar()
    try:
        report = merge_adapters(run, output=output, dtype=dtype, device=device,
                                trust_remote_code=trust_remote_code)
    except MergeCheckError as err:
        print_error(err)
        raise typer.Exit(1) from None
    if json_:
        print(json.dumps(report.to_dict(), indent=2))
        return
    # Paths are printed as Text: a folder named `x[/y]` is not rich markup.
    console = Console(highlight=False, soft_wrap=True)
    ok = ("ok", "green")
    verb = "replaced" if report.replaced else "wrote"
    console.print(Text(f"merged the LoRA adapters of {report.source.model_dir} into their base model"))
    if report.dequantized:
        console.print(Text(f"the base trained in {report.dequantized}: its dequantized weights, those the "
                           "adapters were trained over, were merged"))
    console.print(Text.assemble(ok, f" {verb} {report.output_dir} "
                                f"({report.dtype_name} safetensors, tokenizer and chat template)"))
    console.print(Text.assemble(
        ok, f" loaded back, its logits on {report.tokens_checked} tokens match base + adapters "
        f"within {report.rel_error:.1e} relative (tolerance {report.tolerance:.0e}; the adapters "
        f"themselves move them by {report.adapters_effect:.1e})"
    ))
    console.print(Text(f"use it: ligertune chat {report.output_dir}, or "
                       f"AutoModelForCausalLM.from_pretrained(\"{report.output_dir}\")", style="dim"))
