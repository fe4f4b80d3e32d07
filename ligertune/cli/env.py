"""`ligertune env`: versions, device, and which kernel path runs."""

from __future__ import annotations

import importlib.metadata
import json
import platform

from rich.console import Console
from rich.table import Table

from ligertune.cli.options import JsonOpt

PACKAGES = ("ligertune", "torch", "triton", "transformers", "peft", "tokenizers", "bitsandbytes", "torchao",
            "liger-kernel", "cut-cross-entropy")


def environment() -> dict[str, str]:
    import torch

    from ligertune.kernels import active_path

    info = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    if torch.cuda.is_available():
        info["device"] = f"cuda: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        info["device"] = f"cpu ({torch.get_num_threads()} threads)"
    try:
        info["kernel path"] = active_path()
    except ValueError as err:
        info["kernel path"] = f"invalid: {err}"
    from ligertune.models import PATCH_TABLE

    info["patched model types"] = ", ".join(sorted(PATCH_TABLE))
    return info


def env(json_: JsonOpt = False) -> None:
    """Show versions, the GPU (or CPU), and which kernel path runs: triton or reference.

    Example: [bold]LIGERTUNE_KERNELS=reference ligertune env --json[/]
    """
    info = environment()
    if json_:
        print(json.dumps(info, indent=2))
        return
    table = Table(show_header=False, title="ligertune environment", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in info.items():
        table.add_row(key, value)
    Console().print(table)
