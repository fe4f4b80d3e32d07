"""`ligertune.weights`: every kind of damage to a weights file is named, with its path, before loading."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ligertune.errors import UserError
from ligertune.weights import DamagedFile, check_safetensors, check_weight_files, load_torch_file

TENSORS = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
           "empty": torch.zeros(0)}


@pytest.fixture
def good_safetensors(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, path)
    return path


@pytest.fixture
def good_torch_file(tmp_path: Path) -> Path:
    path = tmp_path / "state.pt"
    torch.save({"step": 3, "weights": dict(TENSORS)}, path)
    return path


def header_length(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def write_header(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


# --------------------------------------------------------------------------------------------------
# safetensors


def test_a_good_safetensors_file_passes_and_lists_its_tensors(good_safetensors: Path):
    tensors = check_safetensors(good_safetensors)
    assert {name: (t["dtype"], t["shape"]) for name, t in tensors.items()} == {
        "w": ("F32", [3, 4]), "b": ("BF16", [5]), "empty": ("F32", [0])}
    assert load_file(good_safetensors).keys() == tensors.keys()  # what passes, loads


def cut(path: Path, size: int) -> Path:
    path.write_bytes(path.read_bytes()[:size])
    return path


@pytest.mark.parametrize("damage, cause", [
    pytest.param(lambda p: cut(p, 0), "damaged: the file is empty", id="empty"),
    pytest.param(lambda p: cut(p, 5), "damaged: 5 bytes, too short for a safetensors header", id="5-bytes"),
    pytest.param(lambda p: cut(p, 8 + header_length(p) // 2), "shorter than its", id="cut-in-header"),
    pytest.param(lambda p: cut(p, p.stat().st_size - 1), "damaged: truncated", id="cut-in-last-tensor"),
    pytest.param(lambda p: cut(p, 8 + header_length(p)), "damaged: truncated", id="header-only"),
    pytest.param(lambda p: p.write_bytes(p.read_bytes() + b"\0" * 7), "7 bytes after its last tensor",
                 id="trailing-bytes"),
    pytest.param(lambda p: p.write_bytes(os.urandom(4096)), "not a safetensors file", id="random-bytes"),
    pytest.param(lambda p: p.write_bytes(b"\x10" + b"\0" * 7 + b"not json at all!"), "its header is not JSON",
                 id="header-not-json"),
    pytest.param(lambda p: write_header(p, [1, 2], b""), "not a JSON object", id="header-a-list"),
    pytest.param(lambda p: write_header(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
                 "tensor 'w' takes 4 bytes where its dtype F32 and shape [2] need 8", id="size-mismatch"),
    pytest.param(lambda p: write_header(p, {"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
                 "unknown dtype ('F99')", id="unknown-dtype"),
    pytest.param(lambda p: write_header(p, {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
                 "no valid shape", id="negative-shape"),
    pytest.param(lambda p: write_header(p, {"w": {"dtype": "U8", "shape": [2], "data_offsets": [3, 1]}}, b"\0" * 4),
                 "no valid data_offsets", id="reversed-offsets"),
    pytest.param(lambda p: write_header(p, {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                                            "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3),
                 "overlap or leave a gap", id="overlapping-tensors"),
])
def test_damaged_safetensors_are_named_with_their_cause(good_safetensors: Path, damage, cause):
    damage(good_safetensors)
    with pytest.raises(DamagedFile) as caught:
        check_safetensors(good_safetensors)
    assert str(caught.value).startswith(f"{good_safetensors}: ")
    assert cause in str(caught.value)
    assert caught.value.path == good_safetensors and caught.value.cause in str(caught.value)
    assert "\n" not in str(caught.value)
    with pytest.raises(Exception):  # what passes is what loads: each of these fails the real loader too
        load_file(good_safetensors)


def test_missing_and_folder(tmp_path: Path):
    with pytest.raises(DamagedFile, match="absent.safetensors: missing"):
        check_safetensors(tmp_path / "absent.safetensors")
    with pytest.raises(DamagedFile, match="is a folder"):
        load_torch_file(tmp_path)


def test_damaged_file_is_a_user_error():
    assert issubclass(DamagedFile, UserError)


# --------------------------------------------------------------------------------------------------
# torch files


def test_a_good_torch_file_loads(good_torch_file: Path):
    state = load_torch_file(good_torch_file)
    assert state["step"] == 3 and torch.equal(state["weights"]["w"], TENSORS["w"])
    mapped = load_torch_file(good_torch_file, mmap=True)
    assert torch.equal(mapped["weights"]["b"], TENSORS["b"])


CALLS: list[str] = []


def record_call(text: str) -> None:
    CALLS.append(text)


class Payload:
    """What a hostile pickle holds: an object whose loading calls a function (here a harmless one)."""

    def __reduce__(self):
        return (record_call, ("loaded",))


@pytest.mark.parametrize("damage, cause", [
    pytest.param(lambda p: cut(p, 0), "damaged: the file is empty", id="empty"),
    pytest.param(lambda p: cut(p, p.stat().st_size // 2), "damaged: truncated", id="truncated"),
    pytest.param(lambda p: cut(p, 3), "damaged", id="3-bytes"),
    pytest.param(lambda p: p.write_bytes(os.urandom(2048)), "damaged, or not a file written by torch.save",
                 id="random-bytes"),
    pytest.param(lambda p: p.write_text("step: 3\n"), "damaged, or not a file written by torch.save", id="text"),
    pytest.param(lambda p: torch.save({"step": Payload()}, p), "refused: it holds Python objects beyond tensors",
                 id="pickled-object"),
])
@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_damaged_torch_files_are_named_with_their_cause(good_torch_file: Path, damage, cause, mmap):
    damage(good_torch_file)
    with pytest.raises(DamagedFile) as caught:
        load_torch_file(good_torch_file, mmap=mmap)
    assert str(caught.value).startswith(f"{good_torch_file}: ")
    if not (mmap and cause.startswith("damaged")):  # mmap refuses any file that is not a zip archive alike
        assert cause in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_refused_object_is_named_and_never_run(good_torch_file: Path):
    torch.save({"step": Payload()}, good_torch_file)
    CALLS.clear()
    with pytest.raises(DamagedFile, match="GLOBAL .*record_call"):
        load_torch_file(good_torch_file)
    assert CALLS == []
    torch.load(good_torch_file, weights_only=False)  # the payload works: the refusal above is what stopped it
    assert CALLS == ["loaded"]


# --------------------------------------------------------------------------------------------------
# a model folder


def test_folder_checks_its_safetensors_and_without_them_its_torch_weights(tmp_path: Path):
    save_file(TENSORS, tmp_path / "model-00001-of-00002.safetensors")
    save_file(TENSORS, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"ignored: the safetensors files are what loads")
    check_weight_files(tmp_path)
    cut(tmp_path / "model-00002-of-00002.safetensors", 100)
    with pytest.raises(DamagedFile, match="model-00002-of-00002.safetensors: damaged"):
        check_weight_files(tmp_path)

    adapters = tmp_path / "adapters"
    adapters.mkdir()
    torch.save(dict(TENSORS), adapters / "adapter_model.bin")
    check_weight_files(adapters)
    cut(adapters / "adapter_model.bin", 50)
    with pytest.raises(DamagedFile, match="adapter_model.bin: damaged: truncated"):
        check_weight_files(adapters)
