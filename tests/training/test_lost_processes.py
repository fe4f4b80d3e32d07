"""A process or a node that dies during a run: every node left prints one line naming the run and
the lost rank, exits 1 without a traceback, leaves the last checkpoint complete, and `--resume` on
one process continues the run to its end (gloo on the CPU; the killed process gets SIGKILL once the
first checkpoint is published)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_runs import free_port, process_of_rank, start_ligertune, train_here, train_records
from tiny_recipe import write_recipe

from ligertune.distributed import describe_ranks
from ligertune.training.checkpoint import latest_checkpoint, verify_checkpoint

STEPS = 12


def kill_rank_1_after_the_first_checkpoint(run_dir: Path, launchers: list[subprocess.Popen]) -> list[tuple]:
    """SIGKILL rank 1 once `latest` appears; each launcher's (exit code, stdout, stderr, seconds from
    the kill to its exit)."""
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "latest").is_symlink():
            assert time.monotonic() < deadline and all(p.poll() is None for p in launchers), "no checkpoint"
            time.sleep(0.1)
        os.kill(process_of_rank(launchers[-1], 1), signal.SIGKILL)
        killed, ended = time.monotonic(), []
        for launcher in launchers:
            out, err = launcher.communicate(timeout=120)
            ended.append((launcher.returncode, out, err, time.monotonic() - killed))
        return ended
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()


def assert_one_line(code: int, out: str, err: str, seconds: float, expected: str) -> str:
    assert code == 1, out[-2000:] + err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in out + err
    assert re.search(expected, lines[0]), lines[0]
    assert seconds < 60
    return lines[0]


def assert_resumes_on_one_process(recipe: Path, run_dir: Path, line: str) -> None:
    """`latest` is a complete checkpoint, the line names it, and the resume line's command, less its
    launch options, continues the run on one process to its last step."""
    latest = latest_checkpoint(run_dir)
    assert latest is not None and not (run_dir / "final").exists()
    verify_checkpoint(latest)
    assert f"the last checkpoint {latest} is intact; resume with: ligertune train {recipe}" in line, line
    train_here(recipe, "--resume")
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "final" / "model.safetensors").is_file()


def recipe_of(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, train={"max_steps": STEPS, "micro_batch_size": 1, "grad_accum_steps": 1,
                                         "eval_every": None, "save_every": 2})


def test_a_process_killed_mid_run_is_one_line_and_one_process_resumes_the_run(tmp_path: Path):
    path = recipe_of(tmp_path)
    [(code, out, err, seconds)] = kill_rank_1_after_the_first_checkpoint(
        tmp_path / "run", [start_ligertune("train", str(path), "--nproc", "2")])
    line = assert_one_line(code, out, err, seconds,
                           r"^error: run of 2 processes: lost rank 1: killed by SIGKILL \(pid \d+\); ")
    assert line.endswith("--nproc 2 --resume"), line
    assert_resumes_on_one_process(path, tmp_path / "run", line)


def test_a_node_lost_mid_run_is_one_line_on_each_node_and_the_node_left_resumes_it(tmp_path: Path):
    path = recipe_of(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    # On a machine with GPUs each "node" gets one of its own, as on two machines (NCCL refuses two
    # ranks on one GPU).
    gpus = [{"CUDA_VISIBLE_DEVICES": str(rank)} if torch.cuda.device_count() > 1 else None for rank in (0, 1)]
    nodes = [start_ligertune("train", str(path), "--nnodes", "2", "--node-rank", str(rank),
                             "--rdzv-endpoint", endpoint, "--nproc", "1", "--rdzv-timeout", "120", env=gpus[rank])
             for rank in (0, 1)]
    left, lost = kill_rank_1_after_the_first_checkpoint(tmp_path / "run", nodes)
    where = re.escape(f"error: rendezvous {endpoint} (id ligertune), 2 nodes: lost rank 1 (node 1): ")
    line = assert_one_line(*left, f"^{where}stopped answering; ")
    assert_one_line(*lost, f"^{where}killed by SIGKILL \\(pid \\d+\\); ")
    assert_resumes_on_one_process(path, tmp_path / "run", line)


@pytest.mark.parametrize("ranks, world_size, per_node, expected", [
    ([1], 2, 2, "rank 1"),
    ([1, 3], 4, 4, "ranks 1, 3"),
    ([1], 2, 1, "rank 1 (node 1)"),
    ([9, 10], 16, 8, "ranks 9, 10 (node 1)"),
    ([8, 9, 10, 11, 12, 13, 14, 15], 16, 8, "node 1 (ranks 8-15)"),
    ([3, 8, 9, 10, 11, 12, 13, 14, 15], 16, 8, "rank 3 (node 0), node 1 (ranks 8-15)"),
], ids=["one-node", "one-node-two", "two-nodes-of-one", "part-of-a-node", "a-whole-node", "mixed"])
def test_lost_ranks_are_named_with_their_node(ranks, world_size, per_node, expected):
    assert describe_ranks(ranks, world_size=world_size, local_world_size=per_node) == expected
