"""The training loop: setup -> train -> finish.

The run's progress lives on one object (`RunState`: step, epoch, position in the epoch's order)
and the loop is made of steps around it:

    while state.step < total_steps:
        stats = train_step(run, next_batches(run))    # forward/backward of every micro-batch, update
        record = log(run, stats)                       # metrics.jsonl and the live line
        maybe_evaluate(run)                            # held-out loss every `eval_every` steps
        maybe_save(run)                                # a checkpoint every `save_every` steps

One optimizer step takes `grad_accum_steps` micro-batches of `micro_batch_size` packs each. Before
the first backward of a step, the per-token loss weights of the whole step are computed
(`loss_weights.step_token_weights`), so the step's loss and gradient are the same however the
step was cut (docs/loss.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import resource
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
import transformers
from rich.console import Console
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ligertune.data import IGNORE_INDEX, Batch, Pack, PaddedBatch, TokenizedExample, collate, collate_padded
from ligertune.distributed import (
    Topology,
    accumulating,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    destroy_process_group,
    gather_objects,
    init_process_group,
    shard,
    split_packs,
    together,
    topology_from_environment,
)
from ligertune.errors import EnvironmentFault, UserError
from ligertune.flops import StepFlops, device_peak_tflops
from ligertune.kernels import active_path
from ligertune.models import CausalLMLoss, decoder_of, load_tokenizer
from ligertune.models.quantize import parameter_count
from ligertune.plotting import plot_metrics
from ligertune.recipe import Recipe, dump_recipe
from ligertune.training.build import (
    TrainingData,
    build_data,
    build_device,
    build_head,
    build_model,
    build_optimizer,
    build_scheduler,
    fsdp_dtypes,
    optimizer_warnings,
    packs_per_step,
    total_steps,
)
from ligertune.training.checkpoint import (
    OPTIMIZER,
    TRAINER_STATE,
    MetricsLog,
    latest_checkpoint,
    load_trainer_state,
    remove_stale_temporaries,
    save_checkpoint,
    save_pretrained,
    write_atomic_dir,
    write_atomic_text,
)
from ligertune.training.clipping import clip_gradients
from ligertune.training.display import TrainProgress, sample_table, summary_table
from ligertune.training.loss_weights import step_token_weights
from ligertune.training.memory import (
    CheckpointPlanner,
    InputOffload,
    device_allocator,
    fixed_offload,
    set_checkpointed,
)
from ligertune.training.precision import optimizer_memory
from ligertune.training.reporters import Reporters, open_reporters
from ligertune.training.resume import check_resumable, find_checkpoint, load_model_weights
from ligertune.training.run_dir import RunLock, check_output_dir, claim_output_dir
from ligertune.training.spikes import Spike, find_spike, remember
from ligertune.training.state import PackStream, RunState, capture_rng, restore_rng
from ligertune.training.throughput import Clock, Throughput


@dataclass
class TrainResult:
    """What a finished run left behind and how it went."""

    output_dir: Path
    final_dir: Path
    steps: int
    train_loss: float | None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: tuple[str, str, str] | None = None
    skipped_steps: int = 0
    spikes: int = 0


@dataclass
class StepStats:
    """One optimizer step: its loss (cross-entropy, z-loss apart), accuracy, tokens and update."""

    loss: float
    z_loss: float
    token_accuracy: float
    tokens: int
    """Supervised (trained) tokens."""
    real_tokens: int
    """Non-padding tokens that went through the model."""
    flops: float
    """The step's model flops (`ligertune.flops`), every rank's together."""
    lr: float
    grad_norm: float
    """The norm over every gradient before clipping."""
    skipped: str | None = None
    """Why the update was dropped ("nonfinite", or "spike" with `train.on_spike: skip`), or None."""
    clipped: int = 0
    """Gradient tensors that clipping scaled down (0: it did not act; `global` clips all or none)."""
    spike: Spike | None = None
    """The spike watch's finding on this step's loss."""


@dataclass
class Run:
    """Everything `setup` builds for the loop, and the run's state."""

    recipe: Recipe
    device: torch.device
    console: Console
    tokenizer: object
    model: torch.nn.Module
    head: CausalLMLoss
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: TrainingData
    total_steps: int
    output_dir: Path
    metrics: MetricsLog
    meter: Throughput
    state: RunState = field(default_factory=RunState)
    stream: PackStream | None = None
    lock: RunLock | None = None
    reporters: Reporters | None = None
    topology: Topology = field(default_factory=Topology)
    engine: torch.nn.Module | None = None
    """What forward and backward go through: the head, or its data-parallel wrapper."""
    last_loss: float | None = None
    checkpointing: CheckpointPlanner | int | None = None
    """Gradient checkpointing: the layers recomputed, or the planner of `auto` (None: off)."""
    offload: InputOffload | None = None
    """Parks checkpointed layers' inputs in host memory while enabled (`train.activation_offload`)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    spikes: MetricsLog = field(default_factory=lambda: MetricsLog(None))
    """`spikes.jsonl` (rank 0, with the spike watch on)."""
    step_packs: list[Pack] = field(default_factory=list)
    """Every pack of the step under way, all ranks' (what a spike record lists)."""
    prefetched: tuple[tuple, list] | None = None
    """The next step's micro-batches, made ahead (`prefetch_batches`), with the stream and the data
    position they start at."""
    resume_command: str = "ligertune train RECIPE --resume"
    trainable: list[torch.nn.Parameter] = field(init=False)
    """The parameters the optimizer updates (listed once: the step clips them every time)."""
    step_flops: StepFlops = field(init=False)

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = PackStream(self.data.train_packs, self.recipe.train.seed)
        if self.engine is None:
            self.engine = self.head
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.step_flops = StepFlops.of(self.model)

    @property
    def eval_examples(self) -> list[TokenizedExample]:
        return self.data.eval_examples


class RunInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after a complete step and a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Path, command: str):
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped after step {step}, checkpoint {checkpoint}; resume with: {command}")


class TrainingDiverged(EnvironmentFault):
    """Too many consecutive steps with a non-finite loss or gradient."""


def train(
    recipe: Recipe,
    *,
    console: Console | None = None,
    resume: str | Path | None = None,
    resume_command: str | None = None,
    clock: Clock = time.perf_counter,
) -> TrainResult:
    """Train the recipe's model on its data; write metrics, checkpoints and the final model to
    `output.dir`. `resume` ("latest" or a checkpoint path) continues an earlier run exactly."""
    console = console or Console(stderr=False)
    transformers.utils.logging.disable_progress_bar()  # the run has its own display
    try:
        run = setup(recipe, console, resume=resume, clock=clock)
        if resume_command:
            run.resume_command = resume_command
        try:
            with StopSignals() as stop:
                result = train_loop(run, stop)
            # Every rank past its last collective: the communication threads have let go of the
            # collectives' tensors before the process exits. (With gloo, a thread still releasing
            # one while Python shuts down aborts the finished process.)
            barrier()
            return result
        finally:
            cleanup(run)
    finally:
        destroy_process_group()


# --------------------------------------------------------------------------------------------------
# setup


def setup(recipe: Recipe, console: Console, *, resume: str | Path | None = None,
          clock: Clock = time.perf_counter) -> Run:
    """Everything the loop needs, built from the recipe; with several processes, on every rank (a
    user error on any rank stops every rank, reported by rank 0)."""
    cfg = recipe.train
    topology = topology_from_environment()
    device = build_device(cfg)
    if topology.distributed:
        device = init_process_group(topology, device.type, timeout_minutes=recipe.distributed.timeout_minutes)
    if not topology.is_main:
        console = Console(quiet=True)
    output_dir = Path(recipe.output.dir)

    def find() -> tuple[Path | None, dict | None]:
        if topology.is_main:
            check_output_dir(output_dir, resume=resume is not None, overwrite=recipe.output.overwrite)
        if resume is None:
            return None, None
        checkpoint = find_checkpoint(output_dir, resume)
        saved = load_trainer_state(checkpoint)
        check_resumable(saved, recipe, checkpoint, world_size=topology.world_size)
        return checkpoint, saved

    checkpoint, saved = together(find)
    torch.manual_seed(cfg.seed)
    # bf16 (or fp16) compute over float32 master weights, sharded; a LoRA base stays 16-bit.
    dtypes = fsdp_dtypes(recipe, device.type, sharded=topology.distributed and strategy(recipe) == "fsdp")
    mixed_precision = dtypes.compute

    def build() -> tuple:
        tokenizer = load_tokenizer(recipe.model)
        data = build_data(recipe, tokenizer, show_progress=topology.is_main)
        built = build_model(recipe, device=device, vocab_size=len(tokenizer),
                            dtype=dtypes.model, trainable_dtype=dtypes.trainable)
        if checkpoint is not None:
            load_model_weights(built.module, checkpoint)
        return tokenizer, data, built

    tokenizer, data, built = together(build)
    model = built.module
    head = build_head(model, recipe.kernels, recipe.loss)
    engine = head
    if topology.distributed:
        engine = shard(head, decoder_of(model).layers, strategy=strategy(recipe), device=device,
                       mixed_precision=mixed_precision)
    optimizer = build_optimizer(model, recipe.optim)
    steps = total_steps(cfg, len(data.train_packs), topology.world_size)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps=steps)

    def claim() -> tuple:
        if not topology.is_main:
            return None, MetricsLog(None)
        lock = claim_output_dir(output_dir, replace=recipe.output.overwrite and resume is None,
                                notice=lambda text: console.print(text, markup=False))
        try:
            remove_stale_temporaries(output_dir)
            write_atomic_text(output_dir / "recipe.yaml", dump_recipe(recipe))
            return lock, MetricsLog(output_dir / "metrics.jsonl",
                                    resume_after=saved["run"]["step"] if saved is not None else None)
        except OSError as err:
            lock.release()
            raise UserError(f"output.dir: cannot write {output_dir}: {err.strerror or err}") from None

    lock, metrics = together(claim)
    spikes = together(lambda: open_spike_log(recipe, output_dir, saved) if topology.is_main else MetricsLog(None))
    reporters = together(lambda: open_reporters(recipe.output.report_to, output_dir, recipe.to_dict())
                         if topology.is_main and recipe.output.report_to else None)
    run = Run(
        recipe=recipe, device=device, console=console, tokenizer=tokenizer, model=model, head=head,
        optimizer=optimizer, scheduler=scheduler, data=data, total_steps=steps, output_dir=output_dir,
        metrics=metrics, meter=Throughput(device, clock, peak_tflops=cluster_peak_tflops(device, topology)),
        lock=lock, topology=topology, engine=engine,
        reporters=reporters, spikes=spikes,
    )
    run.checkpointing = checkpointing_policy(run)
    run.offload = (run.checkpointing.offloader if isinstance(run.checkpointing, CheckpointPlanner)
                   else fixed_offload(recipe.train, decoder_of(run.model).layers, device))
    describe_run(run, mixed_precision or built.dtype, built.patches.describe() if built.patches else "none")
    if checkpoint is not None:
        restore(run, checkpoint, saved)
    return run


