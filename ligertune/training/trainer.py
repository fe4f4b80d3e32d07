"""The training loop: setup -> train -> cleanup.

One optimizer step takes `grad_accum_steps` micro-batches of `micro_batch_size` packs each. Before
the first backward of a step, the per-token loss weights of the whole step are computed
(`normalization.step_token_weights`), so the step's loss and gradient are the same however the
step was cut (docs/loss.md).
"""

from __future__ import annotations

import itertools
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import transformers
from rich.console import Console

from ligertune.data import (
    Batch,
    Pack,
    PaddedBatch,
    TokenizedExample,
    collate,
    collate_padded,
    pack,
    prepare_data,
    shuffled,
)
from ligertune.errors import UserError
from ligertune.kernels import active_path
from ligertune.devices import resolve_device, resolve_dtype
from ligertune.models import CausalLMLoss, build_model, load_tokenizer, patch_model
from ligertune.recipe import LoraConfig, Recipe, dump_recipe
from ligertune.training.checkpoint import MetricsLog, save_model, write_atomic_text
from ligertune.training.display import TrainProgress, sample_table, summary_table
from ligertune.training.normalization import step_token_weights
from ligertune.training.optim import build_optimizer, build_scheduler


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
class Run:
    """Everything `setup` builds for the loop."""

    recipe: Recipe
    device: torch.device
    console: Console
    tokenizer: object
    model: torch.nn.Module
    head: CausalLMLoss
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_packs: list[Pack]
    eval_packs: list[Pack]
    eval_examples: list[TokenizedExample]
    total_steps: int
    output_dir: Path
    metrics: MetricsLog


def train(recipe: Recipe, *, console: Console | None = None) -> TrainResult:
    """Train the recipe's model on its data; write metrics and the final model to `output.dir`."""
    console = console or Console(stderr=False)
    transformers.utils.logging.disable_progress_bar()  # the run has its own display
    run = setup(recipe, console)
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


def setup(recipe: Recipe, console: Console) -> Run:
    cfg = recipe.train
    device = resolve_device(cfg.device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    output_dir = prepare_output_dir(Path(recipe.output.dir), recipe.output.overwrite)

    tokenizer = load_tokenizer(recipe.model)
    data = prepare_data(recipe.data, tokenizer, seed=cfg.seed)
    if not data.train:
        raise UserError("data: no trainable conversation left after masking and truncation")
    train_packs = pack(data.train, recipe.data.max_seq_len, packing=recipe.data.packing)
    eval_examples = data.eval[: cfg.eval_max_conversations] if cfg.eval_max_conversations else data.eval
    eval_packs = pack(eval_examples, recipe.data.max_seq_len, packing=recipe.data.packing)

    dtype = resolve_dtype(recipe.model.dtype, device)
    model = build_model(recipe.model, device=device, dtype=dtype, seed=cfg.seed, vocab_size=len(tokenizer))
    k = recipe.kernels
    patches = patch_model(model, rms_norm=k.rms_norm, rope=k.rope, swiglu=k.swiglu)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if recipe.lora is not None:
        model = wrap_lora(model, recipe.lora)

    head = CausalLMLoss(
        model,
        fused=k.fused_linear_cross_entropy,
        chunk_bytes=k.loss_chunk_mib * 2**20,
        label_smoothing=recipe.loss.label_smoothing,
        z_loss_weight=recipe.loss.z_loss_weight,
        ignore_index=recipe.loss.ignore_index,
    )
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, recipe.optim)
    packs_per_step = cfg.micro_batch_size * cfg.grad_accum_steps
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(train_packs) / packs_per_step))
    scheduler = build_scheduler(optimizer, total_steps, recipe.optim)

    write_atomic_text(output_dir / "recipe.yaml", dump_recipe(recipe))
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for _, p in trainable)
    real = sum(len(p.input_ids) for p in train_packs)
    slots = len(train_packs) * recipe.data.max_seq_len
    console.print(
        f"[bold]ligertune[/] model {type(model).__name__} {n_params / 1e6:.2f}M params "
        f"({n_trainable / 1e6:.2f}M trainable), {dtype}, {device.type}"
    )
    console.print(f"kernels: {patches.describe()}; fused loss: {'on' if head.fused else 'off'} "
                  f"({active_path(device)} path)")
    console.print(
        f"data: {len(data.train)} train / {len(eval_examples)} eval conversations, "
        f"{len(train_packs)} packs of {recipe.data.max_seq_len} ({real / max(slots, 1):.1%} full), "
        f"{total_steps} step{'s' * (total_steps != 1)} of {packs_per_step} pack{'s' * (packs_per_step != 1)}"
    )
    return Run(
        recipe=recipe, device=device, console=console, tokenizer=tokenizer, model=model, head=head,
        optimizer=optimizer, scheduler=scheduler, train_packs=train_packs, eval_packs=eval_packs,
        eval_examples=eval_examples, total_steps=total_steps, output_dir=output_dir,
        metrics=MetricsLog(output_dir / "metrics.jsonl"),
    )


