"""Other libraries that `ligertune bench` measures against, imported only when asked for.

Liger-Kernel (`liger-kernel`), Cut Cross-Entropy (`cut-cross-entropy`), for the Lion step
lion-pytorch (`lion-pytorch`) and, for preference recipes' steps, TRL (`trl`) are optional: a peer
that is not importable is reported as "not installed", never an error. Rows that run Triton kernels
need CUDA and are reported as skipped on a CPU; lion-pytorch's plain and foreach optimizers run
there too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

from ligertune.errors import first_line

PEERS = {
    "liger": ("liger-kernel", "liger_kernel"),
    "cce": ("cut-cross-entropy", "cut_cross_entropy"),
    "lion": ("lion-pytorch", "lion_pytorch"),
    "trl": ("trl", "trl"),
}
"""Peer key -> (distribution name, import name)."""

NOT_INSTALLED = "not installed"


@dataclass
class Peer:
    """One peer library: its distribution name and version, or why it cannot run."""

    key: str
    distribution: str
    version: str | None
    unavailable: str | None

    @property
    def available(self) -> bool:
        return self.unavailable is None


def find_peer(key: str) -> Peer:
    """Whether the peer imports, and its version; the import error's first line when it is broken."""
    distribution, module_name = PEERS[key]
    try:
        importlib.import_module(module_name)
    except ImportError as err:
        missing = isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == module_name
        reason = NOT_INSTALLED if missing else f"import failed: {first_line(err)}"
        return Peer(key, distribution, None, reason)
    except Exception as err:  # a peer whose import breaks (e.g. a Triton version it does not know)
        return Peer(key, distribution, None, f"import failed: {type(err).__name__}: {err}")
    return Peer(key, distribution, package_version(distribution), None)


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of ligertune, its stack and the peers, as reported in every bench result."""
    import ligertune

    names = ("torch", "triton", "transformers", "bitsandbytes", "torchao", *(d for d, _ in PEERS.values()))
    # ligertune's own version from the package: a source checkout need not be installed.
    return {"ligertune": ligertune.__version__, **{name: package_version(name) for name in names}}