def checkpointing_policy(run: Run) -> CheckpointPlanner | int | None:
    """What `train.gradient_checkpointing` makes of the run's decoder layers (`training.memory`)."""
    cfg = run.recipe.train
    layers = decoder_of(run.model).layers
    if cfg.gradient_checkpointing is False:
        return None
    if cfg.gradient_checkpointing is True:
        return len(layers)
    allocator = device_allocator(run.device)
    if allocator is None:
        set_checkpointed(layers, 0)  # no device memory to budget
        return 0
    budget = cfg.memory_budget_gib
    if budget is None:
        budget = 0.9 * torch.cuda.get_device_properties(run.device).total_memory / 2**30
    return CheckpointPlanner(run.model, layers, allocator, budget, offload=cfg.activation_offload,
                             optimizer=run.optimizer)


def checkpointed_layers(policy: CheckpointPlanner | int) -> int:
    if isinstance(policy, CheckpointPlanner):
        return policy.plan.checkpointed if policy.plan else len(policy.layers)
    return policy


def strategy(recipe: Recipe) -> str:
    """How several processes share the model: `distributed.strategy`, `auto` being FSDP."""
    return "ddp" if recipe.distributed.strategy == "ddp" else "fsdp"


SPIKES = "spikes.jsonl"


def open_spike_log(recipe: Recipe, output_dir: Path, saved: dict | None) -> MetricsLog:
    """`spikes.jsonl` in the run's folder when the spike watch is on (or a resumed run left one, cut
    back to the checkpoint's step like metrics.jsonl: the resumed run flags those steps again)."""
    path = output_dir / SPIKES
    resume_after = saved["run"]["step"] if saved is not None else None
    if recipe.train.spike_threshold is None and not (resume_after is not None and path.exists()):
        return MetricsLog(None)
    try:
        return MetricsLog(path, resume_after=resume_after)
    except OSError as err:
        raise UserError(f"output.dir: cannot write {path}: {err.strerror or err}") from None


def restore(run: Run, checkpoint: Path, saved: dict) -> None:
    """Continue from `checkpoint`: weights (already loaded by `setup`), optimizer, schedule, data
    position and RNG as they were, at this world size or another."""
    load_optimizer_state(run, checkpoint / OPTIMIZER)
    run.scheduler.load_state_dict(saved["scheduler"])
    run.state = RunState.from_dict(saved["run"])
    run.last_loss = saved.get("last_loss")
    run.eval_losses = [tuple(x) for x in saved.get("eval_losses", [])]
    rngs = saved["rng"]
    same_world = len(rngs) == run.topology.world_size
    restore_rng(rngs[run.topology.rank] if same_world else rngs[0])  # last: building drew from them
    run.console.print(f"resumed from {checkpoint} at step {run.state.step} "
                      f"(epoch {run.state.epoch}, pack {run.state.index})", markup=False)


