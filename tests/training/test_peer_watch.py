"""`PeerWatch` on its own, over gloo with two processes: a process whose main thread waits where no
collective will ever fail (as NCCL waits for a lost peer) ends by itself with one line once the other
is killed; a process that finished is not taken for lost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from cli_runs import free_port

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    import torch.distributed as dist
    from ligertune.distributed import PeerWatch, topology_from_environment

    rank, fate = int(os.environ["RANK"]), sys.argv[1]
    with PeerWatch(topology_from_environment(), interval_s=0.1, stuck_s=1.5,
                   on_lost=lambda lost: print(f"lost: {lost}", file=sys.stderr)):
        dist.init_process_group("gloo")
        dist.barrier()
        if rank == 1 and fate == "killed":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        # rank 0 waits where a collective would wait for a killed rank 1 without end; else 3 s, 1 s
        time.sleep((60 if fate == "killed" else 3) if rank == 0 else 1)
    print("done", file=sys.stderr)
    os._exit(0)  # without destroying the group: rank 1 may be gone
""")


def run_pair(fate: str) -> list[tuple[int, str]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, fate], env={**env, "RANK": str(rank)},
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    errs = [proc.communicate(timeout=50)[1] for proc in procs]
    return [(proc.returncode, err) for proc, err in zip(procs, errs)]


def test_a_process_waiting_on_a_killed_peer_ends_with_one_line():
    (code, err), (killed, _) = run_pair("killed")  # rank 0 ends long before its 60 s wait would
    assert killed == -9
    assert code == 1, err
    assert err.strip().splitlines() == ["lost: run of 2 processes: lost rank 1: stopped answering"], err


def test_a_peer_that_finished_is_not_lost():
    for code, err in run_pair("finished"):
        assert code == 0, err
        assert err.strip().splitlines() == ["done"], err
