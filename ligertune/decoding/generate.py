"""The speculative decoding loop: draft a tree, verify it in one forward, keep what the model agrees with."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ligertune.decoding.drafts import Drafter
from ligertune.decoding.verify import AcceptRule, AttentionLayout, cache_keyword, tree_positions


@dataclass
class DecodeStats:
    """How one reply was decoded: model forwards, and per step the tree's depth and the nodes kept."""

    forwards: int = 0
    tokens: int = 0
    """Answer tokens written (the end-of-turn token included)."""
    proposed: list[int] = field(default_factory=list)
    """Per forward: the depth of the draft tree it verified (0: no draft)."""
    accepted: list[int] = field(default_factory=list)
    """Per forward: the draft tokens the acceptance rule kept (before the cut at an end or the limit)."""

    @classmethod
    def plain(cls, tokens: int) -> DecodeStats:
        """Plain decoding's: one forward per token, nothing drafted."""
        return cls(forwards=tokens, tokens=tokens, proposed=[0] * tokens, accepted=[0] * tokens)

    @classmethod
    def pooled(cls, parts: list[DecodeStats]) -> DecodeStats:
        """The statistics of several replies as one."""
        return cls(forwards=sum(p.forwards for p in parts), tokens=sum(p.tokens for p in parts),
                   proposed=[d for p in parts for d in p.proposed], accepted=[a for p in parts for a in p.accepted])

    @property
    def tokens_per_step(self) -> float:
        """Answer tokens per model forward: 1 for plain decoding."""
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def mean_accepted(self) -> float:
        """Draft tokens kept per forward."""
        return math.fsum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    def acceptance_per_depth(self) -> list[float]:
        """Entry d - 1: of the forwards whose tree reached depth d, the share that kept a path that
        deep (for Medusa, the acceptance rate of head d - 1 given its predecessors')."""
        rates = []
        for depth in range(1, max(self.proposed, default=0) + 1):
            tried = sum(1 for p in self.proposed if p >= depth)
            kept = sum(1 for p, a in zip(self.proposed, self.accepted) if p >= depth and a >= depth)
            rates.append(kept / tried)
        return rates


@dataclass
class Generation:
    ids: list[int]
    """The answer's tokens, ending with the end-of-turn token when the model wrote one."""
    finish_reason: str
    """`stop` (an end-of-turn token) or `length` (`max_new_tokens`)."""
    stats: DecodeStats


@torch.no_grad()
def speculative_generate(
    model,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    rule: AcceptRule,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Generation:
    """The answer after `prompt_ids` (batch 1): each step the drafter proposes a tree after the
    tokens so far, one forward verifies it (`ligertune.decoding.verify`), `rule` keeps a path and
    the model's own next token. Kept tokens after an end-of-turn token (`stop_ids`) or past
    `max_new_tokens` are dropped. `on_tokens` receives each step's kept tokens.
    """
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    layout = AttentionLayout.of(model.config)
    cache_kw = cache_keyword(model)
    from transformers import DynamicCache

    # Full (unbounded) layers even for sliding-window models: the mask applies the window, and a
    # sliding layer's rolling buffer could not be cropped back after the tree's rejected nodes.
    cache = DynamicCache()
    stops = set(stop_ids)
    tokens = list(prompt_ids)
    pending = list(prompt_ids)  # in the sequence, not yet in the cache; the last is the tree's root
    hidden = None
    new: list[int] = []
    stats = DecodeStats()
    while True:
        remaining = max_new_tokens - len(new)
        # a path of `remaining` tokens at most is kept, the model's own next token being one of them
        tree = drafter.propose(tokens, hidden).pruned(remaining - 1)
        past = len(tokens) - len(pending)
        out = model(
            input_ids=torch.tensor([pending + list(tree.tokens)], device=device),
            position_ids=tree_positions(tree, past=past, pending=len(pending))[None].to(device),
            attention_mask=layout.masks(tree, past=past, pending=len(pending), dtype=dtype, device=device),
            use_cache=True, output_hidden_states=drafter.wants_hidden, **{cache_kw: cache},
        )
        verdict = rule(out.logits[0, len(pending) - 1:], tree)
        stats.forwards += 1
        stats.proposed.append(tree.max_depth)
        stats.accepted.append(len(verdict.path))
        step = [tree.tokens[i] for i in verdict.path] + [verdict.next_token]
        end = next((i + 1 for i, t in enumerate(step) if t in stops), len(step))
        step = step[:min(end, remaining)]
        new += step
        tokens += step
        if on_tokens is not None:
            on_tokens(step)
        if step[-1] in stops or len(new) >= max_new_tokens:
            break
        if drafter.wants_hidden:  # the state whose logits chose the next token: Medusa heads read it
            last = len(pending) - 1 + (verdict.path[-1] + 1 if verdict.path else 0)
            hidden = out.hidden_states[-1][0, last]
        # Keep in the cache only the pending tokens' entries; the kept nodes are fed again as the
        # next step's first queries, with the model's own token. Their keys and values were computed
        # in this forward, but gathering them means reaching into each layer's tensors, whose layout
        # differs across transformers releases and cache kinds, while `crop` is public on all of
        # them; and at batch 1 a forward is bound by reading the weights, so a few more query rows
        # cost about nothing (`ligertune bench decode` measures the whole loop). A negative `crop`
        # removes that many tokens in every transformers release (a positive one meant "keep that
        # many" before 5.24 and is refused since); `crop(0)` emptied the cache before, so skip it.
        if len(tree):
            cache.crop(-len(tree))
        pending = step
    finish = "stop" if new[-1] in stops else "length"
    stats.tokens = len(new)
    return Generation(ids=new, finish_reason=finish, stats=stats)
