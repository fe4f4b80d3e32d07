"""A training run: setup -> loop -> finish.

    run = setup(recipe, console)          # the recipe's data, model, step and outputs; a checkpoint restored
    result = train_loop(run)               # steps around the run's state; evaluate, save, log; finish

The loop is made of steps around the run's state (`RunState`: step, epoch, position in the epoch's
order):

    while state.step < total_steps:
        stats = train_step(run, next_batches(run))    # ligertune.training.step
        record = log(run, stats)                       # metrics.jsonl and the live line
        maybe_evaluate(run)                            # held-out metrics every `eval_every` steps
        maybe_save(run)                                # a checkpoint every `save_every` steps

The step returns its numbers and writes nothing; the loop writes them through the run's outputs
(`ligertune.training.outputs`: real on rank 0, inert elsewhere) and saves through
`ligertune.training.checkpoint`.
"""

from __future__ import annotations

import resource
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from rich.console import Console

from ligertune.devices import describe_device, synchronize
from ligertune.distributed import (
    PeerWatch,
    PeersLost,
    Topology,
    all_reduce_max,
    destroy_process_group,
    finished_together,
    gather_objects,
    init_process_group,
    together,
    topology_from_environment,
)
from ligertune.errors import first_line
from ligertune.flops import device_peak_tflops
from ligertune.kernels import active_path
from ligertune.metrics import read_metrics
from ligertune.models import decoder_of, load_tokenizer, unpatch_model
from ligertune.models.lora import unpatch_lora
from ligertune.models.quantize import parameter_count
from ligertune.objectives.reference import (
    REFERENCE_FILE,
    cached_path,
    compute_reference_logps,
    load_cached,
    load_reference_logps,
    reference_key,
    save_reference_logps,
)
from ligertune.recipe import Recipe, dump_recipe
from ligertune.training.build import (
    build_data,
    build_device,
    build_medusa_heads,
    build_model,
    build_reference_model,
    build_run,
    build_teacher_model,
    describe_float8,
    fsdp_dtypes,
    optimizer_warnings,
    packs_per_step,
    schedule_warnings,
    strategy,
    total_steps,
)
from ligertune.training.checkpoint import (
    find_checkpoint,
    latest_checkpoint,
    load_heads_weights,
    load_model_weights,
    remove_stale_temporaries,
    restore_checkpoint,
    save_checkpoint,
    save_final,
)
from ligertune.training.display import TrainProgress, sample_table, summary_table
from ligertune.training.evaluation import evaluate, greedy_sample
from ligertune.training.memory import CheckpointPlanner
from ligertune.training.outputs import METRICS, SPIKES, Outputs
from ligertune.training.precision import optimizer_memory
from ligertune.training.resume import check_resumable, check_same_data, fit_world_size
from ligertune.training.run import Run, RunInterrupted, StepStats, TrainingDiverged, TrainResult
from ligertune.training.run_dir import check_output_dir
from ligertune.training.step import next_batches, train_step
from ligertune.training.throughput import Clock, Throughput


def train(
    recipe: Recipe,
    *,
    console: Console | None = None,
    resume: str | Path | None = None,
    resume_command: str | None = None,
    clock: Clock = time.perf_counter,
    on_peers_lost: Callable[[PeersLost], None] | None = None,
) -> TrainResult:
    """Train the recipe's model on its data; write metrics, checkpoints and the final model to
    `output.dir`. `resume` ("latest" or a checkpoint path) continues an earlier run exactly. With
    several processes, one that stops during the run (killed, crashed, its node gone) ends the others
    with `PeersLost` naming it; the last checkpoint stays complete. A process whose collective never
    fails (NCCL waits for a lost peer without end) ends by itself instead, after `on_peers_lost` has
    reported it (`PeerWatch`; by default the line is printed)."""
    console = console or Console(stderr=False)
    transformers.utils.logging.disable_progress_bar()  # the run has its own display
    try:
        # A collective that fails because another process stopped is `PeersLost`, naming it.
        with PeerWatch(topology_from_environment(), on_lost=on_peers_lost or _print_lost):
            run = setup(recipe, console, resume=resume, clock=clock)
            if resume_command:
                run.resume_command = resume_command
            try:
                with StopSignals() as stop:
                    result = train_loop(run, stop)
                finished_together()
                return result
            finally:
                cleanup(run)
    finally:
        destroy_process_group()


