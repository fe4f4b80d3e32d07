"""Weight files checked before use: a truncated, empty, foreign or refused file is named in one line.

    check_safetensors(path)            # the header parses and every tensor lies inside the file
    state = load_torch_file(path)      # torch.load(weights_only=True); damage raises DamagedFile
    check_weight_files(folder)         # the weights a model or adapter folder would load

Each raises `DamagedFile` (a `UserError`: the command exits 2) whose message names the file and the
cause in a few words, where the loaders of `safetensors` and `torch` would raise a traceback.
A file that cannot be read for a reason of the machine (permissions, an I/O error) is an
`EnvironmentFault`.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`{"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
offsets counted from the end of the header), then the tensors' bytes. Checking it reads the header
only, never the tensors: a run's weights are checked in microseconds whatever their size.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from ligertune.errors import EnvironmentFault, UserError, first_line

SAFETENSORS_HEADER_MAX = 100_000_000
"""The largest header `safetensors` reads (bytes); a longer length is garbage, not a header."""

# Bytes per element of each safetensors dtype; the sub-byte types' sizes are left unchecked.
_ITEMSIZE: dict[str, int | None] = {
    "F4": None, "F6_E2M3": None, "F6_E3M2": None,
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "C64": 8,
    "I64": 8, "U64": 8, "F64": 8,
}
_TORCH_WEIGHTS = ("pytorch_model*.bin", "adapter_model.bin")


class DamagedFile(UserError):
    """A weights or checkpoint file that cannot be used as it is: truncated, empty, not of its
    format, or refused by the safe loader. `path` is the file, `cause` a few words on what is wrong."""

    def __init__(self, path: str | Path, cause: str):
        self.path = Path(path)
        self.cause = cause
        super().__init__(f"{path}: {cause}")


def check_safetensors(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file holds (name -> dtype, shape, data_offsets), once its header
    parses and every tensor's bytes lie inside the file, of the size its dtype and shape give.

    Raises `DamagedFile` otherwise: an empty file, one shorter than its header says (truncated),
    or one that is not a safetensors file at all.
    """
    path = Path(path)
    with _open(path) as f:
        size = f.seek(0, 2)
        if size == 0:
            raise DamagedFile(path, "damaged: the file is empty")
        if size < 8:
            raise DamagedFile(path, f"damaged: {size} bytes, too short for a safetensors header")
        f.seek(0)
        length = int.from_bytes(f.read(8), "little")
        if length > SAFETENSORS_HEADER_MAX:
            raise DamagedFile(path, "damaged or not a safetensors file: its first 8 bytes give no header length")
        if 8 + length > size:
            raise DamagedFile(path, f"damaged: truncated ({size:,} bytes, shorter than its "
                                    f"{length:,}-byte header)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise DamagedFile(path, "damaged or not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise DamagedFile(path, "damaged or not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    ranges = []
    for name, entry in header.items():
        problem = _entry_problem(entry)
        if problem:
            raise DamagedFile(path, f"damaged: tensor {name!r} {problem}")
        ranges.append(tuple(entry["data_offsets"]))
    end = 0
    for begin, stop in sorted(ranges):  # the tensors tile the data, as the safetensors loader requires
        if begin != end:
            raise DamagedFile(path, f"damaged: its tensors overlap or leave a gap at byte {8 + length + end:,}")
        end = stop
    data_size = size - 8 - length
    if end > data_size:
        raise DamagedFile(path, f"damaged: truncated ({size:,} bytes; its header describes {8 + length + end:,})")
    if end < data_size:
        raise DamagedFile(path, f"damaged: {data_size - end:,} bytes after its last tensor")
    return header


def _entry_problem(entry: Any) -> str | None:
    """Why one header entry cannot describe a tensor, or None."""
    if not isinstance(entry, dict):
        return "is not described by a JSON object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        return f"has an unknown dtype ({dtype!r})"
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        return f"has no valid shape ({shape!r})"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return f"has no valid data_offsets ({offsets!r})"
    itemsize = _ITEMSIZE[dtype]
    if itemsize is not None and offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        return (f"takes {offsets[1] - offsets[0]:,} bytes where its dtype {dtype} and shape {shape} "
                f"need {math.prod(shape) * itemsize:,}")
    return None


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_torch_file(path: str | Path, *, map_location: str | torch.device = "cpu", mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)`: tensors and plain containers, never other Python objects.

    Raises `DamagedFile` for a file that is missing, empty, truncated, not a torch file, or that
    holds objects the safe loader refuses (loading them would run code the file names). With
    `mmap`, tensors are mapped rather than read (files written by `torch.save` since torch 1.6).
    """
    path = Path(path)
    with _open(path) as f:  # a missing or unreadable file is named before torch sees it
        if f.seek(0, 2) == 0:
            raise DamagedFile(path, "damaged: the file is empty")
    try:
        with warnings.catch_warnings():  # garbage read as a pickle warns of odd protocols first
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - the unpickler raises whatever the bytes lead it to
        if _out_of_memory(err):
            raise
        raise DamagedFile(path, _torch_load_cause(err)) from None


def _torch_load_cause(err: Exception) -> str:
    """A few words on why torch.load refused a file."""
    # The safe loader names what it refused on a line of its own, e.g. "Trying to load unsupported
    # GLOBAL posix.system whose module posix is blocked."
    refused = next((line.strip().rstrip(".") for line in str(err).splitlines() if "GLOBAL" in line), None)
    if refused:
        return f"refused: it holds Python objects beyond tensors, which loading would run ({refused})"
    if isinstance(err, EOFError) or "central directory" in str(err):
        return "damaged: truncated, or not a file written by torch.save"
    return f"damaged, or not a file written by torch.save ({type(err).__name__})"


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(err)


def check_weight_files(folder: str | Path) -> None:
    """Check the weights a model or adapter folder would load: every `*.safetensors` file; without
    any, the torch files `pytorch_model*.bin` and `adapter_model.bin` (read with their tensors mapped,
    not loaded, where their format allows it)."""
    folder = Path(folder)
    safetensors = sorted(folder.glob("*.safetensors"))
    for path in safetensors:
        check_safetensors(path)
    if safetensors:
        return
    for path in sorted(p for pattern in _TORCH_WEIGHTS for p in folder.glob(pattern)):
        load_torch_file(path, mmap=_is_zip(path))


def _is_zip(path: Path) -> bool:
    """A file that `torch.save` wrote since torch 1.6 (a zip archive), which `mmap` can map."""
    with _open(path) as f:
        return f.read(4) == b"PK\x03\x04"


def _open(path: Path):
    """`path` opened for reading; a missing file is `DamagedFile`, an unreadable one an `EnvironmentFault`."""
    if path.is_dir():
        raise DamagedFile(path, "is a folder; expected a file")
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise DamagedFile(path, "missing") from None
    except OSError as err:
        raise EnvironmentFault(f"{path}: cannot read: {err.strerror or first_line(err)}") from None
