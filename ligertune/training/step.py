"""One optimizer step of a run: its batches, forward and backward under the objective's step-level
weights, clipping, the spike watch, the update and the schedule.

    batches = next_batches(run)          # this rank's micro-batches of the next packs, on the device
    stats = train_step(run, batches)     # -> StepStats; the step writes no file and prints nothing

One optimizer step takes `grad_accum_steps` micro-batches of `micro_batch_size` packs each. Before
the first backward, the objective weighs every token of the whole step (`Objective.step_weights`),
after computing what else its loss needs of the whole step (`Objective.prepare_step`: KTO's
reference point z0), so the step's loss and gradient are the same however the step was cut
(docs/loss.md). `ligertune train`, `verify-loss` and `bench step` run this same step.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ligertune.data import (
    Batch,
    Pack,
    PaddedBatch,
    PreferenceBatch,
    collate,
    collate_padded,
    collate_preferences,
)
from ligertune.data.preference import PreferencePack
from ligertune.devices import device_count
from ligertune.distributed import accumulating, all_reduce_sum, split_packs
from ligertune.training.build import packs_per_step
from ligertune.training.clipping import clip_gradients
from ligertune.training.memory import CheckpointPlanner
from ligertune.training.run import Run, StepStats
from ligertune.training.spikes import find_spike, remember
from ligertune.training.state import RunState

# --------------------------------------------------------------------------------------------------
# batches


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


def make_batch(run: Run, packs: list[Pack]) -> Batch | PaddedBatch:
    """One micro-batch on the device: a flattened row for packed attention, else padded rows
    (one conversation each: the recipe check refuses packing without packed attention). Preference
    packs are one flattened row with each answer's own key range (`collate_preferences`)."""
    if packs and isinstance(packs[0], PreferencePack):
        return collate_preferences(packs).to(run.device)
    if run.recipe.model.attention == "packed":
        return collate(packs).to(run.device)
    return collate_padded(packs, pad_token_id(run.tokenizer)).to(run.device)


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def trained_part(batch: Batch | PaddedBatch | PreferenceBatch) -> Batch | PaddedBatch | PreferenceBatch:
    """What the step's forward and backward run of `batch`: all of it, but for KTO, whose
    mismatched completions go through a pass without gradient only (`PreferenceBatch.kto_parts`)."""
    return batch.kto_parts()[0] if isinstance(batch, PreferenceBatch) else batch


def real_tokens(batch: Batch | PaddedBatch) -> int | torch.Tensor:
    """Tokens that are not padding (a device tensor for a padded batch: counted without a sync)."""
    if isinstance(batch, (Batch, PreferenceBatch)):
        return batch.num_tokens
    return batch.attention_mask.sum()


def squared_lengths(batch: Batch | PaddedBatch) -> int | torch.Tensor:
    """The sum of the squared lengths of the batch's conversations, what causal attention costs
    (a device tensor for a padded batch: counted without a sync)."""
    if isinstance(batch, Batch):
        lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]  # on the host
        return int(lengths.long().square().sum())
    if isinstance(batch, PreferenceBatch):  # each segment's queries times its keys, on the host
        # (a prompt with its first answer: one causal segment, counted as a conversation is)
        queries = batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]
        keys = batch.cu_seqlens_k[1:] - batch.cu_seqlens_k[:-1]
        return int((queries.long() * keys.long()).sum())
    return batch.attention_mask.sum(dim=1).square().sum()


# --------------------------------------------------------------------------------------------------
# the step


def forward_backward(run: Run, batches: list[Batch | PaddedBatch], *, backward: bool) -> dict[str, torch.Tensor]:
    """Forward (and backward) over the micro-batches of one step with step-level weights (and what
    else the objective needs of the whole step first: `Objective.prepare_step`); the objective's
    sums over the micro-batches, on the device (this rank's)."""
    objective = run.objective
    batches = objective.prepare_step(run.engine, batches)
    weights = objective.step_weights(batches)
    totals = {name: torch.zeros((), device=run.device) for name in objective.sums}
    for i, (batch, w) in enumerate(zip(batches, weights)):
        with accumulating(run.engine, last=i == len(batches) - 1):
            out = objective.forward(run.engine, batch, w)
            if backward:
                out.loss.backward()
        for name in objective.sums:
            totals[name] += out.sums[name]
    return totals


def train_step(run: Run, batches: list[Batch | PaddedBatch]) -> StepStats:
    """One optimizer step over `batches`: forward and backward with step-level loss weights,
    gradient clipping (`optim.clip`), the spike watch, the update and the schedule; under
    `gradient_checkpointing: auto`, the planner measures or checks the step.

    A step whose loss or gradient norm is not finite updates nothing (its gradients are dropped)
    and is counted; so is a loss spike under `train.on_spike: skip` (`ligertune.training.spikes`).
    The loop stops the run after `train.max_skipped_steps` of them in a row.
    """
    cfg = run.recipe.train
    planner = run.checkpointing if isinstance(run.checkpointing, CheckpointPlanner) else None
    with planner.planning() if planner else contextlib.nullcontext():
        totals = forward_backward(run, batches, backward=True)
        # The norms of whole tensors, every shard counted: the same on each rank.
        clipped = clip_gradients(run.trainable, run.recipe.optim.max_grad_norm, run.recipe.optim.clip)
        if run.stream is not None and run.state.step + 1 < run.total_steps:
            prefetch_batches(run)  # while the device runs this step: the read-back below waits for it
        lr = run.scheduler.get_last_lr()[0]
        names = run.objective.sums
        trained = [trained_part(b) for b in batches]
        counts = [device_count(sum(real_tokens(b) for b in trained), run.device),
                  device_count(sum(squared_lengths(b) for b in trained), run.device)]
        # The step's numbers summed over the ranks, then one transfer to the host for all of them.
        summed = all_reduce_sum(torch.stack([x.double() for x in [*(totals[k] for k in names), *counts]]))
        numbers = torch.cat([summed, torch.stack([clipped.norm.double(), clipped.tensors.double()]).to(run.device)])
        *values, n_real, squares, norm, n_clipped = numbers.tolist()
        sums = dict(zip(names, values))
        metrics = run.objective.summarize(sums)
        loss = metrics["loss"]
        state = run.state
        finite = math.isfinite(loss) and math.isfinite(norm)
        spike = None
        if finite and cfg.spike_threshold is not None:  # the summed loss: every rank judges the same number
            spike = find_spike(loss, state.recent_losses, threshold=cfg.spike_threshold, window=cfg.spike_window)
        state.recent_losses = remember(state.recent_losses, loss, window=cfg.spike_window)
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
    units = run.objective.units
    return StepStats(
        metrics=metrics, tokens=int(sums[run.objective.trained_tokens]), real_tokens=int(n_real),
        units=int(sums[units[0]]) if units else 0,
        flops=run.step_flops(int(n_real), int(squares)), lr=lr, grad_norm=norm, skipped=skipped,
        clipped=int(n_clipped), spike=spike, news=planner.pop_news() if planner else None,
    )