def describe_run(run: Run, dtype: torch.dtype, patches: str) -> None:
    """The lines printed before the first step: model, kernels, data."""
    recipe, data = run.recipe, run.data
    n_params = parameter_count(run.model)  # a quantized weight as the matrix it stands for
    n_trainable = sum(p.numel() for p in run.trainable)
    real = sum(len(p.input_ids) for p in data.train_packs)
    slots = len(data.train_packs) * recipe.data.max_seq_len
    per_step = packs_per_step(recipe.train, run.topology.world_size)
    run.console.print(
        f"[bold]ligertune[/] model {type(run.model).__name__} {n_params / 1e6:.2f}M params "
        f"({n_trainable / 1e6:.2f}M trainable), {dtype}, {run.device.type}"
    )
    run.console.print(f"kernels: {patches}; fused loss: {'on' if run.head.fused else 'off'} "
                      f"({active_path(run.device)} path)")
    run.console.print(
        f"data: {len(data.train_examples)} train / {len(data.eval_examples)} eval conversations, "
        f"{len(data.train_packs)} packs of {recipe.data.max_seq_len} ({real / max(slots, 1):.1%} full), "
        f"{run.total_steps} step{'s' * (run.total_steps != 1)} of {per_step} pack{'s' * (per_step != 1)}"
    )
    policy = run.checkpointing
    if isinstance(policy, CheckpointPlanner):
        run.console.print(f"gradient checkpointing: auto, {policy.budget_gib:.1f} GiB budget; the first "
                          "step measures the layers' activations")
    elif policy is not None:
        layers = len(decoder_of(run.model).layers)
        offloaded = f", the inputs of {run.offload.parked_count} in host memory" if run.offload else ""
        run.console.print(f"gradient checkpointing: {policy} of {layers} layers recomputed{offloaded}"
                          + ("" if recipe.train.gradient_checkpointing is True else
                             " (auto: no device memory to budget on a CPU)"))
    if run.topology.distributed:
        run.console.print(f"processes: {run.topology.world_size}, {strategy(recipe)}, "
                          f"{packs_per_step(recipe.train)} packs each per step")
    memory = optimizer_memory(run.trainable, recipe.optim.name, master_weights=recipe.optim.master_weights)
    run.console.print(memory.describe(), markup=False)
    for warning in optimizer_warnings(recipe, {p.dtype for p in run.trainable}):
        run.console.print(f"warning: {warning}", style="yellow", markup=False)


# --------------------------------------------------------------------------------------------------
# the loop


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the step under way (`requested`); a second
    signal stops at once (KeyboardInterrupt). Outside the main thread, signals are left alone."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum


def train_loop(run: Run, stop: StopSignals | None = None) -> TrainResult:
    cfg = run.recipe.train
    run.head.train()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with TrainProgress(run.console, run.total_steps, initial_step=run.state.step) as progress:
        if run.state.step == 0 and run.data.eval_packs and cfg.eval_at_start:
            evaluate_and_log(run, progress)
        run.meter.start()
        while run.state.step < run.total_steps:
            planner = run.checkpointing if isinstance(run.checkpointing, CheckpointPlanner) else None
            with planner.planning() if planner else contextlib.nullcontext():
                stats = train_step(run, next_batches(run))
            if planner and (news := planner.pop_news()):
                run.console.print(news, markup=False)
            record = log(run, stats)
            result = maybe_evaluate(run, progress)
            if record is not None and result is not None:
                record = {**record, **result}
            saved = maybe_save(run)
            progress.advance(run.state.step, record)
            requested = stop_requested(run, stop)
            if requested:
                checkpoint = saved or save(run)
                raise RunInterrupted(requested, run.state.step, checkpoint, run.resume_command)
    return finish(run)


def stop_requested(run: Run, stop: StopSignals | None) -> int:
    """The signal that asks the run to stop (0 for none), the same on every rank: a rank that got
    it tells the others, so that all stop after the same step."""
    requested = (stop.requested or 0) if stop is not None else 0
    if run.topology.distributed:
        requested = int(all_reduce_max(torch.tensor(float(requested), device=run.device)).item())
    return requested


def next_batches(run: Run) -> list[Batch | PaddedBatch]:
    """This rank's micro-batches of the next step, on the device: the step's packs are the next
    `packs_per_step` of the stream, dealt to the ranks balanced by tokens. Those that
    `prefetch_batches` made for the same data position are taken as they are."""
    position = data_position(run)
    packs = run.stream.take(run.state, packs_per_step(run.recipe.train, run.topology.world_size))
    run.step_packs = packs
    prefetched, run.prefetched = run.prefetched, None
    if prefetched is not None and prefetched[0] == position:
        return prefetched[1]
    return rank_batches(run, packs)


def prefetch_batches(run: Run) -> None:
    """Collate the next step's micro-batches and queue their copies to the device now, while the
    device still runs this step. Left for after the step's loss is read back, the collation would
    leave the device idle (11 ms a step for 4 x 4096 tokens on an H100's host, 3% of a 1B model's
    step). The run's data position does not move: `next_batches` takes them from the same one."""
    ahead = RunState(epoch=run.state.epoch, index=run.state.index)  # a copy: the run's does not move
    packs = run.stream.take(ahead, packs_per_step(run.recipe.train, run.topology.world_size))
    run.prefetched = (data_position(run), rank_batches(run, packs))


def data_position(run: Run) -> tuple:
    """Where the next step's packs start: the stream, the epoch and the index in its order."""
    return run.stream, run.state.epoch, run.state.index