def _print_lost(lost: PeersLost) -> None:
    print(f"error: {lost}", file=sys.stderr)


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

    def find() -> tuple[Path | None, dict | None, Recipe, str | None]:
        if topology.is_main:
            check_output_dir(output_dir, resume=resume is not None, overwrite=recipe.output.overwrite)
        if resume is None:
            return None, None, recipe, None
        checkpoint, saved = find_checkpoint(output_dir, resume, notice=lambda text: console.print(text, markup=False))
        fitted, resized = fit_world_size(saved, recipe, world_size=topology.world_size)
        check_resumable(saved, fitted, checkpoint, world_size=topology.world_size)
        return checkpoint, saved, fitted, resized

    checkpoint, saved, recipe, resized = together(find)
    cfg = recipe.train
    torch.manual_seed(cfg.seed)
    # bf16 (or fp16) compute over float32 master weights, sharded; a LoRA base stays 16-bit.
    dtypes = fsdp_dtypes(recipe, device.type, sharded=topology.distributed and strategy(recipe) == "fsdp")

    def build() -> tuple:
        tokenizer = load_tokenizer(recipe.model)
        data = build_data(recipe, tokenizer, show_progress=topology.is_main)
        if saved is not None:
            check_same_data(saved, packs=len(data.train_packs), digest=data.train_digest,
                            checkpoint=checkpoint)
        built = build_model(recipe, device=device, vocab_size=len(tokenizer),
                            dtype=dtypes.model, trainable_dtype=dtypes.trainable)
        if checkpoint is not None and recipe.objective.trains_backbone:  # else the recipe's model, unchanged
            load_model_weights(built.module, checkpoint)
        heads = build_medusa_heads(recipe, built.module, dtype=dtypes.trainable)
        if checkpoint is not None and heads is not None:
            load_heads_weights(heads, checkpoint)
        reference = build_reference_model(recipe, device=device, vocab_size=len(tokenizer), dtype=dtypes.model)
        teacher = build_teacher_model(recipe, tokenizer, device=device, dtype=dtypes.compute or built.dtype)
        return tokenizer, data, built, reference, teacher, heads

    tokenizer, data, built, reference_model, teacher_model, medusa_heads = together(build)
    run = build_run(
        recipe, built.module, device=device, topology=topology, mixed_precision=dtypes.compute,
        reference_model=reference_model, teacher_model=teacher_model, medusa_heads=medusa_heads,
        total_steps=total_steps(cfg, len(data.train_packs), topology.world_size),
        tokenizer=tokenizer, data=data, output_dir=output_dir,
        meter=Throughput(device, clock, peak_tflops=cluster_peak_tflops(device, topology)),
    )

    def open_outputs() -> Outputs:
        if not topology.is_main:
            return Outputs.inert()
        remove_stale_temporaries(output_dir)
        return Outputs.open(output_dir, console, recipe_text=dump_recipe(recipe),
                            replace=recipe.output.overwrite and resume is None,
                            resume_after=saved["run"]["step"] if saved is not None else None,
                            spike_watch=cfg.spike_threshold is not None,
                            report_to=recipe.output.report_to, config=recipe.to_dict())

    run.out = together(open_outputs)
    describe_run(run, dtypes.compute or built.dtype, built.patches.describe() if built.patches else "none")
    if recipe.objective.reference_mode == "precomputed":
        attach_reference(run, resumed=checkpoint is not None)
    if checkpoint is not None:
        restore_checkpoint(run, checkpoint, saved)
        run.out.print(f"resumed from {checkpoint} at step {run.state.step} "
                      f"(epoch {run.state.epoch}, pack {run.state.index})" + (f"; {resized}" if resized else ""))
    return run


def attach_reference(run: Run, *, resumed: bool) -> None:
    """The reference log-probabilities of every train and held-out answer on their packs
    (`ligertune.objectives.reference`): on `--resume`, read back from the run's folder; else read
    from the data cache when the same model and data were scored before, or computed by the starting
    model before the first step; then saved in the run's folder (and the cache)."""
    path = run.output_dir / REFERENCE_FILE
    data = run.data
    if resumed:
        load_reference_logps(path, data.train_packs, data.eval_packs)
        return
    cache_dir = run.recipe.data.cache_dir
    key = reference_key(run.recipe, data.train_packs, data.eval_packs, device=run.device,
                        world_size=run.topology.world_size)
    cached = cached_path(cache_dir, key) if cache_dir is not None and key is not None else None
    answers = (f"{sum(p.num_answers for p in data.train_packs):,} train and "
               f"{sum(p.num_answers for p in data.eval_packs):,} held-out answers")
    if cached is not None and all(gather_objects(load_cached(cached, key, data.train_packs, data.eval_packs))):
        run.out.print(f"reference: log-probabilities of {answers} read from {cached}")
    else:
        with run.meter.excluded():
            started = time.perf_counter()
            # Held-out packs one a forward, as evaluation scores them: the policy's sums before the
            # first step are then the reference's to the bit (`ligertune.training.evaluation`).
            compute_reference_logps(run.engine, data.train_packs, run.device, run.topology,
                                    packs_per_forward=run.recipe.train.micro_batch_size)
            compute_reference_logps(run.engine, data.eval_packs, run.device, run.topology)
            synchronize(run.device)
            seconds = time.perf_counter() - started
        if run.topology.is_main and cached is not None:
            try:
                save_reference_logps(cached, data.train_packs, data.eval_packs, key)
            except OSError as err:  # a cache that cannot be written costs the next run a pass, no more
                run.out.print(f"reference: not cached ({first_line(err)})")
        run.out.print(f"reference: log-probabilities of {answers} from the starting model in {seconds:.1f} s")
    if run.topology.is_main:
        save_reference_logps(path, data.train_packs, data.eval_packs, key)