def wrap_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    import peft

    lora = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias=cfg.bias,
        modules_to_save=cfg.modules_to_save,
        use_rslora=cfg.use_rslora,
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as err:
        raise UserError(f"lora: {err}") from None


# --------------------------------------------------------------------------------------------------
# train


def micro_batches(packs: list[Pack], size: int, seed: int) -> Iterator[list[Pack]]:
    """Endless micro-batches of `size` packs, reshuffled every epoch."""
    for epoch in itertools.count():
        order = shuffled(packs, seed=seed, epoch=epoch)
        for i in range(0, len(order), size):
            yield order[i : i + size]


def make_batch(run: Run, packs: list[Pack]) -> Batch | PaddedBatch:
    """One micro-batch on the device: a flattened row for packed attention, else padded rows
    (one conversation each: the recipe check refuses packing without packed attention)."""
    if run.recipe.model.attention == "packed":
        return collate(packs).to(run.device)
    return collate_padded(packs, pad_token_id(run.tokenizer)).to(run.device)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def conversation_ids(batch: Batch | PaddedBatch) -> torch.Tensor:
    """The conversation each token belongs to: `seq_ids` of a flattened row, the row of a padded one."""
    if isinstance(batch, Batch):
        return batch.seq_ids
    rows, width = batch.input_ids.shape
    return torch.arange(rows, device=batch.input_ids.device).repeat_interleave(width)


def run_step(run: Run, batches: list[Batch], *, backward: bool) -> dict[str, torch.Tensor]:
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
    batches = [make_batch(run, run.eval_packs[i : i + size]) for i in range(0, len(run.eval_packs), size)]
    totals = run_step(run, batches, backward=False)
    run.head.train()
    return {
        "eval_loss": (totals["loss"] - totals["z_loss"]).item(),
        "eval_token_accuracy": (totals["n_correct"] / totals["n_tokens"].clamp(min=1)).item(),
    }


def train_loop(run: Run) -> TrainResult:
    cfg = run.recipe.train
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = run.recipe.optim.max_grad_norm or float("inf")
    stream = micro_batches(run.train_packs, cfg.micro_batch_size, cfg.seed)
    eval_losses: list[tuple[int, float]] = []
    last_loss = None
    run.head.train()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def log_eval(step: int, progress: TrainProgress) -> dict:
        result = evaluate(run)
        eval_losses.append((step, result["eval_loss"]))
        run.metrics.write({"step": step, **result})
        progress.log(f"step {step}: eval loss {result['eval_loss']:.4f}, "
                     f"token accuracy {result['eval_token_accuracy']:.1%}")
        return result

    with TrainProgress(run.console, run.total_steps) as progress:
        if run.eval_packs and cfg.eval_at_start:
            log_eval(0, progress)
        window_tokens, window_start = 0, time.perf_counter()
        for step in range(1, run.total_steps + 1):
            batches = [make_batch(run, next(stream)) for _ in range(cfg.grad_accum_steps)]
            totals = run_step(run, batches, backward=True)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            lr = run.scheduler.get_last_lr()[0]
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            window_tokens += int(sum(b.targets.numel() if isinstance(b, Batch) else b.attention_mask.sum()
                                     for b in batches))

            record = None
            if step % cfg.log_every == 0 or step == run.total_steps:
                elapsed = time.perf_counter() - window_start
                n_tokens = totals["n_tokens"].item()
                record = {
                    "step": step,
                    "loss": (totals["loss"] - totals["z_loss"]).item(),
                    "z_loss": totals["z_loss"].item(),
                    "token_accuracy": totals["n_correct"].item() / max(n_tokens, 1),
                    "tokens": int(n_tokens),
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                    "peak_mem_gib": peak_memory_gib(run.device),
                }
                last_loss = record["loss"]
                run.metrics.write(record)
                window_tokens, window_start = 0, time.perf_counter()
            if run.eval_packs and cfg.eval_every and (step % cfg.eval_every == 0 or step == run.total_steps):
                result = log_eval(step, progress)
                if record is not None:
                    record = {**record, **result}
            if cfg.save_every and step % cfg.save_every == 0 and step != run.total_steps:
                save_model(run.output_dir / "checkpoints" / f"step-{step}", run.model, run.tokenizer)
            progress.advance(step, record)

    final_dir = save_model(run.output_dir / "final", run.model, run.tokenizer)
    sample = greedy_sample(run) if run.eval_examples else None
    result = TrainResult(run.output_dir, final_dir, run.total_steps, last_loss, eval_losses, sample)
    show_summary(run, result)
    return result


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


def cleanup(run: Run) -> None:
    run.metrics.close()