def rank_batches(run: Run, packs: list[Pack]) -> list[Batch | PaddedBatch]:
    """This rank's share of a step's packs, as micro-batches on the device."""
    size = run.recipe.train.micro_batch_size
    world = run.topology.world_size
    if world > 1:
        packs = split_packs(packs, world)[run.topology.rank]
    return [make_batch(run, packs[i : i + size]) for i in range(0, len(packs), size)]


def train_step(run: Run, batches: list[Batch | PaddedBatch]) -> StepStats:
    """One optimizer step over `batches`: forward and backward with step-level loss weights,
    gradient clipping (`optim.clip`), the spike watch, the update and the schedule.

    A step whose loss or gradient norm is not finite updates nothing (its gradients are dropped)
    and is counted; so is a loss spike under `train.on_spike: skip` (`ligertune.training.spikes`);
    `train.max_skipped_steps` of them in a row stop the run.
    """
    cfg = run.recipe.train
    totals = forward_backward(run, batches, backward=True)
    # The norms of whole tensors, every shard counted: the same on each rank.
    clipped = clip_gradients(run.trainable, run.recipe.optim.max_grad_norm, run.recipe.optim.clip)
    if run.state.step + 1 < run.total_steps:
        prefetch_batches(run)  # while the device runs this step: the read-back below waits for it
    lr = run.scheduler.get_last_lr()[0]
    n_real = sum(real_tokens(b) for b in batches)
    squares = sum(squared_lengths(b) for b in batches)
    numbers = [totals["loss"], totals["z_loss"], totals["n_correct"], totals["n_tokens"],
               torch.as_tensor(n_real, device=run.device), torch.as_tensor(squares, device=run.device)]
    # The step's numbers summed over the ranks, then one transfer to the host for all of them.
    summed = all_reduce_sum(torch.stack([x.double() for x in numbers]))
    loss, z_loss, n_correct, n_tokens, n_real, squares, norm, n_clipped = torch.cat(
        [summed, torch.stack([clipped.norm.double(), clipped.tensors.double()]).to(run.device)]).tolist()
    state = run.state
    finite = math.isfinite(loss) and math.isfinite(norm)
    spike = None
    if finite and cfg.spike_threshold is not None:  # the summed loss: every rank judges the same number
        spike = find_spike(loss - z_loss, state.recent_losses, threshold=cfg.spike_threshold,
                           window=cfg.spike_window)
    state.recent_losses = remember(state.recent_losses, loss - z_loss, window=cfg.spike_window)
    state.spikes += spike is not None
    skipped = "nonfinite" if not finite else "spike" if spike and cfg.on_spike == "skip" else None
    if skipped is None:
        run.optimizer.step()
        state.consecutive_skips = 0
    else:
        state.skipped_steps += 1
        state.consecutive_skips += 1
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    stats = StepStats(
        loss=loss - z_loss, z_loss=z_loss, token_accuracy=n_correct / max(n_tokens, 1), tokens=int(n_tokens),
        real_tokens=int(n_real), flops=run.step_flops(int(n_real), int(squares)), lr=lr, grad_norm=norm,
        skipped=skipped, clipped=int(n_clipped), spike=spike,
    )
    if state.consecutive_skips >= cfg.max_skipped_steps:
        log(run, stats)
        latest = latest_checkpoint(run.output_dir)
        spikes = " or a loss spike (train.on_spike: skip)" if cfg.on_spike == "skip" else ""
        raise TrainingDiverged(
            f"step {state.step}: {state.consecutive_skips} steps in a row had a non-finite loss or gradient "
            f"norm{spikes}, so the run stopped; likely causes: a learning rate too high (optim.lr), an "
            "epsilon too small for the dtype (optim.eps), or broken data in these steps; "
            + (f"the last good checkpoint is {latest}" if latest else "no checkpoint was written")
        )
    return stats


def log(run: Run, stats: StepStats) -> dict | None:
    """Count the step's tokens; every `log_every` steps, at the last step and at every skipped or
    spiking step write its metrics record (and a spike's record to spikes.jsonl)."""
    run.meter.add(stats.real_tokens, stats.tokens, stats.flops)
    step = run.state.step
    if stats.spike is not None:
        write_spike(run, stats)
    if step % run.recipe.train.log_every and step != run.total_steps and not stats.skipped and not stats.spike:
        return None
    rates = run.meter.lap()
    record = {
        "step": step,
        "loss": stats.loss,
        "z_loss": stats.z_loss,
        "token_accuracy": stats.token_accuracy,
        "tokens": stats.tokens,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "clipped": stats.clipped > 0,
        "tokens_per_s": rates.tokens_per_s,
        "trained_tokens_per_s": rates.trained_tokens_per_s,
        "peak_mem_gib": run_peak_memory_gib(run),
    }
    if rates.mfu is not None:
        record["mfu"] = rates.mfu
    if run.checkpointing is not None:
        record["checkpointed_layers"] = checkpointed_layers(run.checkpointing)
    if run.offload is not None:
        record["offloaded_layers"] = run.offload.parked_count if run.offload.enabled else 0
    if run.recipe.optim.clip == "per_tensor":
        record["clipped_tensors"] = stats.clipped
    if run.recipe.train.spike_threshold is not None:
        record["spikes"] = run.state.spikes
    if stats.spike is not None:
        record["spike"] = True
    if stats.skipped:
        record["skipped"] = stats.skipped
    else:
        run.last_loss = stats.loss
    write_record(run, record)
    return record