def cluster_peak_tflops(device: torch.device, topology: Topology) -> float | None:
    """The peak of all the run's devices together, when the device's is known."""
    peak = device_peak_tflops(device)
    return peak * topology.world_size if peak else None


def describe_run(run: Run, dtype: torch.dtype, patches: str) -> None:
    """The lines printed before the first step: model, kernels, data."""
    recipe, data, out = run.recipe, run.data, run.out
    n_params = parameter_count(run.model)  # a quantized weight as the matrix it stands for
    n_trainable = sum(p.numel() for p in run.trainable)
    real = sum(len(p.input_ids) for p in data.train_packs)
    slots = len(data.train_packs) * recipe.data.max_seq_len
    per_step = packs_per_step(recipe.train, run.topology.world_size)
    out.print(f"[bold]ligertune[/] model {type(run.model).__name__} {n_params / 1e6:.2f}M params "
              f"({n_trainable / 1e6:.2f}M trainable), {dtype}, "
              f"{describe_device(run.device, run.topology.world_size)}", markup=True)
    out.print(f"kernels: {patches}; fused loss: {'on' if run.head.fused else 'off'} "
              f"({active_path(run.device)} path)")
    if recipe.train.precision == "fp8":
        out.print(f"fp8: {describe_float8(recipe, run.model)}; the rest in {dtype}")
    out.print(
        f"data: {len(data.train_examples)} train / {len(data.eval_examples)} eval {recipe.objective.units}, "
        f"{len(data.train_packs)} packs of {recipe.data.max_seq_len} ({real / max(slots, 1):.1%} full), "
        f"{run.total_steps} step{'s' * (run.total_steps != 1)} of {per_step} pack{'s' * (per_step != 1)}"
    )
    policy = run.checkpointing
    if isinstance(policy, CheckpointPlanner):
        out.print(f"gradient checkpointing: auto, {policy.budget_gib:.1f} GiB budget; the first "
                  "step measures the layers' activations")
    elif policy is not None:
        layers = len(decoder_of(run.model).layers)
        offloaded = f", the inputs of {run.offload.parked_count} in host memory" if run.offload else ""
        out.print(f"gradient checkpointing: {policy} of {layers} layers recomputed{offloaded}"
                  + ("" if recipe.train.gradient_checkpointing is True else
                     " (auto: no device memory to budget on a CPU)"))
    if run.topology.distributed:
        out.print(f"processes: {run.topology.world_size}, {strategy(recipe)}, "
                  f"{packs_per_step(recipe.train)} packs each per step")
    memory = optimizer_memory(run.trainable, recipe.optim.name, master_weights=recipe.optim.master_weights)
    out.print(memory.describe())
    for warning in [*data.warnings, *schedule_warnings(recipe.optim, run.total_steps),
                    *optimizer_warnings(recipe, {p.dtype for p in run.trainable})]:
        out.warn(warning)


# --------------------------------------------------------------------------------------------------
# the loop


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the step under way (`requested`); a second
    signal stops at once (`StoppedAtOnce`). Outside the main thread, signals are left alone."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None:
            raise StoppedAtOnce(signum)
        self.requested = signum


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: the run stops where it is; a checkpoint being written is dropped
    whole, and the last complete one stays `latest`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def train_loop(run: Run, stop: StopSignals | None = None) -> TrainResult:
    cfg = run.recipe.train
    run.head.train()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with TrainProgress(run.console, run.total_steps, initial_step=run.state.step) as progress:
        if run.state.step == 0 and run.data.eval_packs and cfg.eval_at_start:
            evaluate_and_log(run, progress)
        run.meter.start()
        first_step, saved = run.state.step, None
        while run.state.step < run.total_steps:
            if requested := stop_requested(run, stop):
                if run.state.step == first_step:  # asked before this process trained a step
                    raise StoppedAtOnce(requested)
                raise RunInterrupted(requested, run.state.step, saved or save(run), run.resume_command)
            stats = train_step(run, next_batches(run))
            if stats.news:
                run.out.print(stats.news)
            record = log(run, stats)
            check_not_diverged(run)
            result = maybe_evaluate(run, progress)
            if record is not None and result is not None:
                record = {**record, **result}
            saved = maybe_save(run)  # the checkpoint a stop at the next step's start reuses
            progress.advance(run.state.step, record)
    return finish(run)


