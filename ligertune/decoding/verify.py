"""Verifying a draft tree in one forward, and choosing which of its tokens to keep.

One step feeds the model the tokens not yet in its KV cache (`pending`: the prompt at first, then
the tokens kept by the last step), followed by the tree's nodes:

    query        attends to                                   position
    pending[i]   the cache and pending[:i + 1] (causal)       past + i
    node j       the cache, all of pending, node j's          past + len(pending) - 1 + depth[j]
                 ancestors and node j itself

so that each node sees exactly the sequence it would continue: its logits are the model's
next-token logits after the root and the node's path. An acceptance rule (`AcceptRule`) then walks
down from the root, the last pending token, keeping the nodes the model agrees with, and adds the
model's own next token after the last one kept.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ligertune.decoding.tree import DraftTree
from ligertune.errors import UserError

ACCEPT_RULES = ("exact", "typical")
FULL, SLIDING = "full_attention", "sliding_attention"


# --------------------------------------------------------------------------------------------------
# the forward


def tree_mask(tree: DraftTree, *, past: int, pending: int, dtype: torch.dtype, device: torch.device,
              window: int | None = None) -> torch.Tensor:
    """The additive attention mask [1, 1, pending + nodes, past + pending + nodes] of one step
    (0 where a query may look, the dtype's lowest value elsewhere: the form both eager and sdpa
    attention add to their scores).

    `window`: a sliding-window layer's span, as transformers counts it (a query at position q sees
    keys at positions above q - window).
    """
    queries = pending + len(tree)
    allowed = torch.zeros(queries, past + queries, dtype=torch.bool)
    allowed[:, :past] = True
    allowed[:pending, past:past + pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    allowed[pending:, past:past + pending] = True
    allowed[pending:, past + pending:] = tree.ancestors()
    if window is not None:
        positions = tree_positions(tree, past=past, pending=pending)
        keys = torch.cat([torch.arange(past), positions])
        allowed &= keys[None, :] > positions[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_positions(tree: DraftTree, *, past: int, pending: int) -> torch.Tensor:
    """[pending + nodes]: the pending tokens' positions in a row, then each node's root position plus depth."""
    root = past + pending - 1
    return torch.tensor([*range(past, past + pending), *(root + d for d in tree.depths)])


@dataclass(frozen=True)
class AttentionLayout:
    """How a model's layers attend, as its config says: which mask each kind of layer needs."""

    kinds: frozenset[str]
    window: int | None

    @classmethod
    def of(cls, config) -> AttentionLayout:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None)
        if types:
            kinds = frozenset(types)
        else:  # Mistral-style: every layer slides when the config has a window
            kinds = frozenset([SLIDING if window else FULL])
        unknown = kinds - {FULL, SLIDING}
        if unknown:
            raise UserError(f"--draft: {getattr(text, 'model_type', 'this model')}'s "
                            f"{', '.join(sorted(unknown))} layers are not supported by draft "
                            "verification; use --draft none")
        return cls(kinds, window if SLIDING in kinds else None)

    def masks(self, tree: DraftTree, *, past: int, pending: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
        """The `attention_mask` to pass: one 4D mask, or one per layer kind when the model mixes
        full and sliding layers (Gemma 2, Qwen 2 with `use_sliding_window`), which such models take
        as a dict keyed by layer type."""
        masks = {kind: tree_mask(tree, past=past, pending=pending, dtype=dtype, device=device,
                                 window=self.window if kind == SLIDING else None) for kind in self.kinds}
        return next(iter(masks.values())) if len(masks) == 1 else masks


def cache_keyword(model) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.24 on, `past_key_values`
    before (still accepted there, with a deprecation warning)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


# --------------------------------------------------------------------------------------------------
# acceptance


@dataclass(frozen=True)
class Sampling:
    """How the model's own next token is picked: greedy at temperature 0, else sampled from the
    distribution of `temperature` and nucleus `top_p`."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] float32: the distribution tokens are drawn from (top-p kept, renormalized)."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest head of the sorted tokens whose mass reaches top_p (the first always)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


@dataclass(frozen=True)
class Verdict:
    """What one step keeps: the accepted nodes, root first, and the model's own token after them."""

    path: list[int]
    next_token: int


class AcceptRule:
    """Chooses the accepted path of a tree from the logits at the root and at every node ([1 + N, vocab])."""

    name: str

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verdict:
        raise NotImplementedError


class GreedyMatch(AcceptRule):
    """Temperature 0: a node is kept when its token is the argmax after its parent; the answer is the
    plain greedy answer, token for token. Siblings are distinct, so at most one child matches."""

    name = "greedy"

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verdict:
        choice = logits.argmax(-1).tolist()
        node, path = -1, []
        while True:
            match = next((c for c in tree.children(node) if tree.tokens[c] == choice[node + 1]), None)
            if match is None:
                return Verdict(path, choice[node + 1])
            path.append(match)
            node = match


class ExactSampling(AcceptRule):
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for drafts that are
    token guesses, not distributions: the answer has exactly the distribution of plain sampling.

    At a node with target distribution p, each child token x (in proposal order) is accepted with
    probability p(x) / (mass left); a rejected x is removed from p. If no child is accepted, the
    next token is drawn from what is left of p. Then P(x1) = p(x1), P(x2) = (1 - p(x1)) p(x2) /
    (1 - p(x1)) = p(x2), and so on: every token keeps its probability under p, whatever the
    guesses. With several children this is the recursive rejection sampling of SpecInfer (Miao et
    al. 2024) for one-hot drafts.
    """

    name = "exact"

    def __init__(self, sampling: Sampling):
        self.sampling = sampling

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verdict:
        probs = self.sampling.probs(logits)
        node, path = -1, []
        while True:
            p = probs[node + 1].clone()
            accepted = None
            for child in tree.children(node):
                token = tree.tokens[child]
                left = p.sum()
                if float(torch.rand((), device=p.device)) * float(left) < float(p[token]):
                    accepted = child
                    break
                p[token] = 0
            if accepted is None:
                return Verdict(path, int(torch.multinomial(p / p.sum(), 1)))
            path.append(accepted)
            node = accepted


class TypicalAcceptance(AcceptRule):
    """Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1): a node is kept when its token's
    probability after its parent is above min(epsilon, delta * exp(-H)), H the entropy of that
    distribution (at the temperature, before top-p). Of the paths kept from the root, the longest
    wins, ties to the most likely; the next token is sampled after it.

    Not exact: tokens the model finds plausible enough pass even when sampling would rarely draw
    them, so answers differ in distribution from plain sampling (less diverse); in exchange more
    guesses pass at high temperature, where exact sampling rejects most of them. epsilon = 0.09 and
    delta = 0.3 are the paper's defaults.
    """

    name = "typical"

    def __init__(self, sampling: Sampling, *, epsilon: float = 0.09, delta: float = 0.3):
        self.sampling = sampling
        self.epsilon = epsilon
        self.delta = delta

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verdict:
        path = []
        if len(tree):
            tempered = torch.softmax(logits.float() / self.sampling.temperature, dim=-1)
            entropy = -(tempered * torch.log(tempered.clamp_min(1e-30))).sum(-1)
            threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
            parents = torch.tensor(tree.parents, device=logits.device) + 1
            tokens = torch.tensor(tree.tokens, device=logits.device)
            prob = tempered[parents, tokens]
            ok = (prob > threshold[parents]).tolist()
            logp = prob.clamp_min(1e-30).log().tolist()
            best = (0, 0.0, -1)  # (kept length, log-likelihood, node)
            score: dict[int, tuple[int, float] | None] = {-1: (0, 0.0)}
            for i, parent in enumerate(tree.parents):  # parents first: a node's score follows its parent's
                above = score[parent]
                score[i] = None if above is None or not ok[i] else (above[0] + 1, above[1] + logp[i])
                if score[i] is not None and score[i] > best[:2]:
                    best = (*score[i], i)
            path = tree.path(best[2]) if best[2] >= 0 else []
        last = path[-1] + 1 if path else 0
        next_token = int(torch.multinomial(self.sampling.probs(logits[last]), 1))
        return Verdict(path, next_token)


def accept_rule(sampling: Sampling, name: str = "exact") -> AcceptRule:
    """The rule for `sampling`: greedy matching at temperature 0, else the rule called `name`
    (`ACCEPT_RULES`, named in errors as `--accept`)."""
    if name not in ACCEPT_RULES:
        raise UserError(f"--accept: expected one of {', '.join(ACCEPT_RULES)}, got {name!r}")
    if sampling.greedy:
        return GreedyMatch()
    return ExactSampling(sampling) if name == "exact" else TypicalAcceptance(sampling)
