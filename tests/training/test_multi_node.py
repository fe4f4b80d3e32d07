"""Several machines, tried on one: two "nodes" on localhost meet at torchrun's rendezvous (gloo, one
process each) and train as one process with twice the accumulation; a node that never joins is one
line naming the rendezvous and the missing node; SLURM's environment, set by hand, starts the same."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_runs import free_port, ligertune, start_ligertune, train_here, train_records
from safetensors.torch import load_file
from tiny_recipe import write_recipe

from ligertune.numerics import relative_error


def test_two_nodes_on_localhost_train_as_one_process_with_twice_the_accumulation(tmp_path: Path):
    # A step of 2 packs: 1 a node, or 2 accumulated by one process.
    path = write_recipe(tmp_path, train={"max_steps": 3, "micro_batch_size": 1, "grad_accum_steps": 1,
                                         "eval_every": None}, distributed={"strategy": "fsdp"})
    one, two = tmp_path / "one", tmp_path / "two"
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_ligertune("train", str(path), "-o", str(two), "--nnodes", "2", "--node-rank", str(rank),
                             "--rdzv-endpoint", endpoint, "--nproc", "1", "--rdzv-timeout", "120")
             for rank in (0, 1)]
    train_here(path, "-o", one, "--set", "train.grad_accum_steps=2")
    for node in nodes:
        out, err = node.communicate(timeout=240)
        assert node.returncode == 0, out[-2000:] + err[-3000:]

    straight, split = train_records(one), train_records(two)
    assert [r["step"] for r in split] == [1, 2, 3]
    for mine, reference in zip(split, straight):
        assert mine["tokens"] == reference["tokens"] and mine["lr"] == reference["lr"], mine["step"]
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5), mine["step"]
    expected, weights = (load_file(run / "final" / "model.safetensors") for run in (one, two))
    assert weights.keys() == expected.keys()
    for name, weight in weights.items():
        assert relative_error(weight, expected[name]) < 1e-4, name


def test_a_node_that_never_joins_is_one_line_naming_the_rendezvous_and_the_node(tmp_path: Path):
    path = write_recipe(tmp_path, train={"eval_every": None})
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = ligertune("train", str(path), "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                       "--rdzv-timeout", "3", timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"rendezvous {endpoint}" in lines[0] and "node 1 did not join within 3 s" in lines[0], lines[0]
    assert time.monotonic() - started < 60
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_srun_with_a_task_per_node_starts_its_node_of_the_rendezvous(tmp_path: Path):
    """Node 1 of a SLURM step of 2 nodes (the variables srun sets, by hand): it waits for node 0 at
    the first host of the node list, on the port of the job (MASTER_PORT here), under the job's id."""
    path = write_recipe(tmp_path, train={"eval_every": None})
    port = free_port()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1",
             "SLURM_JOB_NODELIST": "localhost,node7", "MASTER_PORT": str(port)}
    result = ligertune("train", str(path), "--rdzv-timeout", "3", env=slurm, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"rendezvous localhost:{port} (id 4242), 2 nodes: node 0 did not serve it within 3 s" in lines[0], lines[0]
