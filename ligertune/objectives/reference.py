"""The reference model's log-probabilities: precomputed once and kept, or scored live at every step.

DPO, IPO and KTO measure the policy against a reference pi_ref: the starting model, frozen.
`objective.reference` says where its sums of log p over every answer come from.

`precomputed` (the default): those sums never change during a run, so they are computed ONCE, before
the first update, by the model being trained: it *is* the starting model then (with LoRA, the base
with its new adapters, whose B matrices start at zero: the base model itself), in eval mode under
`torch.no_grad()`, and attached to every pack (`PreferencePack.reference_logps`, carried by
`collate_preferences` into `PreferenceBatch.reference_logps`). No second model is held in memory.
Training packs are scored as many a forward as a training micro-batch holds (memory the step needs
anyway, with no activations kept; one a forward took 5-8% longer on the bench's DPO pairs:
docs/PERF.md); held-out packs one a forward, as evaluation scores them, so that before the first
step the policy's held-out sums are the reference's to the bit. With several processes each rank
scores every world-th pack and the values are gathered (every rank runs as many forwards: sharded
layers gather their weights together). Each pack is scored whole: a KTO example's prompt runs once,
its completion and mismatched completion each attending to it, where the policy's two passes run the
prompt once each (`PreferenceBatch.kto_parts`); the same values, to the rounding of the computation
rather than to the bit, for 35% fewer tokens at a 2,830-token prompt and completions of 1,190.

They are kept in two places, as JSON (each float32 value written as the shortest decimal that reads
back to the same number, so they stay exact):
- the data cache (`data.cache_dir/reference/`), under a key of everything that decides them: the
  model's identity (its config and seed, or its weight files' names, sizes and times), the recipe's
  `model`, `kernels` and `lora` sections, the packs' tokens and scored positions, the training
  packs a forward, the device, the number of processes and the versions of torch and transformers. A
  repeated run with the same model and data reads them back instead of scoring again.
- the run's folder (`reference_logps.json`), since after training the starting model is gone: a
  resumed run reads them from there; their count must match the packs' answers.

`live`: `LiveReference` scores each micro-batch's answers again, before the policy's forward (KTO's
micro-batch whole, before the step splits it): with the LoRA adapters switched off, or by a frozen
copy of the starting model (full fine-tuning), in eval mode under `torch.no_grad()`. Nothing runs
before the first step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ligertune.data import collate_preferences, packs_digest
from ligertune.data.preference import PreferencePack
from ligertune.devices import device_name
from ligertune.distributed import Topology, gather_objects
from ligertune.errors import UserError
from ligertune.files import write_atomic_text

REFERENCE_FILE = "reference_logps.json"
FORMAT = 4
"""Part of the cache key: 3 since a KTO example is scored whole again (its prompt once, then its
completion and its mismatched completion, each attending to the prompt alone); 4 since a prompt and
its first answer are one attention segment (`data.preference.varlen_segments`), whose kernel may
round those rows' values otherwise than the three segments before it did."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model")
"""The files of a model folder that decide its outputs (weights, configs, quantization)."""


# --------------------------------------------------------------------------------------------------
# scoring


def score_answers(engine: nn.Module, batch) -> torch.Tensor:
    """`engine`'s sums of log p of every answer of `batch` ([A] float32), on the batch's device."""
    out = engine(batch.input_ids, batch.position_ids, score_rows=batch.score_rows,
                 score_targets=batch.score_targets, score_answers=batch.score_answers,
                 num_answers=batch.num_answers, **batch.attention())
    return out.logp_sum.float()


