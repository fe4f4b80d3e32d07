"""Local path or hub id, and how the hub is found offline (no network: the probe is stood in for)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ligertune import hub


@pytest.mark.parametrize(
    ("name", "path"),
    [
        pytest.param("gpt2", False, id="name"),
        pytest.param("Qwen/Qwen2.5-0.5B-Instruct", False, id="owner-name"),
        pytest.param("m/missing", True, id="first-folder-exists"),
        pytest.param("other/missing", False, id="first-folder-absent"),
        pytest.param("./tok", True, id="dot-slash"),
        pytest.param("../tok", True, id="dot-dot"),
        pytest.param("~/tok", True, id="home"),
        pytest.param("/abs/tok", True, id="absolute"),
        pytest.param("a/b/c", True, id="two-slashes"),
        pytest.param("a\\b", True, id="backslash"),
        pytest.param("my model", True, id="space"),
        pytest.param("[/x]", True, id="markup"),
        pytest.param("a--b", True, id="double-dash"),
        pytest.param("a..b", True, id="double-dot"),
        pytest.param("-a", True, id="leading-dash"),
    ],
)
def test_meant_as_path(tmp_path: Path, monkeypatch, name: str, path: bool):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert hub.meant_as_path(name) is path


def test_meant_as_path_looks_beside_the_recipe_and_survives_a_removed_cwd(tmp_path: Path, monkeypatch):
    (tmp_path / "recipes" / "m").mkdir(parents=True)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    os.rmdir(gone)
    assert hub.meant_as_path("m/missing", base=tmp_path / "recipes")
    assert not hub.meant_as_path("m/missing")


def test_offline_reason(monkeypatch):
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(hub, "probe_hub", lambda: None)
    assert hub.offline_reason() is None
    monkeypatch.setattr(hub, "probe_hub", lambda: "huggingface.co")
    assert hub.offline_reason() == "no answer from huggingface.co within 2 s"
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "true")
    assert hub.offline_reason() == "TRANSFORMERS_OFFLINE is set"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline_reason() == "HF_HUB_OFFLINE is set"
