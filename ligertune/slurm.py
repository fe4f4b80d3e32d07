"""What a task started by `srun` learns from SLURM's environment: the nodes, its place among them,
and where the run's processes meet.

Two ways to start a run under SLURM, both with no flags of ours:

    srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 ligertune train RECIPE   # a task per node
    srun --nodes 2 --ntasks-per-node 8 --gpus-per-task 1 ligertune train RECIPE   # a task per GPU

With a task per node, each task is one node of torchrun's rendezvous (`distributed.Rendezvous`): it
starts its node's processes (`SLURM_GPUS_ON_NODE`, or `--nproc`) and they meet at the first node of
the step. With a task per process, the tasks are the run's processes themselves: each takes its
rank from `SLURM_PROCID` and joins the process group at the first node directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Mapping

from ligertune.errors import UserError

PORT_BASE = 15000
"""The rendezvous port under SLURM, when MASTER_PORT does not give one: PORT_BASE + the job id's last
four digits, so that two jobs sharing a node rarely pick the same one."""

# Step ids that are not a step started by srun: the batch script, the external step, salloc's shell.
_NOT_SRUN = {"batch", "extern", "interactive", "4294967294", "4294967295", "4294967290"}


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in an `srun` step."""

    job_id: str
    nnodes: int
    node_rank: int
    ntasks: int
    task_rank: int
    local_task: int
    gpus_on_node: int | None
    master_addr: str
    master_port: int

    @property
    def tasks_are_processes(self) -> bool:
        """More tasks than nodes: each task is one process of the run (a task per GPU)."""
        return self.ntasks > self.nnodes

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def describe(self) -> str:
        return (f"SLURM job {self.job_id}: {self.nnodes} node{'s' * (self.nnodes > 1)}, "
                f"{self.ntasks} task{'s' * (self.ntasks > 1)}, this one {self.task_rank} on node {self.node_rank}")

    def process_environment(self) -> dict[str, str]:
        """What torchrun would set for a task that is one process of the run."""
        return {"RANK": str(self.task_rank), "WORLD_SIZE": str(self.ntasks), "LOCAL_RANK": str(self.local_task),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """This task's step when it was started by `srun` (not the batch script itself, nor a shell of
    `salloc`), else None. The step's own variables come first (a step may use part of the job's
    nodes), the job's second; MASTER_ADDR and MASTER_PORT, when set, name the meeting point."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    step_id = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step_id is None or step_id.strip().lower() in _NOT_SRUN:
        return None

    def number(*names: str, default: int | None = None) -> int:
        for name in names:
            if env.get(name, "").strip():
                value = env[name].strip()
                match = re.match(r"\d+", value)  # SLURM_GPUS_ON_NODE may read "8", a count may carry "(x2)"
                if match is None:
                    raise UserError(f"{name}={value!r}: not a number (SLURM sets it to one)")
                return int(match.group())
        if default is None:
            raise UserError(f"{' or '.join(names)}: not set, and srun sets it; start the run with srun")
        return default

    job_id = env["SLURM_JOB_ID"].strip()
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    master_addr = env.get("MASTER_ADDR", "").strip() or first_host(nodelist)
    digits = re.sub(r"\D", "", job_id)[-4:] or "0"
    return SlurmStep(
        job_id=job_id,
        nnodes=number("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
        node_rank=number("SLURM_NODEID"),
        ntasks=number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        task_rank=number("SLURM_PROCID"),
        local_task=number("SLURM_LOCALID", default=0),
        gpus_on_node=number("SLURM_GPUS_ON_NODE", default=0) or None,
        master_addr=master_addr,
        master_port=number("MASTER_PORT", default=PORT_BASE + int(digits)),
    )


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `node[01-02],gpu7` -> `node01`, `a1,b2` -> `a1`,
    `rack[3,5]-n[1-4]` -> `rack3-n1` (what `scontrol show hostnames` lists first)."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise UserError("SLURM_JOB_NODELIST: not set or empty; set MASTER_ADDR to the first node's address")
    return hosts[0]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a SLURM node list, in order: comma-separated names, each with any number of
    bracketed ranges and lists (`n[01-03,07]`, zero padding kept)."""
    hosts: list[str] = []
    for name in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, inside in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            choices = [literal]
            if inside:
                choices = [literal + item for item in _expand_range_list(inside, nodelist)]
            expanded = [head + choice for head in expanded for choice in choices]
        hosts.extend(h for h in expanded if h)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(inside: str, nodelist: str) -> list[str]:
    items = []
    for part in inside.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise UserError(f"SLURM node list {nodelist!r}: cannot read [{inside}]; set MASTER_ADDR to the "
                            "first node's address")
        if not high:
            items.append(low)
            continue
        width = len(low)
        items.extend(str(i).zfill(width) for i in range(int(low), int(high) + 1))
    return items