def stop_requested(run: Run, stop: StopSignals | None) -> int:
    """The signal that asks the run to stop (0 for none), the same on every rank: a rank that got
    it tells the others, so that all stop after the same step."""
    requested = (stop.requested or 0) if stop is not None else 0
    if run.topology.distributed:
        requested = int(all_reduce_max(torch.tensor(float(requested), device=run.device)).item())
    return requested


def check_not_diverged(run: Run) -> None:
    """Stop the run after `train.max_skipped_steps` skipped steps in a row."""
    cfg, state = run.recipe.train, run.state
    if state.consecutive_skips < cfg.max_skipped_steps:
        return
    latest = latest_checkpoint(run.output_dir)
    spikes = " or a loss spike (train.on_spike: skip)" if cfg.on_spike == "skip" else ""
    raise TrainingDiverged(
        f"step {state.step}: {state.consecutive_skips} steps in a row had a non-finite loss or gradient "
        f"norm{spikes}, so the run stopped; likely causes: a learning rate too high (optim.lr), an "
        "epsilon too small for the dtype (optim.eps), or broken data in these steps; "
        + (f"the last good checkpoint is {latest}" if latest else "no checkpoint was written")
    )


def log(run: Run, stats: StepStats) -> dict | None:
    """Count the step's tokens; every `log_every` steps, at the last step and at every skipped or
    spiking step write its metrics record (and a spike's record to spikes.jsonl)."""
    run.meter.add(stats.real_tokens, stats.tokens, stats.flops, stats.units)
    step = run.state.step
    if stats.spike is not None:
        write_spike(run, stats)
    if step % run.recipe.train.log_every and step != run.total_steps and not stats.skipped and not stats.spike:
        return None
    rates = run.meter.lap()
    record = {
        "step": step,
        **stats.metrics,
        "tokens": stats.tokens,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "clipped": stats.clipped > 0,
        "tokens_per_s": rates.tokens_per_s,
        "trained_tokens_per_s": rates.trained_tokens_per_s,
        "peak_mem_gib": run_peak_memory_gib(run),
    }
    if run.objective.units:
        record[f"{run.objective.units[1]}_per_s"] = rates.units_per_s
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
        run.state.last_loss = stats.loss
    run.out.record(record)
    return record


def checkpointed_layers(policy: CheckpointPlanner | int) -> int:
    if isinstance(policy, CheckpointPlanner):
        return policy.plan.checkpointed if policy.plan else len(policy.layers)
    return policy


def write_spike(run: Run, stats: StepStats) -> None:
    """A spike's record in spikes.jsonl: the step, its loss against the window's median and robust
    deviation, what was done, and the origin (`file:line`, `file:row N` or `dataset[split]:row N`)
    of every conversation of the step, all ranks' packs together."""
    spike = stats.spike
    examples = run.data.train_examples
    run.out.spike({
        "step": run.state.step,
        "loss": spike.loss,
        "median": spike.median,
        "deviation": spike.deviation,
        "score": spike.score,
        "threshold": run.recipe.train.spike_threshold,
        "action": "skipped" if stats.skipped == "spike" else "logged",
        "conversations": [examples[i].origin for pack in run.step_packs for i in pack.example_indices],
    })


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
    run.state.eval_losses.append((step, result["eval_loss"]))
    run.out.record({"step": step, **result, "eval_s": timing["seconds"]})
    shown = [f"{name.removeprefix('eval_').replace('_', ' ')} {format_metric(name, value)}"
             for name, value in result.items()]
    progress.log(f"step {step}: eval " + ", ".join(shown))
    return result


def format_metric(name: str, value: float) -> str:
    return f"{value:.1%}" if name.endswith("accuracy") else f"{value:.4f}"


def maybe_save(run: Run) -> Path | None:
    """A checkpoint every `save_every` steps (the last step's model is written by `finish`)."""
    every, step = run.recipe.train.save_every, run.state.step
    if every and step % every == 0 and step != run.total_steps:
        return save(run)
    return None


