"""Option types shared by the commands, declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

RecipeArg = Annotated[
    Path,
    typer.Argument(help="Recipe YAML file (see `ligertune recipes ls` for bundled ones).", show_default=False),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        "-s",
        help="Override a recipe key, value parsed as YAML: --set optim.lr=1e-4 (repeatable).",
        metavar="KEY=VALUE",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON instead of text.")
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto (CUDA when there is a GPU), cuda or cpu.")
]
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Let the model run code of its own (an auto_map in its config, a run recipe's "
        "model.trust_remote_code). Off: such a folder is refused; only for folders you trust.",
    ),
]
