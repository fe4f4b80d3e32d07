"""Where a run trains, as its first line says it."""

from __future__ import annotations

import pytest
import torch

from ligertune.devices import describe_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs of one name."""

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")

    return visible


def test_the_cpu_is_named_as_it_is():
    assert describe_device(torch.device("cpu")) == "cpu"


def test_one_process_on_one_gpu_names_it(gpus):
    gpus(1)
    assert describe_device(torch.device("cuda")) == "cuda (NVIDIA H200)"


def test_one_process_among_several_gpus_says_how_to_use_them_all(gpus):
    gpus(8)
    assert describe_device(torch.device("cuda")) == (
        "cuda (NVIDIA H200: 1 of the 8 GPUs visible; --nproc 8 trains on all of them)")


def test_a_run_of_several_processes_counts_them(gpus):
    gpus(8)
    assert describe_device(torch.device("cuda", 3), world_size=8) == "cuda (NVIDIA H200, 8 processes)"
