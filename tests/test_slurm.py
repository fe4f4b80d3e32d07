"""What an srun task reads from SLURM's environment, set by hand (no scontrol here)."""

from __future__ import annotations

import pytest

from ligertune.errors import UserError
from ligertune.slurm import PORT_BASE, expand_nodelist, first_host, slurm_step

TWO_NODES_EIGHT_TASKS = {
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
    "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
    "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8",
}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-02],gpu7", ["node01", "node02", "gpu7"]),
    ("a1,b2", ["a1", "b2"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[1,3-4,9]", ["n1", "n3", "n4", "n9"]),
    ("rack[3,5]-n[1-2]", ["rack3-n1", "rack3-n2", "rack5-n1", "rack5-n2"]),
    ("single", ["single"]),
], ids=["range-and-name", "names", "padding-grows", "list-in-brackets", "two-brackets", "one-host"])
def test_node_lists_expand_as_scontrol_lists_them(nodelist: str, hosts: list[str]):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


def test_a_node_list_that_cannot_be_read_asks_for_master_addr():
    with pytest.raises(UserError, match="MASTER_ADDR"):
        first_host("n[a-b]")
    with pytest.raises(UserError, match="MASTER_ADDR"):
        first_host("")


def test_a_task_per_gpu_is_one_process_of_the_run():
    step = slurm_step(TWO_NODES_EIGHT_TASKS)
    assert step is not None and step.tasks_are_processes
    assert (step.nnodes, step.node_rank, step.ntasks, step.task_rank, step.gpus_on_node) == (2, 1, 16, 11, 8)
    assert step.process_environment() == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                                          "MASTER_ADDR": "gpu07", "MASTER_PORT": str(PORT_BASE + 3456)}


def test_a_task_per_node_starts_the_node_at_the_first_host_under_the_job_id():
    env = {**TWO_NODES_EIGHT_TASKS, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "1",
           "SLURM_LOCALID": "0", "MASTER_PORT": "29400"}
    step = slurm_step(env)
    assert step is not None and not step.tasks_are_processes
    assert (step.endpoint, step.job_id, step.node_rank, step.gpus_on_node) == ("gpu07:29400", "123456", 1, 8)


def test_the_step_s_own_nodes_and_tasks_come_before_the_job_s_and_master_addr_before_both():
    env = {**TWO_NODES_EIGHT_TASKS, "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_NNODES": "4",
           "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2"}
    step = slurm_step(env)
    assert (step.master_addr, step.nnodes, step.ntasks) == ("gpu03", 2, 2)
    assert slurm_step({**env, "MASTER_ADDR": "10.0.0.3"}).master_addr == "10.0.0.3"


@pytest.mark.parametrize("change", [
    {"SLURM_STEP_ID": None}, {"SLURM_STEP_ID": "batch"}, {"SLURM_STEP_ID": "4294967294"}, {"SLURM_JOB_ID": None},
], ids=["no-step", "batch-script", "batch-step-number", "no-job"])
def test_the_batch_script_itself_or_no_job_is_not_an_srun_task(change: dict):
    env = {k: v for k, v in {**TWO_NODES_EIGHT_TASKS, **change}.items() if v is not None}
    assert slurm_step(env) is None


def test_a_missing_count_names_the_variable():
    env = {k: v for k, v in TWO_NODES_EIGHT_TASKS.items() if k != "SLURM_NODEID"}
    with pytest.raises(UserError, match="SLURM_NODEID"):
        slurm_step(env)