def save(run: Run) -> Path:
    """A checkpoint of the run at this step, timed apart from the throughput window, and its record."""
    with run.meter.excluded() as timing:
        path = save_checkpoint(run)
    run.out.record({"step": run.state.step, "checkpoint": str(path.relative_to(run.output_dir)),
                    "save_s": timing["seconds"]})
    return path


# --------------------------------------------------------------------------------------------------
# the end of a run


def finish(run: Run) -> TrainResult:
    """The final model, a greedy sample of a held-out conversation, and the summary."""
    final_dir = save_final(run)
    # A sharded model cannot generate on one rank; the sample is for single-process runs.
    sample = greedy_sample(run) if run.data.eval_examples and not run.topology.distributed else None
    if run.recipe.output.plot:
        run.out.plot()
    state = run.state
    result = TrainResult(run.output_dir, final_dir, state.step, state.last_loss, state.eval_losses, sample,
                         skipped_steps=state.skipped_steps, spikes=state.spikes)
    show_summary(run, result)
    return result


def cleanup(run: Run) -> None:
    """Undo what the run changed outside itself: the offload hooks, the kernel patches (the RoPE
    redirect lives in the model family's module, where it would reach a later model of the same
    process) and the open outputs."""
    if run.offload is not None:
        run.offload.remove()
    unpatch_lora(run.model)
    unpatch_model(run.model)
    teacher = getattr(run.objective, "teacher", None)
    if teacher is not None:
        unpatch_model(teacher.module.model)
    run.out.close()


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


def held_out_trend(records: Sequence[dict], names: Sequence[str]) -> list[tuple[str, str]]:
    """`eval <name>: first -> last` for each of the held-out metrics `names` (a preference run's
    rewards; a distilled student's own loss and accuracy; Medusa heads' accuracies and accepted
    length), from the run's metrics records."""
    records = [r for r in records if "eval_loss" in r]
    rows = []
    for name in names:
        values = [r[f"eval_{name}"] for r in records if f"eval_{name}" in r]
        if values:
            percent = name.endswith("accuracy")
            signed = name.startswith("reward")  # a reward or a margin may lie either side of 0
            show = ((lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:.3f} tokens") if name == "accepted_length"
                    else (lambda v: f"{v:+.4f}") if signed else (lambda v: f"{v:.4f}"))
            rows.append((f"eval {name.replace('_', ' ')}", f"{show(values[0])} -> {show(values[-1])}"))
    return rows


def median_rates(records: Sequence[dict], units: str | None) -> str | None:
    """The median rates of a run's logged windows (`units`: the objective's, "pairs" or "examples",
    before the tokens), or None before any window was logged."""
    windows = [r for r in records if "tokens_per_s" in r]
    if not windows:
        return None
    rates = []
    if units is not None and all(f"{units}_per_s" in r for r in windows):
        rates.append(f"{statistics.median(r[f'{units}_per_s'] for r in windows):,.2f} {units}/s")
    rates.append(f"{statistics.median(r['tokens_per_s'] for r in windows):,.0f} tokens/s")
    if all(r.get("mfu") is not None for r in windows):
        rates.append(f"MFU {statistics.median(r['mfu'] for r in windows):.1%}")
    plural = "s" if len(windows) > 1 else ""
    return f"{', '.join(rates)} (median of {len(windows)} logged window{plural})"


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
        share = f" ({last / first:.0%} of the first)" if first > 0 else ""
        rows.append(("eval loss", f"{first:.4f} -> {last:.4f}{share}"))
    records = read_metrics(run.output_dir / METRICS) if run.topology.is_main else []  # written by rank 0
    if run.recipe.objective.name != "sft" and records:
        watched = ("reward_accuracy", "reward_margin", "reward_desirable", "reward_undesirable", "ce",
                   "token_accuracy", "lm_accuracy", "accepted_length")
        heads = [n for n in run.objective.held_out if n.startswith("head") and n.endswith("_accuracy")]  # Medusa's
        rows += held_out_trend(records, [n for n in run.objective.held_out if n in watched or n in heads])
    if records:
        units = run.objective.units[1] if run.objective.units else None
        rates = median_rates(records, units)
        if rates is not None:
            rows.append(("throughput", rates))
    rows.append(("peak memory", f"{run_peak_memory_gib(run):.2f} GiB"))
    rows.append(("output", str(result.final_dir)))
    run.out.print(summary_table(rows))
    if result.sample:
        run.out.print(sample_table(*result.sample, preference=run.recipe.objective.preference))