def write_spike(run: Run, stats: StepStats) -> None:
    """A spike's record in spikes.jsonl (rank 0): the step, its loss against the window's median and
    robust deviation, what was done, and the origin (`file:line`, `file:row N` or `dataset[split]:row
    N`) of every conversation of the step, all ranks' packs together."""
    spike = stats.spike
    examples = run.data.train_examples
    run.spikes.write({
        "step": run.state.step,
        "loss": spike.loss,
        "median": spike.median,
        "deviation": spike.deviation,
        "score": spike.score,
        "threshold": run.recipe.train.spike_threshold,
        "action": "skipped" if stats.skipped == "spike" else "logged",
        "conversations": [examples[i].origin for pack in run.step_packs for i in pack.example_indices],
    })


def write_record(run: Run, record: dict) -> None:
    """One record to `metrics.jsonl` and to the reporters of `output.report_to` (rank 0)."""
    run.metrics.write(record)
    if run.reporters is not None:
        run.reporters.log(record)


def maybe_evaluate(run: Run, progress: TrainProgress) -> dict | None:
    """Evaluate every `eval_every` steps and at the last step, when there is held-out data."""
    every, step = run.recipe.train.eval_every, run.state.step
    if not (run.data.eval_packs and every and (step % every == 0 or step == run.total_steps)):
        return None
    return evaluate_and_log(run, progress)


def evaluate_and_log(run: Run, progress: TrainProgress) -> dict:
    with run.meter.excluded() as timing:
        result = evaluate(run)
    step = run.state.step
    run.eval_losses.append((step, result["eval_loss"]))
    write_record(run, {"step": step, **result, "eval_s": timing["seconds"]})
    progress.log(f"step {step}: eval loss {result['eval_loss']:.4f}, "
                 f"token accuracy {result['eval_token_accuracy']:.1%}")
    return result


def maybe_save(run: Run) -> Path | None:
    """A checkpoint every `save_every` steps (the last step's model is written by `finish`)."""
    every, step = run.recipe.train.save_every, run.state.step
    if every and step % every == 0 and step != run.total_steps:
        return save(run)
    return None


def save(run: Run) -> Path:
    """A checkpoint of the whole run at this step (every rank takes part), timed apart from the
    throughput window: the model in Hugging Face format (gathered on rank 0 when sharded), the
    optimizer state through `torch.distributed.checkpoint` (sharded: each rank writes its part,
    and any world size reads it back), and the trainer state."""
    check_finite_weights(run)
    with run.meter.excluded() as timing:
        model_state = gathered_model_state(run)
        optimizer_state = get_optimizer_state_dict(run.head, run.optimizer)
        trainer_state = {
            "format": 1,
            "world_size": run.topology.world_size,
            "run": run.state.to_dict(),
            "scheduler": run.scheduler.state_dict(),
            "rng": gather_objects(capture_rng()),
            "recipe": run.recipe.to_dict(),
            "last_loss": run.last_loss,
            "eval_losses": run.eval_losses,
        }

        def write(folder: Path) -> None:
            with written(run, "checkpoint"):
                with one_process_is_intended():
                    dcp.save({"optimizer": optimizer_state}, checkpoint_id=folder / OPTIMIZER,
                             no_dist=not run.topology.distributed)
                save_pretrained(folder, run.model, run.tokenizer, state_dict=model_state)
                if run.topology.is_main:
                    torch.save(trainer_state, folder / TRAINER_STATE)

        path = save_checkpoint(run.output_dir, run.state.step, write, keep=run.recipe.train.keep_checkpoints)
    write_record(run, {"step": run.state.step, "checkpoint": str(path.relative_to(run.output_dir)),
                       "save_s": timing["seconds"]})
    return path


