"""Whether a recipe may continue a checkpoint's run (`ligertune.training.checkpoint` finds and restores it).

A run continues only under the math it started with. Keys that change what a step computes (the
model, the data and its settings, the batch, the seed, the loss, LoRA, the optimizer, its clipping
and master weights) must equal the checkpoint's; keys that only say how long to run, how often to
log, evaluate or save, where to write, and how to watch for loss spikes may change
(`RESUMABLE_CHANGES`; the spike watch's window of recent losses is part of the saved run, so a
resumed run with the same settings flags the same spikes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ligertune.errors import UserError
from ligertune.recipe import ObjectiveConfig, Recipe

RESUMABLE_CHANGES = (
    "description",
    "train.max_steps",
    "train.epochs",
    "train.save_every",
    "train.keep_checkpoints",
    "train.max_skipped_steps",
    "train.spike_threshold",
    "train.spike_window",
    "train.on_spike",
    "train.eval_every",
    "train.eval_at_start",
    "train.eval_max_conversations",
    "train.log_every",
    "train.num_threads",
    "train.device",
    "train.gradient_checkpointing",  # recomputation gives the same values (and dropout masks)
    "train.memory_budget_gib",
    "data.num_workers",
    "data.cache_dir",
    "distributed.",
    "output.",
)

# Sections added to the recipe after checkpoints were first written: a saved recipe without one ran
# with the section's defaults (which keep what ran before the section existed).
ADDED_SECTIONS = {"objective": ObjectiveConfig}


def fit_world_size(saved: dict, recipe: Recipe, *, world_size: int) -> tuple[Recipe, str | None]:
    """The recipe to continue a checkpoint's run with at `world_size` processes, and a line saying
    what changed with the number of processes (None when it did not change).

    A step keeps its packs (`micro_batch_size x grad_accum_steps x processes`): when the recipe keeps
    the checkpoint's `grad_accum_steps` and the step's packs split evenly over the new processes, the
    accumulation is set to match (2 processes x 1 continue as 1 x 2, and 1 x 2 as 2 x 1). A recipe
    that sets another accumulation keeps it, for `check_resumable` to judge.
    """
    saved_world = saved.get("world_size", 1)
    if saved_world == world_size:
        return recipe, None
    saved_accum = saved["recipe"]["train"]["grad_accum_steps"]
    accum = recipe.train.grad_accum_steps
    if accum == saved_accum and (saved_accum * saved_world) % world_size == 0:
        accum = saved_accum * saved_world // world_size
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, grad_accum_steps=accum))
    packs = recipe.train.micro_batch_size * accum * world_size
    return recipe, (f"written by {saved_world} process{'es' * (saved_world > 1)}, continued by {world_size}: "
                    f"grad_accum_steps {saved_accum} -> {accum}, {packs} pack{'s' * (packs > 1)} a step")


def check_resumable(saved: dict, recipe: Recipe, checkpoint: Path, *, world_size: int = 1) -> None:
    """Refuse, naming the keys, a recipe that changes the math of the checkpoint's run.

    `grad_accum_steps` may change with the number of processes as long as a step takes as many
    packs (`micro_batch_size x grad_accum_steps x processes`): 2 processes x 2 continue as 1 x 4.
    """
    saved_recipe = dict(saved["recipe"])
    for name, section in ADDED_SECTIONS.items():
        saved_recipe.setdefault(name, dataclasses.asdict(section()))
    before, after = _flatten(saved_recipe), _flatten(recipe.to_dict())
    saved_world = saved.get("world_size", 1)
    same_step = (before["train.grad_accum_steps"] * saved_world == recipe.train.grad_accum_steps * world_size)
    changed = sorted(
        key for key in before.keys() | after.keys()
        if before.get(key) != after.get(key) and not key.startswith(RESUMABLE_CHANGES)
        and not (key == "train.grad_accum_steps" and same_step)
    )
    if not same_step and "train.grad_accum_steps" not in changed:
        changed.append("train.grad_accum_steps")
        after["train.grad_accum_steps"] = (f"{recipe.train.grad_accum_steps} with {world_size} processes, "
                                           f"{before['train.grad_accum_steps']} x {saved_world} before")
    if changed:
        shown = ", ".join(f"{k} ({before.get(k)!r} -> {after.get(k)!r})" for k in changed[:6])
        more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
        raise UserError(
            f"--resume: the recipe differs from the one of {checkpoint} in keys that change the "
            f"training math: {shown}{more}; resume with the same values, or start a new run"
        )


def check_same_data(saved: dict, *, packs: int, digest: str, checkpoint: Path) -> None:
    """Refuse to continue a checkpoint's run over other training packs than it trained on (a data
    file edited or replaced since, under the same recipe): its data position would count in packs
    that are not the ones it counted. A checkpoint written before the packs were recorded passes."""
    before = saved.get("data")
    if before is None or before["digest"] == digest:
        return
    counts = (f"{before['packs']} packs then, {packs} now" if before["packs"] != packs
              else f"as many packs ({packs}), with other contents")
    raise UserError(
        f"--resume: the training data differ from those {checkpoint} was trained on ({counts}): a data "
        "file changed since; resume with the data the run started with, or start a new run"
    )


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: data}
