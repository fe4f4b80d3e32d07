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
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import transformers
from rich.console import Console

from ligertune.data import Batch, Pack, PaddedBatch, TokenizedExample, collate, collate_padded
from ligertune.devices import synchronize
from ligertune.errors import UserError
from ligertune.kernels import active_path
from ligertune.models import CausalLMLoss, load_tokenizer
from ligertune.recipe import Recipe, dump_recipe
from ligertune.training.build import (
    TrainingData,
    build_data,
    build_device,
    build_head,
    build_model,
    build_optimizer,
    build_scheduler,
    packs_per_step,
    total_steps,
)
from ligertune.training.checkpoint import MetricsLog, save_model, write_atomic_text
from ligertune.training.display import TrainProgress, sample_table, summary_table
from ligertune.training.loss_weights import step_token_weights
from ligertune.training.state import PackStream, RunState

Clock = Callable[[], float]


@dataclass
class TrainResult:
    """What a finished run left behind and how it went."""

    output_dir: Path
    final_dir: Path
    steps: int
    train_loss: float | None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: tuple[str, str, str] | None = None


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
    lr: float
    grad_norm: float


class Throughput:
    """Tokens per second over a logging window.

    Wall clock with the device synchronized at both ends of the window (so the GPU's queued work is
    counted, not the host's launching of it), minus the time spent in evaluation and checkpoints,
    which is measured apart (`excluded`).
    """

    def __init__(self, device: torch.device, clock: Clock = time.perf_counter):
        self.device, self.clock = device, clock
        self.start()

    def start(self) -> None:
        synchronize(self.device)
        self._start, self._excluded = self.clock(), 0.0
        self.real_tokens = self.trained_tokens = 0

    def add(self, real_tokens: int, trained_tokens: int) -> None:
        self.real_tokens += real_tokens
        self.trained_tokens += trained_tokens

    @contextlib.contextmanager
    def excluded(self) -> Iterator[dict]:
        """Time the block apart from the window; its seconds land in the yielded dict's `seconds`."""
        synchronize(self.device)
        began = self.clock()
        timing: dict = {}
        try:
            yield timing
        finally:
            synchronize(self.device)
            timing["seconds"] = self.clock() - began
            self._excluded += timing["seconds"]

    def lap(self) -> tuple[float, float]:
        """(real tokens/s, trained tokens/s) of the window so far; a new window starts."""
        synchronize(self.device)
        elapsed = max(self.clock() - self._start - self._excluded, 1e-9)
        rates = self.real_tokens / elapsed, self.trained_tokens / elapsed
        self.start()
        return rates


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
    last_loss: float | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = PackStream(self.data.train_packs, self.recipe.train.seed)

    @property
    def eval_examples(self) -> list[TokenizedExample]:
        return self.data.eval_examples

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def train(recipe: Recipe, *, console: Console | None = None, clock: Clock = time.perf_counter) -> TrainResult:
    """Train the recipe's model on its data; write metrics and the final model to `output.dir`."""
    console = console or Console(stderr=False)
    transformers.utils.logging.disable_progress_bar()  # the run has its own display
    run = setup(recipe, console, clock=clock)
    try:
        return train_loop(run)
    finally:
        cleanup(run)


# --------------------------------------------------------------------------------------------------
# setup


def prepare_output_dir(path: Path, overwrite: bool) -> Path:
    if (path / "final").exists() and not overwrite:
        raise UserError(
            f"output.dir: {path} already holds a finished run (final/); choose another with "
            "--output-dir or allow it with --set output.overwrite=true"
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


def setup(recipe: Recipe, console: Console, *, clock: Clock = time.perf_counter) -> Run:
    cfg = recipe.train
    device = build_device(cfg)
    torch.manual_seed(cfg.seed)
    output_dir = prepare_output_dir(Path(recipe.output.dir), recipe.output.overwrite)

    tokenizer = load_tokenizer(recipe.model)
    data = build_data(recipe, tokenizer)
    built = build_model(recipe, device=device, vocab_size=len(tokenizer))
    model = built.module
    head = build_head(model, recipe.kernels, recipe.loss)
    optimizer = build_optimizer(model, recipe.optim)
    steps = total_steps(cfg, len(data.train_packs))
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps=steps)

    write_atomic_text(output_dir / "recipe.yaml", dump_recipe(recipe))
    run = Run(
        recipe=recipe, device=device, console=console, tokenizer=tokenizer, model=model, head=head,
        optimizer=optimizer, scheduler=scheduler, data=data, total_steps=steps, output_dir=output_dir,
        metrics=MetricsLog(output_dir / "metrics.jsonl"), meter=Throughput(device, clock),
    )
    describe_run(run, built.dtype, built.patches.describe() if built.patches else "none")
    return run


def describe_run(run: Run, dtype: torch.dtype, patches: str) -> None:
    """The lines printed before the first step: model, kernels, data."""
    recipe, data = run.recipe, run.data
    n_params = sum(p.numel() for p in run.model.parameters())
    n_trainable = sum(p.numel() for p in run.trainable)
    real = sum(len(p.input_ids) for p in data.train_packs)
    slots = len(data.train_packs) * recipe.data.max_seq_len
    per_step = packs_per_step(recipe.train)
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


# --------------------------------------------------------------------------------------------------
# the loop


