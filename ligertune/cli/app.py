"""The `ligertune` app: one command per module, each wrapped so that known errors print one line."""

from __future__ import annotations

import logging
import os
from typing import Annotated

import typer

from ligertune.cli.guard import guarded

app = typer.Typer(
    name="ligertune",
    help="Fine-tune causal language models on packed multi-turn chat data with Triton kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full traceback of errors (also LIGERTUNE_DEBUG=1).")
    ] = False,
) -> None:
    if debug:
        os.environ["LIGERTUNE_DEBUG"] = "1"


def _register() -> None:
    from ligertune.cli import bench, chat, data, env, merge, plot, recipes, train, validate, verify_loss

    app.command("train")(guarded(train.train, uses_torch=True))
    app.command("validate")(guarded(validate.validate, uses_torch=True))
    app.command("data")(guarded(data.data, uses_torch=True))
    app.command("verify-loss")(guarded(verify_loss.verify_loss, uses_torch=True))
    app.command("merge")(guarded(merge.merge, uses_torch=True))
    app.command("chat")(guarded(chat.chat, uses_torch=True))
    app.command("plot")(guarded(plot.plot, uses_torch=True))
    app.add_typer(bench.app, name="bench")
    app.add_typer(recipes.app, name="recipes")
    app.command("env")(guarded(env.env, uses_torch=True))


_register()
# peft imports bitsandbytes whenever it is installed, and on a CPU with avx512-bf16 bitsandbytes warns
# at import about an optional kernel that ligertune never runs (see
# `ligertune.models.quantize.keep_cpu_layout`): silenced here, before any command imports peft.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
