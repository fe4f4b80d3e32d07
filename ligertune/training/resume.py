"""Continuing a run from a checkpoint: which one, whether the recipe still fits it, and its weights.

A run continues only under the math it started with. Keys that change what a step computes (the
model, the data and its settings, the batch, the seed, the loss, LoRA, the optimizer, its clipping
and master weights) must equal the checkpoint's; keys that only say how long to run, how often to
log, evaluate or save, where to write, and how to watch for loss spikes may change
(`RESUMABLE_CHANGES`; the spike watch's window of recent losses is part of the saved run, so a
resumed run with the same settings flags the same spikes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ligertune.errors import UserError
from ligertune.recipe import Recipe
from ligertune.training.checkpoint import CHECKPOINTS, TRAINER_STATE, latest_checkpoint

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


def find_checkpoint(run_dir: Path, resume: str | Path) -> Path:
    """The checkpoint to continue from: `latest` of the run directory, or the given one."""
    if str(resume) == "latest":
        found = latest_checkpoint(run_dir)
        if found is None:
            raise UserError(f"--resume: no checkpoint in {run_dir / CHECKPOINTS} to resume from "
                            "(train.save_every writes them)")
        return found
    path = Path(resume).expanduser()
    if path.is_dir() and (path / TRAINER_STATE).is_file():
        return path.resolve()
    if path.is_dir() and latest_checkpoint(path) is not None:  # a run directory
        return latest_checkpoint(path)
    raise UserError(f"--resume: {resume} is not a checkpoint (no {TRAINER_STATE}) nor a run directory "
                    "with checkpoints")


def check_resumable(saved: dict, recipe: Recipe, checkpoint: Path, *, world_size: int = 1) -> None:
    """Refuse, naming the keys, a recipe that changes the math of the checkpoint's run.

    `grad_accum_steps` may change with the number of processes as long as a step takes as many
    packs (`micro_batch_size x grad_accum_steps x processes`): 2 processes x 2 continue as 1 x 4.
    """
    before, after = _flatten(saved["recipe"]), _flatten(recipe.to_dict())
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


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: data}


def load_model_weights(model: nn.Module, checkpoint: Path) -> None:
    """Put the checkpoint's weights (the LoRA adapters, or the whole model) into `model` in place."""
    from safetensors.torch import load_file

    adapters = checkpoint / "adapter_model.safetensors"
    if adapters.is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(adapters))
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"--resume: {adapters} does not fit the recipe's adapters "
                            f"(unexpected {result.unexpected_keys[0]})")
        return
    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise UserError(f"--resume: {checkpoint} holds no model weights (model*.safetensors)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = [key for key in missing if not _is_tied(model, key, state)]
    if unexpected or untied:
        key = (unexpected or untied)[0]
        raise UserError(f"--resume: the weights in {checkpoint} do not fit the recipe's model ({key})")


def _is_tied(model: nn.Module, key: str, loaded: dict[str, torch.Tensor]) -> bool:
    """Whether parameter `key` shares its tensor with one that was loaded (tied embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(p is target for name, p in params.items() if name in loaded)