def train_loop(run: Run) -> TrainResult:
    cfg = run.recipe.train
    run.head.train()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with TrainProgress(run.console, run.total_steps, initial_step=run.state.step) as progress:
        if run.state.step == 0 and run.data.eval_packs and cfg.eval_at_start:
            evaluate_and_log(run, progress)
        run.meter.start()
        while run.state.step < run.total_steps:
            stats = train_step(run, next_batches(run))
            record = log(run, stats)
            result = maybe_evaluate(run, progress)
            if record is not None and result is not None:
                record = {**record, **result}
            maybe_save(run)
            progress.advance(run.state.step, record)
    return finish(run)


def next_batches(run: Run) -> list[Batch | PaddedBatch]:
    """The micro-batches of the next step, on the device."""
    size = run.recipe.train.micro_batch_size
    packs = run.stream.take(run.state, packs_per_step(run.recipe.train))
    return [make_batch(run, packs[i : i + size]) for i in range(0, len(packs), size)]


def train_step(run: Run, batches: list[Batch | PaddedBatch]) -> StepStats:
    """One optimizer step over `batches`: forward and backward with step-level loss weights, global
    gradient-norm clipping, the update and the schedule."""
    totals = forward_backward(run, batches, backward=True)
    max_norm = run.recipe.optim.max_grad_norm or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable, max_norm)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.state.step += 1
    # One transfer to the host for all of the step's numbers.
    n_real = sum(real_tokens(b) for b in batches)
    numbers = [totals["loss"], totals["z_loss"], totals["n_correct"], totals["n_tokens"],
               torch.as_tensor(n_real, device=run.device), grad_norm]
    loss, z_loss, n_correct, n_tokens, n_real, norm = torch.stack([x.double() for x in numbers]).tolist()
    return StepStats(
        loss=loss - z_loss, z_loss=z_loss, token_accuracy=n_correct / max(n_tokens, 1), tokens=int(n_tokens),
        real_tokens=int(n_real), lr=lr, grad_norm=norm,
    )


def log(run: Run, stats: StepStats) -> dict | None:
    """Count the step's tokens; every `log_every` steps (and at the last) write its metrics record."""
    run.meter.add(stats.real_tokens, stats.tokens)
    step = run.state.step
    if step % run.recipe.train.log_every and step != run.total_steps:
        return None
    tokens_per_s, trained_tokens_per_s = run.meter.lap()
    record = {
        "step": step,
        "loss": stats.loss,
        "z_loss": stats.z_loss,
        "token_accuracy": stats.token_accuracy,
        "tokens": stats.tokens,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "tokens_per_s": tokens_per_s,
        "trained_tokens_per_s": trained_tokens_per_s,
        "peak_mem_gib": peak_memory_gib(run.device),
    }
    run.last_loss = stats.loss
    run.metrics.write(record)
    return record


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
    run.metrics.write({"step": step, **result, "eval_s": timing["seconds"]})
    progress.log(f"step {step}: eval loss {result['eval_loss']:.4f}, "
                 f"token accuracy {result['eval_token_accuracy']:.1%}")
    return result


def maybe_save(run: Run) -> None:
    """A checkpoint every `save_every` steps (the last step's model is written by `finish`)."""
    every, step = run.recipe.train.save_every, run.state.step
    if every and step % every == 0 and step != run.total_steps:
        with run.meter.excluded():
            save_model(run.output_dir / "checkpoints" / f"step-{step}", run.model, run.tokenizer)


def finish(run: Run) -> TrainResult:
    """The final model, a greedy sample of a held-out conversation, and the summary."""
    final_dir = save_model(run.output_dir / "final", run.model, run.tokenizer)
    sample = greedy_sample(run) if run.eval_examples else None
    result = TrainResult(run.output_dir, final_dir, run.state.step, run.last_loss, run.eval_losses, sample)
    show_summary(run, result)
    return result


def cleanup(run: Run) -> None:
    run.metrics.close()


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
    for batch, w in zip(batches, weights):
        if isinstance(batch, Batch):
            boundaries = {"cu_seqlens": batch.cu_seqlens, "max_seqlen": batch.max_seqlen}
        else:
            boundaries = {"attention_mask": batch.attention_mask}
        out = run.head(batch.input_ids, batch.position_ids, batch.targets, w, **boundaries)
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
    run.head.eval()
    size = run.recipe.train.micro_batch_size
    packs = run.data.eval_packs
    batches = [make_batch(run, packs[i : i + size]) for i in range(0, len(packs), size)]
    totals = forward_backward(run, batches, backward=False)
    run.head.train()
    return {
        "eval_loss": (totals["loss"] - totals["z_loss"]).item(),
        "eval_token_accuracy": (totals["n_correct"] / totals["n_tokens"].clamp(min=1)).item(),
    }


# --------------------------------------------------------------------------------------------------
# the end of a run


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
    if result.train_loss is not None:
        rows.append(("final train loss", f"{result.train_loss:.4f}"))
    if result.eval_losses:
        first, last = result.eval_losses[0][1], result.eval_losses[-1][1]
        rows.append(("eval loss", f"{first:.4f} -> {last:.4f} ({last / first:.0%} of the first)"))
    rows.append(("peak memory", f"{peak_memory_gib(run.device):.2f} GiB"))
    rows.append(("output", str(result.final_dir)))
    run.console.print(summary_table(rows))
    if result.sample:
        run.console.print(sample_table(*result.sample))
