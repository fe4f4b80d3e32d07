"""A draft tree: candidate continuations that share prefixes, flattened to nodes.

Three candidates after the tokens so far, `[a b c]`, `[a d]` and `[e]`, share the `a`:

    sequences        nodes (index: token, parent, depth)
    a b c            0: a  -1  1          root (the last token, not a node)
    a d              1: b   0  2            |-- a (0) -- b (1) -- c (2)
    e                2: c   1  3            |     `----- d (3)
                     3: d   0  2            `-- e (4)
                     4: e  -1  1

Nodes come parents first (a parent's index is below its children's), siblings carry distinct
tokens, and siblings keep the order of proposal: the first is the drafter's best guess. Parent -1
is the root, the last token before the tree, whose own logits judge the depth-1 nodes.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    """Candidate tokens after the current last token, as a tree of nodes (see the module docstring)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    """Index of each node's parent, -1 for a child of the root; always below the node's own index."""
    depths: tuple[int, ...] = field(default=())
    """1 for a child of the root: the node's position is the root's plus its depth."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """The nodes under `node` (-1: the root), in the order they were proposed."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`, `node` last."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def sequences(self) -> list[list[int]]:
        """The candidate continuations: the tokens of every root-to-leaf path."""
        leaves = set(range(len(self))) - set(self.parents)
        return [[self.tokens[i] for i in self.path(leaf)] for leaf in sorted(leaves)]

    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: row i is True at i and at each ancestor of i (what node i may attend to)."""
        return _ancestors(self.parents).clone()

    def pruned(self, max_depth: int) -> DraftTree:
        """The nodes of depth at most `max_depth` (a shallower tree when few tokens are left to write)."""
        if self.max_depth <= max_depth:
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree(tuple(self.tokens[i] for i in keep),
                         tuple(index.get(self.parents[i], -1) for i in keep),
                         tuple(self.depths[i] for i in keep))

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], *, max_nodes: int | None = None) -> DraftTree:
        """The tree of the candidates' shared prefixes, candidates in order of preference (a prefix
        already present is shared, not repeated); at most `max_nodes` nodes, the first candidates'
        kept whole."""
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for sequence in sequences:
            parent = -1
            for depth, token in enumerate(sequence, start=1):
                node = child.get((parent, int(token)))
                if node is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    node = child[(parent, int(token))] = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                    depths.append(depth)
                parent = node
        return cls(tuple(tokens), tuple(parents), tuple(depths))


EMPTY = DraftTree()


@functools.lru_cache(maxsize=64)
def _ancestors(parents: tuple[int, ...]) -> torch.Tensor:
    """`DraftTree.ancestors` of a tree shape, made once per shape: a drafter proposes trees of one
    shape step after step (Medusa's choices), and the row-by-row build is the costliest part of a
    step's mask on a CPU."""
    n = len(parents)
    seen = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] = seen[parent]
        seen[i, i] = True
    return seen


# --------------------------------------------------------------------------------------------------
# Medusa: a sparse tree over the heads' top-k choices


def medusa_tree(head_topk: Sequence[Sequence[int]], choices: Sequence[Sequence[int]]) -> DraftTree:
    """The draft tree of Medusa heads (Cai et al. 2024, "Medusa", Sec. 2.1.2).

    `head_topk[k]` lists head k's candidate tokens, best first (head k guesses the token k + 1
    places after the root: depth k + 1). A choice is a path of ranks, one per depth: `(0, 1)` is
    head 0's best token followed by head 1's second best. `choices` must hold every prefix of each
    of its paths (`sparse_tree_choices` returns such a set). Two ranks of one head at the same
    depth are distinct tokens, so siblings stay distinct.
    """
    paths, parents, depths = _medusa_shape(tuple(tuple(c) for c in choices), tuple(len(top) for top in head_topk))
    tokens = tuple(int(head_topk[len(path) - 1][path[-1]]) for path in paths)
    return DraftTree(tokens, parents, depths)


@functools.lru_cache(maxsize=64)
def _medusa_shape(choices: tuple[tuple[int, ...], ...], candidates: tuple[int, ...]
                  ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]]:
    """The nodes of `medusa_tree` for heads with `candidates[k]` tokens each: every node's rank
    path, parent and depth, made once per set of choices (they do not change from step to step)."""
    paths = sorted(set(choices), key=lambda c: (len(c), c))
    node_of: dict[tuple[int, ...], int] = {}
    kept, parents, depths = [], [], []
    for path in paths:
        if len(path) > len(candidates) or any(r >= candidates[d] for d, r in enumerate(path)):
            continue  # fewer heads, or fewer candidates per head, than the choices were made for
        parent = node_of.get(path[:-1], -1) if len(path) > 1 else -1
        if len(path) > 1 and path[:-1] not in node_of:
            raise ValueError(f"Medusa choice {list(path)}: its prefix {list(path[:-1])} is not a choice")
        node_of[path] = len(kept)
        kept.append(path)
        parents.append(parent)
        depths.append(len(path))
    return tuple(kept), tuple(parents), tuple(depths)


def sparse_tree_choices(accuracy: Sequence[Sequence[float]], size: int) -> list[tuple[int, ...]]:
    """The `size` rank paths of highest expected acceptance, for `medusa_tree`.

    `accuracy[k][r]` estimates how often head k's rank-r token is the right one (measured on held-out
    data once heads are trained). A path is accepted with about the product of its ranks' accuracies,
    and the expected accepted length of a tree is the sum of that product over its nodes (Medusa,
    Sec. 2.1.2); taking paths best first adds a parent before its children (its product is larger),
    so the set is always a tree.
    """
    heads = len(accuracy)
    chosen: list[tuple[int, ...]] = []
    frontier = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))] if heads else []
    heapq.heapify(frontier)
    while frontier and len(chosen) < size:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        depth = len(path)
        if depth < heads:
            for r, acc in enumerate(accuracy[depth]):
                heapq.heappush(frontier, (neg * acc, (*path, r)))
    return chosen
