"""Many processes, one run: the process group, sharding, and each rank's share of a step.

`torchrun` (or `ligertune train --nproc N`, which starts the same through `torch.distributed.run`)
starts one process per device and tells each its rank in the environment. Each optimizer step takes
`micro_batch_size x grad_accum_steps x world_size` packs of the shared stream, whatever the world
size, and `split_packs` hands each rank the same number of them with token counts balanced. The
loss weights of the whole step are all-reduced before the first backward (`step_token_weights`),
and the ranks' gradients are summed, not averaged, so that 1 rank x accumulation 4, 2 x 2 and 4 x 1
compute the same loss and gradient.

Sharding is PyTorch's own: `fully_shard` (FSDP2) on every decoder layer and, as the root, on the
loss head that holds the model, so that the output projection the fused loss reads (tied to the
input embedding or not) is gathered by the root's hooks around the head's forward; or
`DistributedDataParallel` around the head for small models.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ligertune.errors import EnvironmentFault, UserError, first_line

T = TypeVar("T")


@dataclass(frozen=True)
class Topology:
    """Where this process stands among the run's processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def topology_from_environment() -> Topology:
    """The rank, world size and local rank that `torchrun` sets (one process when unset)."""
    try:
        return Topology(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                        int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError:
        raise UserError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None


def is_main_process() -> bool:
    """Rank 0, or the only process (before or without a process group)."""
    return topology_from_environment().is_main


def init_process_group(topology: Topology, device_type: str, *, timeout_minutes: float) -> torch.device:
    """Join the run's process group (NCCL on CUDA, gloo on the CPU); this rank's device."""
    if device_type == "cuda":
        if topology.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {topology.local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                            "start at most one process per GPU")
        device = torch.device("cuda", topology.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if topology.distributed and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            rank=topology.rank, world_size=topology.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            # The rank's GPU, named: a barrier otherwise warns on stderr that it guesses the device.
            device_id=device if device_type == "cuda" else None,
        )
    return device


def destroy_process_group() -> None:
    """Leave the process group. Models sharded over it, and their meshes, that reference cycles still
    hold are freed first, while Python runs: the group they hold would otherwise be torn down by
    Python's shutdown, where gloo's threads can abort the process (SIGABRT)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def finished_together() -> None:
    """Wait until every rank is past its last collective: on the way out of work that went well,
    before the process group is destroyed. With gloo, a communication thread still letting go of a
    collective's tensors while Python shuts down aborts a process that has finished (SIGABRT). Not
    after an error: the other ranks may never come."""
    barrier()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum of `value` over the ranks (itself with one process)."""
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """The largest `value` over the ranks (itself with one process)."""
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def broadcast_from_main(value: T) -> T:
    """Rank 0's `value` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def together(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank and fail on every rank when it fails on any, with the first failing
    rank's error, so that no rank waits on a collective the others will never reach. Only the
    failing rank's own error keeps its traceback; the others raise a copy of its message."""
    try:
        result, failure = fn(), None
    except (UserError, EnvironmentFault) as err:
        result, failure = None, (type(err).__name__, str(err))
        error: BaseException | None = err
    except Exception as err:
        result, failure = None, ("RuntimeError", f"{type(err).__name__}: {err}")
        error = err
    else:
        error = None
    failures = [f for f in gather_objects(failure) if f is not None]
    if error is not None:
        raise error
    if failures:
        kind, message = failures[0]
        raise {"UserError": UserError, "EnvironmentFault": EnvironmentFault}.get(kind, RuntimeError)(message)
    return result


# --------------------------------------------------------------------------------------------------
# data


def split_packs(packs: Sequence[T], world_size: int, *, length: Callable[[T], int] = len) -> list[list[T]]:
    """`packs` dealt to `world_size` ranks, the same number each, token counts balanced.

    Longest first, each pack goes to the rank with the fewest tokens among those still short of
    their share (ties to the lowest rank), so the result depends on the lengths alone. Within a
    rank the packs keep their order in `packs`.
    """
    if len(packs) % world_size:
        raise ValueError(f"{len(packs)} packs do not split evenly over {world_size} ranks")
    share = len(packs) // world_size
    order = sorted(range(len(packs)), key=lambda i: (-length(packs[i]), i))
    tokens, taken = [0] * world_size, [[] for _ in range(world_size)]
    for i in order:
        rank = min((r for r in range(world_size) if len(taken[r]) < share), key=lambda r: (tokens[r], r))
        taken[rank].append(i)
        tokens[rank] += length(packs[i])
    return [[packs[i] for i in sorted(chosen)] for chosen in taken]


# --------------------------------------------------------------------------------------------------
# sharding


def shard(head: nn.Module, decoder_layers: Sequence[nn.Module], *, strategy: str, device: torch.device,
          mixed_precision: torch.dtype | None, reshard_after_forward: bool = True) -> nn.Module:
    """The loss head made data-parallel: FSDP2 over each decoder layer with the head as the root, or
    DDP around the head. Gradients are summed over the ranks (the loss weights already count the
    whole step). `reshard_after_forward=False` keeps each layer's gathered weights from its forward
    to its backward (`distributed.reshard_after_forward`). Returns the module to call for forward
    and backward."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(head, device_ids=[device.index] if device.type == "cuda" else None)
        wrapped.register_comm_hook(None, _sum_gradients)
        return wrapped

    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = root_policy = MixedPrecisionPolicy()
    if mixed_precision is not None:
        # Compute in half precision, reduce gradients in float32 into the float32 sharded parameters
        # (`training.build.fsdp_dtypes`: every trainable one; a LoRA base stays 16-bit, frozen).
        policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
        # The root's floating-point inputs are the loss's token weights: cast to 16 bits they would
        # weigh each token's loss with a relative error up to 2^-9 (bf16). The layers' inputs are
        # the 16-bit hidden states, cast as before.
        root_policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32,
                                           cast_forward_inputs=False)
    for layer in decoder_layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(head, mp_policy=root_policy)
    for module in head.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no pre-multiplied sum, and a divide factor of 1 needs none.
            module.set_force_sum_reduction_for_comms(True)
    return head


def accumulating(engine: nn.Module, *, last: bool):
    """The context of one micro-batch's backward: DDP reduces the gradients after the step's last
    micro-batch only (reducing after each would add the earlier ones' sum again with every later
    one). FSDP2 reduce-scatters each micro-batch's gradient into the sharded sum, which is exact."""
    if not last and hasattr(engine, "no_sync"):
        return engine.no_sync()
    return contextlib.nullcontext()


def _sum_gradients(state, bucket):
    """DDP communication hook: the sum of the ranks' gradients (DDP's default is their mean)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks the hook's annotations as objects; this module's are strings (`from __future__`).
_sum_gradients.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (collective), else the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


# --------------------------------------------------------------------------------------------------
# launching


@dataclass(frozen=True)
class Rendezvous:
    """How the machines of one run find each other: torchrun's static rendezvous. Node 0 serves it
    at `endpoint` (HOST:PORT, an address of node 0 that the others reach); every node names it, the
    number of nodes and its own rank among them, so that the ranks follow the nodes' order and rank
    0, which writes the run's files, is on node 0."""

    nnodes: int
    node_rank: int
    endpoint: str
    run_id: str = "ligertune"
    timeout_s: int = 300
    """How long a node waits for the others to join before it gives up (torch's default: 600)."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise UserError(f"--nnodes: {self.nnodes} nodes; give at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank: {self.node_rank} is not a node of {self.nnodes} "
                            f"(0 to {self.nnodes - 1}; node 0 serves the rendezvous)")
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--rdzv-endpoint: {self.endpoint!r} is not HOST:PORT (an address of node 0 "
                            "that every node reaches, and a free port there, such as node0:29500)")

    def describe(self) -> str:
        return f"rendezvous {self.endpoint} (id {self.run_id})"

    def wait_for_node_0(self) -> bool:
        """Whether node 0 answers at the endpoint within the timeout. (torch's store client waits
        as well, but logs each failed try with a C++ backtrace: a node started before node 0 would
        print pages.)"""
        import socket
        import time

        host, _, port = self.endpoint.rpartition(":")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                    return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)

    def torchrun_args(self) -> list[str]:
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", f"timeout={self.timeout_s}"]


def launch(nproc: int, args: list[str], *, rendezvous: Rendezvous | None = None,
           env: dict[str, str] | None = None) -> int:
    """Run `python -m ligertune ARGS` in `nproc` processes on this machine through
    `torch.distributed.run`: alone (what `torchrun --standalone --nproc_per_node N` does), or as one
    node of several that meet at `rendezvous`. `env` is added to the processes' environment. The
    exit code of the first process that failed, else 0.

    torch's agent passes SIGINT and SIGTERM on to the processes, which finish the step, save and exit
    130 or 143; it waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds for them before killing them, 10
    minutes here (its default, 30 s, is shorter than saving a large model takes).

    A node that never joins, or a node 0 that never serves the rendezvous, is an `EnvironmentFault`
    naming the rendezvous and the missing node, raised on the nodes that wait, once
    `rendezvous.timeout_s` has passed (`rendezvous_failure`). A process that died during the run
    (killed by a signal), or one that its peers found lost (`PeerWatch`), is `PeersLost`: one line for
    this node (`lost_processes`); the processes themselves print nothing of it."""
    import logging

    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    # The launcher's own notices (thread counts, a worker's exit code) are not the run's output:
    # the workers print their errors, and the exit code says the rest.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    os.environ.update({LAUNCHER_REPORTS: "1", **(env or {})})
    if rendezvous is not None and rendezvous.node_rank != 0 and not rendezvous.wait_for_node_0():
        raise EnvironmentFault(rendezvous_failure(rendezvous, None))
    where = rendezvous.torchrun_args() if rendezvous is not None else ["--standalone"]
    parsed = get_args_parser().parse_args([*where, "--nproc_per_node", str(nproc), "--module", "ligertune", *args])
    try:
        run(parsed)
    except ChildFailedError as err:
        where = (f"{rendezvous.describe()}, {rendezvous.nnodes} nodes" if rendezvous is not None
                 else f"run of {nproc} processes")
        lost = lost_processes(err.failures, where, world_size=nproc * (rendezvous.nnodes if rendezvous else 1),
                              local_world_size=nproc)
        if lost is not None:
            raise lost from None
        codes = [failure.exitcode for _, failure in sorted(err.failures.items())]
        return next((c for c in codes if c and c > 0), 1)
    except SignalException as err:  # the agent stopped the processes on this signal
        return 128 + int(err.sigval)
    except (DistError, RendezvousError) as err:
        if rendezvous is None:
            raise
        raise EnvironmentFault(rendezvous_failure(rendezvous, err)) from None
    return 0


def rendezvous_failure(rendezvous: Rendezvous, err: BaseException | None) -> str:
    """One line for a rendezvous that did not complete: which node is missing, where, after how long.

    Node 0 serves the rendezvous (a TCPStore) and waits for the others to connect: torch says how
    many did ("1/2 clients joined"), not which, so the missing node is named when one is missing of
    two or more when only node 0 came. The other nodes wait for node 0 to answer."""
    import re

    where = f"{rendezvous.describe()}, {rendezvous.nnodes} nodes"
    waited = f"within {rendezvous.timeout_s} s"
    if rendezvous.node_rank != 0:
        return (f"{where}: node 0 did not serve it {waited} (not started, or {rendezvous.endpoint} not "
                f"reachable from node {rendezvous.node_rank}); start node 0 with --node-rank 0 and the same "
                f"--rdzv-endpoint")
    joined = re.search(r"(\d+)/(\d+) clients joined", str(err))
    if joined is None:
        return f"{where}: {first_line(err) if err is not None else 'did not complete'}"
    present = int(joined.group(1))
    missing = rendezvous.nnodes - present
    if present == 1:
        which = "node 1" if missing == 1 else f"nodes 1 to {rendezvous.nnodes - 1}"
    else:
        which = f"{missing} of nodes 1 to {rendezvous.nnodes - 1}"
    return (f"{where}: {which} did not join {waited} ({present} of {rendezvous.nnodes} joined); start "
            f"each with its --node-rank and --rdzv-endpoint {rendezvous.endpoint}")


# --------------------------------------------------------------------------------------------------
# lost processes

HEARTBEAT_S = 1.0
"""How often each process of a run adds one to its counter in the run's store (the rendezvous's
TCPStore). After a collective fails, a rank whose counter stands still for `HEARTBEAT_WINDOW` beats
has stopped; one that is alive beats even while its main thread waits in a collective."""

HEARTBEAT_WINDOW = 3

STUCK_S = 10.0
"""How long another process's counter may stand still, with no collective failing in this one,
before this process takes it as stopped and ends itself (`PeerWatch`'s `on_lost`): its main thread
may be waiting in a collective that never fails (NCCL waits for a lost peer without end, where gloo's
connection breaks). Far beyond any pause of a live process's heartbeat thread."""

_FINISHED = 1 << 40
"""Added to a process's counter when its watch closes without error: a counter at or above it has
finished, not stopped."""

LAUNCHER_REPORTS = "LIGERTUNE_LAUNCHER_REPORTS"
"""Set by `launch` in its processes' environment: a process that finds ranks lost hands its line to
the launcher (torch's error file) instead of printing it, and the launcher prints one line a node."""


class PeersLost(EnvironmentFault):
    """Processes of the run stopped (killed, crashed, their node gone): the one line that names the
    run and the lost `ranks`."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message)
        self.ranks = sorted(ranks)


def is_collective_failure(err: BaseException | None) -> bool:
    """Whether `err` (or what it was raised from) is a collective or store operation that failed:
    torch's `DistError`s, gloo's transport errors (a plain RuntimeError), either inside the
    distributed checkpoint's exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, dist.DistError):
            return True
        if isinstance(err, CheckpointException):
            return any(is_collective_failure(cause) for cause, _ in err.failures.values())
        text = str(err)
        if isinstance(err, RuntimeError) and any(sign in text for sign in _TRANSPORT_ERRORS):
            return True
        err = err.__cause__ or err.__context__
    return False


_TRANSPORT_ERRORS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer")


def describe_ranks(ranks: Sequence[int], *, world_size: int, local_world_size: int) -> str:
    """"rank 1", "ranks 1, 3", or on several nodes "rank 9 (node 1)", "node 1 (ranks 8-15)"."""
    def listed(chosen: Sequence[int]) -> str:
        return f"rank {chosen[0]}" if len(chosen) == 1 else f"ranks {', '.join(map(str, chosen))}"

    ranks = sorted(ranks)
    if local_world_size < 1 or world_size % local_world_size or world_size == local_world_size:
        return listed(ranks)
    parts = []
    for node in sorted({r // local_world_size for r in ranks}):
        mine = [r for r in ranks if r // local_world_size == node]
        first, last = node * local_world_size, (node + 1) * local_world_size - 1
        if len(mine) == local_world_size and local_world_size > 1:
            parts.append(f"node {node} (ranks {first}-{last})")
        else:
            parts.append(f"{listed(mine)} (node {node})")
    return ", ".join(parts)


def lost_line(where: str, ranks: Sequence[int], *, world_size: int, local_world_size: int,
              fates: dict[int, str] | None = None, unknown: str = "stopped answering") -> str:
    """One line naming the run (`where`) and the lost ranks, with what became of each where known
    (`fates`: "killed by SIGKILL (pid 4242)"), else `unknown`."""
    fates = fates or {}
    text = f"{where}: lost {describe_ranks(ranks, world_size=world_size, local_world_size=local_world_size)}"
    if len(ranks) == 1:
        return f"{text}: {fates.get(ranks[0], unknown)}"
    return f"{text}: " + ", ".join(f"rank {r} {fates.get(r, unknown)}" for r in sorted(ranks))


def run_description(world_size: int, local_world_size: int, env: dict[str, str] | None = None) -> str:
    """The run as a process of it names it: the rendezvous of its nodes (where they met, torchrun's
    run id), or its processes on one machine."""
    env = os.environ if env is None else env
    nodes = world_size // local_world_size if local_world_size and not world_size % local_world_size else 1
    if nodes <= 1:
        return f"run of {world_size} processes"
    run_id = env.get("TORCHELASTIC_RUN_ID")
    where = f"rendezvous {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return f"{where}{f' (id {run_id})' if run_id else ''}, {nodes} nodes"


class PeerWatch:
    """A context in which this process beats its counter in the run's store every `interval_s`,
    from a thread of its own, and in which a collective that fails because other processes stopped
    becomes `PeersLost` naming them: the ranks whose counters stood still for `HEARTBEAT_WINDOW`
    beats after the failure. When the store itself is gone, node 0 (which serves it) is the one lost.
    A failure that no stopped rank explains goes on as it was. Nothing happens with one process.

    With `on_lost`, the thread also watches the other counters: when one stands still for `stuck_s`
    and no collective has failed here meanwhile (the main thread waits in one that never will), it
    calls `on_lost` with the `PeersLost` (to report it) and ends the process with exit code 1. A
    process whose watch closes without error marks its counter finished, so that the others, still
    at work, do not take it for stopped.

    The counters wait for the process group: the watch may open before it is joined, and must close
    before it is destroyed."""

    def __init__(self, topology: Topology, *, interval_s: float = HEARTBEAT_S,
                 on_lost: Callable[[PeersLost], None] | None = None, stuck_s: float = STUCK_S):
        import threading

        self.topology = topology
        self.interval_s = interval_s
        self.on_lost = on_lost
        self.stuck_s = stuck_s
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))
        self._stop = threading.Event()
        self._closing = threading.Lock()  # taken by whichever reports first: the thread or `__exit__`
        self._thread = None

    def __enter__(self) -> PeerWatch:
        import threading

        if self.topology.distributed:
            self._thread = threading.Thread(target=self._beat, name="ligertune-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind, err, traceback) -> None:
        try:
            if self._thread is not None and err is not None and is_collective_failure(err):
                if not self._closing.acquire(blocking=False):  # the thread is reporting and ending the process
                    self._thread.join()
                lost = self._diagnose()
                if lost is not None:
                    raise lost from err
        finally:
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
                if err is None:
                    with contextlib.suppress(RuntimeError, OSError):
                        _store().add(_heartbeat_key(self.topology.rank), _FINISHED)

    def _beat(self) -> None:
        import time

        keys = [_heartbeat_key(rank) for rank in range(self.topology.world_size)]
        changed: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        unanswered_since = None  # when the store stopped answering
        while not self._stop.wait(self.interval_s):
            if not dist.is_initialized():
                continue
            now = time.monotonic()
            try:
                store = _store()
                store.add(keys[self.topology.rank], 1)
                unanswered_since = None
                if self.on_lost is None or not store.check(keys):
                    continue
                for rank, value in enumerate(store.multi_get(keys)):
                    value = int(value)
                    if changed.get(rank, (None,))[0] != value:
                        changed[rank] = (value, now)
                stopped = [rank for rank, (value, moved) in changed.items()
                           if value < _FINISHED and now - moved > self.stuck_s]
            except (RuntimeError, OSError):  # the store does not answer (torch's `DistError`s)
                if self.on_lost is None:
                    return  # `_diagnose` says so if a collective fails
                unanswered_since = unanswered_since or now
                if now - unanswered_since <= self.stuck_s:
                    continue
                stopped = None  # gone
            if stopped is None or stopped:
                self._end(stopped)
                return

    def _end(self, stopped: list[int] | None) -> None:
        """Report `stopped` (None: the store is gone) through `on_lost` and end the process, unless the
        main thread's collective failed first (it reports) or nothing explains it (the thread stops)."""
        import sys

        if self.on_lost is None or not self._closing.acquire(blocking=False):
            return
        lost = self._lost(stopped)
        if lost is None:
            self._closing.release()
            return
        self.on_lost(lost)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def stopped_ranks(self) -> list[int] | None:
        """The ranks whose counters stand still over the window (None: the store cannot be reached)."""
        import time

        world = self.topology.world_size
        keys = [_heartbeat_key(rank) for rank in range(world)]
        try:
            store = _store()
            before = [store.add(key, 0) for key in keys]
            alive = {self.topology.rank}
            deadline = time.monotonic() + HEARTBEAT_WINDOW * self.interval_s
            while len(alive) < world and time.monotonic() < deadline:
                time.sleep(self.interval_s / 4)
                alive.update(r for r in range(world) if r not in alive and store.add(keys[r], 0) != before[r])
        except (RuntimeError, OSError):  # torch's `DistError`s: the store no longer answers
            return None
        return [rank for rank in range(world) if rank not in alive]

    def _diagnose(self) -> PeersLost | None:
        """Which ranks stopped, as `PeersLost`; None when every rank is alive. SIGINT and SIGTERM wait
        meanwhile: the launcher stops the processes of a node that lost one, and the answer is a
        few seconds away."""
        import signal
        import threading

        held = {}
        if threading.current_thread() is threading.main_thread():
            held = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            stopped = self.stopped_ranks()
        finally:
            for signum, handler in held.items():
                signal.signal(signum, handler)
        return self._lost(stopped)

    def _lost(self, stopped: list[int] | None) -> PeersLost | None:
        """`PeersLost` naming the `stopped` ranks, or node 0 when the store is gone (None) and this
        process is elsewhere; None when nothing was lost that another node could tell."""
        world, per_node = self.topology.world_size, self.local_world_size
        where = run_description(world, per_node)
        if stopped is None:
            if self.topology.rank < per_node:  # node 0 serves the store: with it gone, this is not node 0
                return None
            node_0 = list(range(per_node))
            return PeersLost(lost_line(where, node_0, world_size=world, local_world_size=per_node,
                                       unknown="the store it serves no longer answers"), node_0)
        if not stopped:
            return None
        return PeersLost(lost_line(where, stopped, world_size=world, local_world_size=per_node), stopped)


def reports_lost(lost: PeersLost) -> bool:
    """Whether this process prints the line about `lost` for its node: the lowest rank of the node
    still running. None does when `launch` started the processes: the launcher prints it."""
    if os.environ.get(LAUNCHER_REPORTS):
        return False
    topology = topology_from_environment()
    per_node = max(int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size)), 1)
    running = [r for r in range(topology.world_size) if r // per_node == topology.rank // per_node
               and r not in lost.ranks]
    return bool(running) and topology.rank == running[0]


def hand_over(lost: PeersLost, line: str) -> None:
    """Give the launcher this process's line about lost ranks, in the error file torch's agent reads
    back from a failed process (`TORCHELASTIC_ERROR_FILE`) with the ranks beside it."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time()), "lost_ranks": lost.ranks}, f)
    except OSError:
        pass


def _heartbeat_key(rank: int) -> str:
    return f"ligertune/heartbeat/{rank}"


def _store():
    """The process group's store: the rendezvous's TCPStore (served by node 0's launcher, or by rank
    0 when srun started the processes)."""
    return dist.distributed_c10d._get_default_store()


def lost_processes(failures: dict, where: str, *, world_size: int, local_world_size: int) -> PeersLost | None:
    """This node's line about the run's lost processes, from torch's record of its failed ones
    (`ChildFailedError.failures`: global rank -> `ProcessFailure`): each killed by a signal other than
    the SIGTERM or SIGINT that stops the others, and each rank that a process of this node found lost
    (its error file, `hand_over`). What this node saw of a lost rank (its signal or exit code, its pid)
    is said; None when no process was lost (a process that failed has printed its own error)."""
    import signal

    lost, fates = set(), {}
    for rank, failure in failures.items():
        if failure.exitcode < 0 and -failure.exitcode not in (signal.SIGTERM, signal.SIGINT):
            lost.add(rank)
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        lost.update(int(r) for r in data.get("lost_ranks", ()))
    if not lost:
        return None
    for rank in lost & failures.keys():
        failure = failures[rank]
        try:
            how = f"killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0 else \
                f"exited with code {failure.exitcode}"
        except ValueError:
            how = f"killed by signal {-failure.exitcode}"
        fates[rank] = f"{how} (pid {failure.pid})"
    return PeersLost(lost_line(where, sorted(lost), world_size=world_size, local_world_size=local_world_size,
                               fates=fates, unknown="stopped answering"), sorted(lost))
