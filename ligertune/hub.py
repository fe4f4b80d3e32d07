"""Local path or hub id, and whether the Hugging Face hub can be reached.

A recipe names its model, tokenizer and data by a local path or a hub id (`owner/name`), and the
two can look alike: `models/tiny` is a valid hub id. A name is a local path when it exists, or when
the user clearly meant a path: it starts with `/`, `./`, `../` or `~`, has a backslash or more than
one `/`, is no valid hub id, or its first component exists here (`m/missing` next to a folder `m`).
Anything else goes to the hub, which costs a minute of retries when the hub cannot be reached: so
the loaders first ask `offline_reason()`, which honours `HF_HUB_OFFLINE` / `TRANSFORMERS_OFFLINE`
and otherwise tries one TCP connection to the hub (or the HTTPS proxy) for at most 2 seconds.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

# huggingface_hub's own rule for repo ids (`validate_repo_id`): `name` or `owner/name`, word
# characters, `-` and `.`, at most 96 characters for the name, no `--` or `..`.
_HUB_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_TIMEOUT_S = 2.0


def is_hub_id(name: str) -> bool:
    """`name` has the shape of a hub repository id (`gpt2`, `Qwen/Qwen2.5-0.5B-Instruct`)."""
    return bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name


def meant_as_path(name: str, base: Path | None = None) -> bool:
    """`name` is a local path, existing or not, rather than a hub id (see the module docstring).

    Relative paths are looked up in the current directory, and in `base` when given.
    """
    if name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.count("/") > 1:
        return True
    if not is_hub_id(name):
        return True
    roots = [base] if base is not None else []
    try:
        roots.append(Path.cwd())
    except OSError:  # the current directory was removed
        pass
    return any(found_in(root, Path(name)) for root in roots)


def found_in(root: Path, path: Path) -> bool:
    """The relative `path` exists under `root`, or its first component does (`data/missing.jsonl`
    beside a folder `data`): either way it is meant there."""
    return (root / path).exists() or (len(path.parts) > 1 and (root / path.parts[0]).exists())


def offline_by_env() -> str | None:
    """The variable that puts the hub offline (`HF_HUB_OFFLINE=1`), if one is set."""
    for variable in _OFFLINE_VARIABLES:
        if os.environ.get(variable, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return variable
    return None


def offline_reason() -> str | None:
    """Why the hub cannot be reached (`HF_HUB_OFFLINE is set`, `no answer from huggingface.co ...`),
    or None when it can."""
    variable = offline_by_env()
    if variable is not None:
        return f"{variable} is set"
    host = probe_hub()
    return None if host is None else f"no answer from {host} within {PROBE_TIMEOUT_S:g} s"


@functools.cache
def probe_hub() -> str | None:
    """None when a TCP connection to the hub endpoint (or the HTTPS proxy in the way) opens within
    `PROBE_TIMEOUT_S`; else the host that did not answer. Asked once per process."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), None)
    target = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else endpoint)
    host = target.hostname or "huggingface.co"
    try:
        port = target.port or (443 if target.scheme == "https" else 80)
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError):
        return host
    return None
