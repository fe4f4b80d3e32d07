"""Drafters: what proposes the tree of candidate tokens that one model forward then verifies.

A drafter is called once per step with every token so far (prompt, answer, and last the token
that the tree continues) and, when it asks for it (`wants_hidden`), the model's last hidden state
at the position before that token: the state whose LM-head logits chose it, where Medusa heads
read their guesses for the tokens after it. It returns a `DraftTree`, empty for no guess.

    none     no draft: one token per forward, as plain decoding
    ngram    prompt lookup: what followed the latest earlier occurrence of the last n tokens
    medusa   the heads' top-k tokens, arranged in the sparse tree of `choices` (needs trained heads)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ligertune.decoding.tree import EMPTY, DraftTree, medusa_tree, sparse_tree_choices
from ligertune.errors import UserError
from ligertune.models.medusa import HEADS_FILE, MedusaHeads, has_heads, load_heads

DRAFTS = ("none", "ngram", "medusa")
MEDUSA_HEADS = HEADS_FILE
"""Where a run's trained Medusa heads live, beside the model's weights (`ligertune.models.medusa`)."""


class Drafter(Protocol):
    name: str
    wants_hidden: bool
    """True: `propose` receives the last hidden state ([hidden]); False: None."""

    def propose(self, tokens: Sequence[int], hidden: torch.Tensor | None) -> DraftTree: ...


class NoDraft:
    """Proposes nothing: each forward writes one token."""

    name = "none"
    wants_hidden = False

    def propose(self, tokens: Sequence[int], hidden: torch.Tensor | None) -> DraftTree:
        return EMPTY


@dataclass
class NgramDraft:
    """Prompt lookup (Saxena 2023): the continuation of the latest earlier occurrence of the last n tokens.

    With tokens `... x y z | p q r s ... x y z`, the last 3 tokens `x y z` occurred before,
    followed by `p q r s`: that is the first candidate. n runs from `max_ngram` down to `min_ngram`;
    further occurrences (latest first, longest n first) give up to `branches` candidates that
    differ, each `depth` tokens long. A continuation that runs into the last tokens goes on
    repeating itself with the occurrence's period: after `a b a b a b`, the tail `a b` last
    occurred 2 tokens earlier and `a b a b a` follows it. No model is involved: on text that
    repeats the prompt or itself (code edits, quotes, lists, loops) the candidates are often right.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    depth: int = 5
    branches: int = 3
    name = "ngram"
    wants_hidden = False

    def propose(self, tokens: Sequence[int], hidden: torch.Tensor | None) -> DraftTree:
        tokens = list(tokens)
        total = len(tokens)
        candidates: list[tuple[int, ...]] = []
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            tail = tokens[total - n:]
            for start in range(total - n - 1, -1, -1):  # an occurrence that ends before the tail does
                if tokens[start:start + n] == tail:
                    run: list[int] = []
                    for j in range(start + n, start + n + self.depth):
                        run.append(tokens[j] if j < total else run[j - total])
                    follow = tuple(run)
                    if not any(c[:len(follow)] == follow for c in candidates):
                        candidates.append(follow)
                        if len(candidates) == self.branches:
                            return DraftTree.from_sequences(candidates)
        return DraftTree.from_sequences(candidates)


@dataclass
class MedusaDraft:
    """Medusa heads' guesses (Cai et al. 2024): head k reads the last hidden state and guesses the
    token k + 2 places ahead of it (k + 1 after the token its LM head chose); the `top_k` tokens of
    each head are arranged in the sparse tree of `choices` (`medusa_tree`).

    `heads` maps the hidden state [hidden] to the heads' logits [heads, vocab] (`HeadLogits` of the
    trained heads, `medusa_drafter`).
    """

    heads: Callable[[torch.Tensor], torch.Tensor]
    choices: Sequence[Sequence[int]]
    top_k: int = 10
    name = "medusa"
    wants_hidden = True

    def propose(self, tokens: Sequence[int], hidden: torch.Tensor | None) -> DraftTree:
        if hidden is None:  # the first step: the prompt has not been through the model yet
            return EMPTY
        logits = self.heads(hidden)
        top = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).indices.tolist()
        return medusa_tree(top, self.choices)


def default_medusa_choices(heads: int, size: int = 64, top_k: int = 10) -> list[tuple[int, ...]]:
    """A sparse tree of `size` nodes for `heads` heads before their accuracies are measured: head k's
    rank-r token assumed right 0.6 / (k + 1) / (r + 1) of the time, a shape close to what the Medusa
    paper measured on Vicuna-7B (accuracy falling with depth and rank)."""
    accuracy = [[0.6 / (k + 1) / (r + 1) for r in range(top_k)] for k in range(heads)]
    return sparse_tree_choices(accuracy, size)


class HeadLogits:
    """Trained Medusa heads as `MedusaDraft.heads`: the logits [heads, vocab] of one hidden state, the
    heads moved to its device and dtype at the first call."""

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.heads.heads[0].proj.weight
        if weight.device != hidden.device or weight.dtype != hidden.dtype:
            self.heads.to(device=hidden.device, dtype=hidden.dtype)
        return self.heads(hidden).float()


def medusa_drafter(model_dir: Path) -> Drafter:
    """The Medusa drafter of a model folder's trained heads (`MEDUSA_HEADS`, read as data by
    `load_heads`), in the sparse tree of `default_medusa_choices`; a user error when there are none."""
    if not has_heads(model_dir):
        raise UserError(f"--draft medusa: {model_dir} has no Medusa heads ({MEDUSA_HEADS}); "
                        "use --draft ngram or --draft none")
    heads = load_heads(model_dir)
    return MedusaDraft(HeadLogits(heads), default_medusa_choices(heads.config.heads))


def make_drafter(name: str, *, model_dir: Path | None = None, depth: int = 5) -> Drafter:
    """The drafter called `name` (`DRAFTS`), named in errors as `--draft`."""
    if name == "none":
        return NoDraft()
    if name == "ngram":
        return NgramDraft(depth=depth)
    if name == "medusa":
        if model_dir is None:
            raise UserError("--draft medusa: needs a model folder with trained heads")
        return medusa_drafter(model_dir)
    raise UserError(f"--draft: expected one of {', '.join(DRAFTS)}, got {name!r}")