def gathered_model_state(run: Run) -> dict | None:
    """The whole model's weights on rank 0's CPU when the model is sharded (None otherwise: the
    model saves itself)."""
    if not run.topology.distributed:
        return None
    state = get_model_state_dict(run.head, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "model."  # the head holds the model as `self.model`
    return {k[len(prefix):]: v for k, v in state.items()} if run.topology.is_main else None


def load_optimizer_state(run: Run, folder: Path) -> None:
    """The optimizer state of a checkpoint, resharded to this run's processes."""
    state = {"optimizer": get_optimizer_state_dict(run.head, run.optimizer)}
    with one_process_is_intended():
        dcp.load(state, checkpoint_id=folder, no_dist=not run.topology.distributed)
    set_optimizer_state_dict(run.head, run.optimizer, state["optimizer"])


@contextlib.contextmanager
def one_process_is_intended() -> Iterator[None]:
    """`torch.distributed.checkpoint` warns whenever it runs without a process group, even when
    asked to; a run of one process asks to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def written(run: Run, what: str) -> Iterator[None]:
    """Turn a failed write (full disk, permissions) into one line naming the cause; the temporary
    files are gone already and the previous checkpoint is intact."""
    try:
        yield
    except (OSError, CheckpointException) as err:
        if isinstance(err, CheckpointException):  # the distributed writer wraps each rank's error
            causes = [e for e, _ in err.failures.values() if isinstance(e, OSError)]
            if not causes:
                raise
            err = causes[0]
        where = f" ({err.filename})" if err.filename else ""
        latest = latest_checkpoint(run.output_dir)
        kept = f"; the last checkpoint {latest} is intact" if latest else ""
        raise EnvironmentFault(f"cannot write the {what} in {run.output_dir}{where}: "
                               f"{err.strerror or err}{kept}") from None


def check_finite_weights(run: Run) -> None:
    """No file the run writes may hold a NaN or infinite weight (checked on every shard)."""
    local = [(p.detach().to_local() if hasattr(p, "to_local") else p.detach()) for p in run.trainable]
    broken = torch.stack([(~t.isfinite()).any() for t in local]).any().double()
    if all_reduce_max(broken).item():
        raise TrainingDiverged(f"step {run.state.step}: a trainable weight is not finite; nothing was saved")


def finish(run: Run) -> TrainResult:
    """The final model, a greedy sample of a held-out conversation, and the summary."""
    check_finite_weights(run)
    model_state = gathered_model_state(run)

    def write(folder: Path) -> None:
        with written(run, "final model"):
            save_pretrained(folder, run.model, run.tokenizer, state_dict=model_state)

    final_dir = write_atomic_dir(run.output_dir / "final", write)
    # A sharded model cannot generate on one rank; the sample is for single-process runs.
    sample = greedy_sample(run) if run.eval_examples and not run.topology.distributed else None
    if run.topology.is_main and importlib.util.find_spec("matplotlib") is not None:
        run.metrics.close()  # flushed and complete before it is read
        plot_metrics(run.output_dir / "metrics.jsonl", run.output_dir / "loss.png")
    result = TrainResult(run.output_dir, final_dir, run.state.step, run.last_loss, run.eval_losses, sample,
                         skipped_steps=run.state.skipped_steps, spikes=run.state.spikes)
    show_summary(run, result)
    return result


def cleanup(run: Run) -> None:
    if run.offload is not None:
        run.offload.remove()
    run.metrics.close()
    run.spikes.close()
    if run.reporters is not None:
        run.reporters.close()
    if run.lock is not None:
        run.lock.release()


# --------------------------------------------------------------------------------------------------
# forward and backward


def make_batch(run: Run, packs: list[Pack]) -> Batch | PaddedBatch:
    """One micro-batch on the device: a flattened row for packed attention, else padded rows
    (one conversation each: the recipe check refuses packing without packed attention)."""
    if run.recipe.model.attention == "packed":
        return collate(packs).to(run.device)
    return collate_padded(packs, pad_token_id(run.tokenizer)).to(run.device)


def real_tokens(batch: Batch | PaddedBatch) -> int | torch.Tensor:
    """Tokens that are not padding (a device tensor for a padded batch: counted without a sync)."""
    if isinstance(batch, Batch):
        return batch.num_tokens
    return batch.attention_mask.sum()


def squared_lengths(batch: Batch | PaddedBatch) -> int | torch.Tensor:
    """The sum of the squared lengths of the batch's conversations, what causal attention costs
    (a device tensor for a padded batch: counted without a sync)."""
    if isinstance(batch, Batch):
        lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]  # on the host
        return int(lengths.long().square().sum())
    return batch.attention_mask.sum(dim=1).square().sum()


def cluster_peak_tflops(device: torch.device, topology: Topology) -> float | None:
    """The peak of all the run's devices together, when the device's is known."""
    peak = device_peak_tflops(device)
    return peak * topology.world_size if peak else None


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def conversation_ids(batch: Batch | PaddedBatch) -> torch.Tensor:
    """The conversation each token belongs to: `seq_ids` of a flattened row, the row of a padded one."""
    if isinstance(batch, Batch):
        return batch.seq_ids
    rows, width = batch.input_ids.shape
    return torch.arange(rows, device=batch.input_ids.device).repeat_interleave(width)


def forward_backward(run: Run, batches: list[Batch | PaddedBatch], *, backward: bool) -> dict[str, torch.Tensor]:
    """Forward (and backward) over the micro-batches of one step with step-level weights."""
    loss_cfg = run.recipe.loss
    weights = step_token_weights(
        [b.targets for b in batches], [conversation_ids(b) for b in batches], loss_cfg.normalization,
        ignore_index=loss_cfg.ignore_index,
    )
    totals = {name: torch.zeros((), device=run.device) for name in ("loss", "z_loss", "n_correct", "n_tokens")}
    for i, (batch, w) in enumerate(zip(batches, weights)):
        if isinstance(batch, Batch):
            boundaries = {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen}
        else:
            boundaries = {"attention_mask": batch.attention_mask}
        with accumulating(run.engine, last=i == len(batches) - 1):
            out = run.engine(batch.input_ids, batch.position_ids, batch.targets, w, **boundaries)
            if backward:
                out.loss.backward()
        totals["loss"] += out.loss.detach().float()
        totals["z_loss"] += out.z_loss.detach().float()
        totals["n_correct"] += out.n_correct
        totals["n_tokens"] += out.n_tokens
    return totals


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out cross-entropy (normalized like training, over the whole held-out set) and accuracy."""
    run.engine.eval()
    size = run.recipe.train.micro_batch_size
    packs = eval_share(run.data.eval_packs, run.topology)
    batches = [make_batch(run, packs[i : i + size]) for i in range(0, len(packs), size)]
    totals = forward_backward(run, batches, backward=False)
    run.engine.train()
    loss, z_loss, n_correct, n_tokens = all_reduce_sum(torch.stack(
        [totals[k].double() for k in ("loss", "z_loss", "n_correct", "n_tokens")])).tolist()
    return {"eval_loss": loss - z_loss, "eval_token_accuracy": n_correct / max(n_tokens, 1)}


def eval_share(packs: list[Pack], topology: Topology) -> list[Pack]:
    """This rank's held-out packs. Every rank must run as many forwards (sharded layers gather their
    weights together), so the shares are made equal with packs that carry no loss."""
    world = topology.world_size
    if world == 1:
        return packs
    padded = list(packs) + [without_targets(packs[0])] * (-len(packs) % world)
    return split_packs(padded, world)[topology.rank]


def without_targets(pack: Pack) -> Pack:
    return Pack(pack.input_ids, [IGNORE_INDEX] * len(pack.targets), pack.seq_lens)


# --------------------------------------------------------------------------------------------------
# the end of a run


def run_peak_memory_gib(run: Run) -> float:
    """The run's peak so far: the device's, and the planner's of the steps it measured (it resets
    the device's counter to measure them)."""
    planned = run.checkpointing.peak_seen / 2**30 if isinstance(run.checkpointing, CheckpointPlanner) else 0.0
    return max(peak_memory_gib(run.device), planned)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


@torch.no_grad()
def greedy_sample(run: Run, tail_chars: int = 300) -> tuple[str, str, str]:
    """The first held-out conversation's last trained turn, answered greedily by the model.

    Returns (the end of the rendered conversation before that turn, the reference turn, the answer).
    """
    example = run.eval_examples[0]
    labels = example.labels
    end = max(i for i, label in enumerate(labels) if label != -100) + 1
    start = end - 1
    while start > 0 and labels[start - 1] != -100:
        start -= 1
    prompt_ids = example.input_ids[:start]
    reference = run.tokenizer.decode(example.input_ids[start:end], skip_special_tokens=True)
    model = run.head.model
    model.eval()
    input_ids = torch.tensor([prompt_ids], device=run.device)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=end - start + 16,
        do_sample=False,
        eos_token_id=run.tokenizer.eos_token_id,
        pad_token_id=pad_token_id(run.tokenizer),
    )
    model.train()
    answer = run.tokenizer.decode(output[0, len(prompt_ids):], skip_special_tokens=True)
    prompt = run.tokenizer.decode(prompt_ids, skip_special_tokens=False).rstrip()
    return prompt[-tail_chars:], reference, answer


def show_summary(run: Run, result: TrainResult) -> None:
    rows = [("steps", str(result.steps))]
    if result.skipped_steps:
        rows.append(("skipped steps", f"{result.skipped_steps} (non-finite loss or gradient, or a skipped spike)"))
    if result.spikes:
        rows.append(("loss spikes", f"{result.spikes} ({run.output_dir / SPIKES})"))
    if result.train_loss is not None:
        rows.append(("final train loss", f"{result.train_loss:.4f}"))
    if result.eval_losses:
        first, last = result.eval_losses[0][1], result.eval_losses[-1][1]
        rows.append(("eval loss", f"{first:.4f} -> {last:.4f} ({last / first:.0%} of the first)"))
    rows.append(("peak memory", f"{run_peak_memory_gib(run):.2f} GiB"))
    rows.append(("output", str(result.final_dir)))
    run.console.print(summary_table(rows))
    if result.sample:
        run.console.print(sample_table(*result.sample))
