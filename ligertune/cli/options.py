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
NprocOpt = Annotated[
    Optional[int],
    typer.Option("--nproc", min=1, show_default=False,
                 help="Processes on this machine (one per GPU; gloo on the CPU), as torchrun's --nproc-per-node. "
                      "Default 1; under srun with a task per node, the node's GPUs."),
]
NnodesOpt = Annotated[
    int, typer.Option("--nnodes", min=1, help="Machines in the run, each started with its own --node-rank (as torchrun).")
]
NodeRankOpt = Annotated[
    int, typer.Option("--node-rank", min=0, help="This machine's place among --nnodes: 0 serves the rendezvous.")
]
RdzvEndpointOpt = Annotated[
    Optional[str],
    typer.Option("--rdzv-endpoint", metavar="HOST:PORT", show_default=False,
                 help="Where the machines meet: an address of node 0 that every node reaches, and a free port."),
]
RdzvIdOpt = Annotated[
    Optional[str],
    typer.Option("--rdzv-id", show_default=False, help="A name for the run shared by its machines (default: ligertune)."),
]
RdzvTimeoutOpt = Annotated[
    int,
    typer.Option("--rdzv-timeout", min=1, metavar="SECONDS",
                 help="How long a machine waits for the others to join before it gives up with one line naming "
                      "the missing one."),
]