@torch.no_grad()
def compute_reference_logps(engine: nn.Module, packs: Sequence[PreferencePack], device: torch.device,
                            topology: Topology | None = None, *, packs_per_forward: int = 1) -> None:
    """Fill `reference_logps` of every pack with `engine`'s sums of log p of its answers (eval mode,
    no gradient, `packs_per_forward` packs a forward); the engine's training mode is restored after.
    With several processes, rank r scores packs r, r + world, ... and every rank receives all of them."""
    world, rank = (topology.world_size, topology.rank) if topology is not None else (1, 0)
    share = list(packs[rank::world])
    per_rank = -(-len(packs) // world)
    forwards = -(-per_rank // packs_per_forward)  # every rank runs as many: the short ones score a pack again
    was_training = engine.training
    engine.eval()
    try:
        scored = []  # kept on the device until the end: the host collates the next packs meanwhile
        for i in range(forwards):
            group = share[i * packs_per_forward : (i + 1) * packs_per_forward] or [packs[0]]
            unscored = [dataclasses.replace(p, reference_logps=None) for p in group]
            batch = collate_preferences(unscored).to(device)
            scored.append(score_answers(engine, batch))
    finally:
        engine.train(was_training)
    flat = torch.cat(scored).tolist() if scored else []
    values, start = [], 0
    for pack in share:  # the answers in pack order; a short rank's repeats come after them
        values.append(flat[start : start + pack.num_answers])
        start += pack.num_answers
    for r, scored in enumerate(gather_objects(values) if world > 1 else [values]):
        for i, pack_values in enumerate(scored):
            packs[r + i * world].reference_logps = pack_values


class LiveReference:
    """The reference's sums of log p of a batch's answers, scored when the batch is (`objective.reference:
    live`): by `engine` inside `switched_off()` (the LoRA adapters off), or by a frozen copy's engine."""

    def __init__(self, engine: nn.Module, switched_off: Callable[[], AbstractContextManager] = nullcontext):
        self.engine = engine
        self.switched_off = switched_off

    @torch.no_grad()
    def __call__(self, batch) -> torch.Tensor:
        was_training = self.engine.training
        self.engine.eval()
        try:
            with self.switched_off():
                return score_answers(self.engine, batch)
        finally:
            self.engine.train(was_training)


# --------------------------------------------------------------------------------------------------
# keeping them


def save_reference_logps(path: Path, train: Sequence[PreferencePack], held_out: Sequence[PreferencePack],
                         key: str | None = None) -> None:
    """The packs' reference log-probabilities as `path` (JSON, written atomically), with the key
    they were computed under."""
    record = {"format": FORMAT, "key": key, "train": [p.reference_logps for p in train],
              "eval": [p.reference_logps for p in held_out]}
    write_atomic_text(path, json.dumps(record))


def load_reference_logps(path: Path, train: Sequence[PreferencePack], held_out: Sequence[PreferencePack]) -> None:
    """Attach the reference log-probabilities saved at `path` to the packs, after checking that they
    are as many, pack by pack, as the packs' answers; a one-line `UserError` otherwise."""
    if not path.is_file():
        raise UserError(f"--resume: {path} is missing: the reference log-probabilities of the starting model "
                        "were saved there before the first step and cannot be computed again; start the run anew")
    try:
        saved = read_saved(path)
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"--resume: {path} cannot be read ({err}); start the run anew") from None
    for name, packs in (("train", train), ("eval", held_out)):
        got = saved[name]
        counts = [len(x) for x in got] if isinstance(got, list) else []
        want = [p.num_answers for p in packs]
        if counts != want:
            raise UserError(f"--resume: {path} holds reference log-probabilities for {sum(counts)} {name} answers "
                            f"in {len(counts)} packs; the data gives {sum(want)} in {len(want)}: the data changed "
                            "since the run started")
        for pack, values in zip(packs, got):
            pack.reference_logps = [float(v) for v in values]


def read_saved(path: Path) -> dict[str, Any]:
    record = json.loads(path.read_text(encoding="utf-8"))
    return {"key": record.get("key"), "train": record["train"], "eval": record["eval"]}


def cached_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir).expanduser() / "reference" / f"{key[:40]}.json"


def load_cached(path: Path, key: str, train: Sequence[PreferencePack], held_out: Sequence[PreferencePack]) -> bool:
    """Attach the values cached at `path` when they were computed under `key`; False (nothing
    attached) when there is none, it is unreadable or it was made for other packs."""
    try:
        saved = read_saved(path)
        if saved["key"] != key:
            return False
        for name, packs in (("train", train), ("eval", held_out)):
            if [len(x) for x in saved[name]] != [p.num_answers for p in packs]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, packs in (("train", train), ("eval", held_out)):
        for pack, values in zip(packs, saved[name]):
            pack.reference_logps = [float(v) for v in values]
    return True


def reference_key(recipe, train: Sequence[PreferencePack], held_out: Sequence[PreferencePack], *,
                  device: torch.device, world_size: int) -> str | None:
    """SHA-256 of everything that decides the precomputed reference log-probabilities, or None when
    the model's identity cannot be told from its files (then nothing is cached)."""
    import transformers

    model = model_identity(recipe.model, seed=recipe.train.seed)
    if model is None:
        return None
    parts = {
        "format": FORMAT,
        "model": model,
        "sections": {name: dataclasses.asdict(getattr(recipe, name)) if getattr(recipe, name) is not None else None
                     for name in ("model", "kernels", "lora")},
        "data": packs_digest([*train, *held_out]),
        "split": len(train),
        "packs_per_forward": recipe.train.micro_batch_size,
        "device": device_name(device),
        "world_size": world_size,
        "versions": [torch.__version__, transformers.__version__],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(model_cfg, *, seed: int) -> dict | None:
    """What tells the starting model's weights apart: its config and seed (random init), or the
    names, sizes and modification times of its folder's files (a local folder, or the snapshot of a
    hub model in the local cache); None for a hub model not in the cache."""
    if model_cfg.config is not None:
        return {"config": model_cfg.config, "seed": seed}
    folder = model_folder(model_cfg.name_or_path)
    if folder is None:
        return None
    files = []
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES:
            stat = p.stat()
            files.append([p.relative_to(folder).as_posix(), stat.st_size, stat.st_mtime_ns])
    return {"folder": str(folder.resolve()), "files": files}


def model_folder(name_or_path: str) -> Path | None:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # not a hub id, or not in the local cache: nothing to key by
        return None
