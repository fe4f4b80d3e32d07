"""The reference model's log-probabilities, computed once before the first step and kept with the run.

DPO, IPO and KTO measure the policy against a reference pi_ref: the starting model, frozen. Its
sums of log p over every answer never change during a run, so they are computed ONCE, before the
first update, by the model being trained: it *is* the starting model then (with LoRA, the base
with its new adapters, whose B matrices start at zero: the base model itself), in eval mode under `torch.no_grad()`, one pack at a time (so they do not depend on
`train.micro_batch_size`), and attached to every pack (`PreferencePack.reference_logps`, carried by
`collate_preferences` into `PreferenceBatch.reference_logps`). No second model is held in memory.

After training the starting model is gone, so a resumed run cannot recompute them: they are written
to the run's folder (`reference_logps.json`, atomically) before the first step and read back on
`--resume`, where their count must match the packs' answers. JSON keeps them exact: each float32
value is written as the shortest decimal that reads back to the same number.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ligertune.data import collate_preferences
from ligertune.data.preference import PreferencePack
from ligertune.errors import UserError
from ligertune.files import write_atomic_text

REFERENCE_FILE = "reference_logps.json"
FORMAT = 1


@torch.no_grad()
def compute_reference_logps(engine: nn.Module, packs: Sequence[PreferencePack], device: torch.device) -> None:
    """Fill `reference_logps` of every pack with `engine`'s sums of log p of its answers (eval mode,
    no gradient, one pack per forward); the engine's training mode is restored after."""
    was_training = engine.training
    engine.eval()
    try:
        for pack in packs:
            batch = collate_preferences([dataclasses.replace(pack, reference_logps=None)]).to(device)
            out = engine(batch.input_ids, batch.position_ids, score_rows=batch.score_rows,
                         score_targets=batch.score_targets, score_answers=batch.score_answers,
                         num_answers=batch.num_answers, **batch.attention())
            pack.reference_logps = out.logp_sum.float().cpu().tolist()
    finally:
        engine.train(was_training)


def save_reference_logps(path: Path, train: Sequence[PreferencePack], held_out: Sequence[PreferencePack]) -> None:
    """The packs' reference log-probabilities as `path` (JSON, written atomically)."""
    record = {"format": FORMAT, "train": [p.reference_logps for p in train],
              "eval": [p.reference_logps for p in held_out]}
    write_atomic_text(path, json.dumps(record))


def load_reference_logps(path: Path, train: Sequence[PreferencePack], held_out: Sequence[PreferencePack]) -> None:
    """Attach the reference log-probabilities saved at `path` to the packs, after checking that they
    are as many, pack by pack, as the packs' answers; a one-line `UserError` otherwise."""
    if not path.is_file():
        raise UserError(f"--resume: {path} is missing: the reference log-probabilities of the starting model "
                        "were saved there before the first step and cannot be computed again; start the run anew")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        saved = {"train": record["train"], "eval": record["eval"]}
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
