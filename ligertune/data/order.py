"""The order in which packs are trained, and how well it mixes the data within each step.

The order (`shuffled`) depends only on the packs and `(seed, epoch)`, so a run's data position is
two numbers and `--resume` continues bitwise. It is a stratified shuffle rather than a plain one: a
uniformly random order mixes only on average, and a step of k packs drawn at random holds a
source of share p about k p +- sqrt(k p (1 - p)) times (two even sources and 4 packs a step: one
step in 8 is all one source). Best-fit decreasing makes this worse than it sounds, because it
groups conversations by length: long ones are packed first, nearly alone, and the short ones end
up many to a pack, so a pack is a length class and often a single source. Steps that are all one
source or all long conversations move the model away from the mix it is meant to learn and show
as loss spikes. So:

1. every pack is given to the source that holds most of its tokens, and within each source the
   packs are cut into `LENGTH_CLASSES` classes of equal count by their mean conversation length;
2. each class is shuffled, then the classes of a source are merged so that each stays evenly
   spread (`spread`), and the sources are merged the same way.

`spread` gives item i of a group of n the key (i + u) / n, with one u ~ U[0, 1) per group, and sorts
all keys: each group then sits at evenly spaced positions with a random phase. Any window of w
consecutive items, wherever it starts, holds w p of a group of share p = n / N to within less than
1 + G p items (G groups; a window of keys of width d holds n d of each group to within one, and
w = N d to within G), where a random order strays by sqrt(w p (1 - p)) typically and by up to w
at worst. A step takes such a window: two even sources with 4 packs a step give 1 to 3 packs of
each, never 0 or 4. Within a class the order is uniformly random; each group's phase is random.

`order_report` says how far the steps of an order stray from the whole data's mix, against the
same figures for uniformly random orders (see its docstring for the metrics and the verdict);
`ligertune data RECIPE --order` prints it for the first epoch's steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ligertune.data.chat import IGNORE_INDEX
from ligertune.data.packing import Pack

T = TypeVar("T")

LENGTH_CLASSES = 4
"""Length classes per source: quartiles of the packs' mean conversation length. Enough to keep the
long, middle and short packs that best-fit decreasing makes apart; with more classes than a source
has packs in a few steps, the classes would be too small to spread (a class of one pack lands at a
random place, as in a plain shuffle)."""

RANDOM_DRAWS = 32
"""Uniformly random orders drawn to measure what chance gives (mean and standard deviation)."""

SIGMAS = 3.0
"""An order fails a check when its figure exceeds a random order's mean by this many standard
deviations of the random orders: a uniformly random order would fail about once in 700 (one-sided
normal tail), while an order that puts one source or one length class in each step sits many
deviations above."""


# --------------------------------------------------------------------------------------------------
# the order


def shuffled(packs: Sequence[Pack], *, seed: int, epoch: int) -> list[Pack]:
    """The packs in the order of epoch `epoch`: a function of the packs and `(seed, epoch)` only.

    Stratified by main source and, within it, by length class, each stratum shuffled and all of
    them spread evenly over the epoch (the module docstring says how and why).
    """
    # A string seed is hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
    rng = random.Random(f"ligertune-shuffle:{seed}:{epoch}")
    by_source: dict[int, list[int]] = {}
    for i, p in enumerate(packs):
        by_source.setdefault(main_source(p), []).append(i)
    lanes = []
    for source in sorted(by_source):
        members = sorted(by_source[source], key=lambda i: (mean_length(packs[i]), i))
        n = len(members)
        classes = [members[c * n // LENGTH_CLASSES : (c + 1) * n // LENGTH_CLASSES] for c in range(LENGTH_CLASSES)]
        classes = [c for c in classes if c]
        for c in classes:
            rng.shuffle(c)
        lanes.append(spread(classes, rng))
    return [packs[i] for i in spread(lanes, rng)]


def spread(groups: Sequence[Sequence[T]], rng: random.Random) -> list[T]:
    """The items of every group in one list, each group at evenly spaced places with a random phase.

    Item i of a group of n gets the key (i + u) / n, u ~ U[0, 1) drawn once per group; the items are
    sorted by key (equal keys, which have probability 0, by group). A window of keys of width d
    holds n d of each group to within one item, so w consecutive items of the result hold
    w n / N of a group to within 1 + G n / N (N items, G groups).
    """
    keyed = []
    for g, group in enumerate(groups):
        phase = rng.random()
        keyed.extend(((i + phase) / len(group), g, item) for i, item in enumerate(group))
    keyed.sort(key=lambda key: key[:2])
    return [item for _, _, item in keyed]


def main_source(pack: Pack) -> int:
    """The source holding most of the pack's tokens (the lowest index on a tie; 0 when unknown)."""
    if not pack.sources:
        return 0
    tokens: dict[int, int] = {}
    for source, n in zip(pack.sources, pack.seq_lens):
        tokens[source] = tokens.get(source, 0) + n
    return min(tokens, key=lambda s: (-tokens[s], s))


def mean_length(pack: Pack) -> float:
    """Mean conversation length of the pack, in tokens."""
    return sum(pack.seq_lens) / max(1, len(pack.seq_lens))


# --------------------------------------------------------------------------------------------------
# the report


@dataclass
class SourceMix:
    """One source over the steps: its share of the whole data and how far the steps stray from it."""

    name: str
    share: float
    """p_s: the source's share of the trained tokens of all packs."""
    mean_deviation: float
    """Mean over steps of |q_ts - p_s|, q_ts its share of the trained tokens of step t."""
    max_deviation: float
    """The largest |q_ts - p_s| of any step."""
    random_mean_deviation: float
    """`mean_deviation` of uniformly random orders (mean over the draws)."""


@dataclass
class Check:
    """One figure of the order against the same figure of uniformly random orders."""

    name: str
    value: float
    random_mean: float
    random_std: float
    limit: float
    """random_mean + SIGMAS * random_std: the most the order may give."""
    passed: bool


@dataclass
class OrderReport:
    """How the steps of an order mix the data (`order_report` defines every figure)."""

    packs: int
    packs_per_step: int
    steps: int
    sources: list[SourceMix]
    source_deviation: float
    """Mean over steps of the total variation 1/2 sum_s |q_ts - p_s| (0 when there is one source)."""
    source_deviation_max: float
    single_source_steps: int
    """Steps whose trained tokens all come from one source (counted when there are several)."""
    random_single_source_steps: float
    mean_length: float
    """M: mean conversation length of the whole data, in tokens."""
    length_deviation: float
    """Mean over steps of |m_t - M| / M, m_t the mean conversation length of step t."""
    length_autocorrelation: float | None
    """Lag-1 autocorrelation of m_t; None with fewer than 3 steps or no variation."""
    draws: int
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def order_report(
    packs: Sequence[Pack],
    steps: Sequence[Sequence[Pack]],
    *,
    source_names: Sequence[str],
    draws: int = RANDOM_DRAWS,
    seed: int = 0,
) -> OrderReport:
    """How far each step of `steps` strays from the mix of `packs` (the whole data, each pack once).

    `steps` are the packs of each optimizer step, e.g. the first epoch as `train` takes them:
    ceil(P / k) steps of k packs for P packs, the last one completed from the next epoch. With
    q_ts the share of step t's trained tokens (targets other than -100) that come from source s,
    p_s the same share over `packs`, m_t the mean conversation length of step t and M that of
    `packs`:

        source deviation     mean_t  1/2 sum_s |q_ts - p_s|   (total variation: the share of the
                             step's trained tokens that would have to change source to match)
        length deviation     mean_t  |m_t - M| / M
        length persistence   lag-1 autocorrelation of m_t:
                             sum_t (m_t - mean m)(m_t+1 - mean m) / sum_t (m_t - mean m)^2

    Trained tokens, because under the default `token` normalization each one weighs the same in
    the step's gradient: q_ts is the part of the step's gradient that source s makes. A step with
    no trained token is left out of the source figures.

    What is too much depends on the step size (a step of one pack holds what that pack holds) and
    on the data, so every figure is measured again on `draws` uniformly random orders of the same
    packs, stepped the same way (seeded by `seed`), and a check fails when the order's figure
    exceeds their mean by `SIGMAS` standard deviations (`Check`). Under a random order the length
    persistence is about -1/T +- 1/sqrt(T) for T steps; an order sorted by length gives nearly 1.
    The source check applies with two sources or more, the persistence check with 3 steps or more.
    """
    if not packs or not steps or not all(steps):
        raise ValueError("order_report needs packs and steps of at least one pack each")
    n_sources = max(len(source_names), 1 + max((s for p in packs for s in p.sources), default=0))
    names = [*source_names, *(f"source {i}" for i in range(len(source_names), n_sources))]
    sizes = [len(step) for step in steps]
    features = _Features(n_sources)
    table = features.rows(packs)
    whole = table.sum(0)
    ours = _step_figures(torch.stack([features.rows(step).sum(0) for step in steps]), whole, n_sources)

    generator = torch.Generator().manual_seed(seed)
    randoms = [_step_figures(_random_steps(table, sizes, generator), whole, n_sources) for _ in range(draws)]

    def check(name: str, value: float | None, key: str) -> Check | None:
        values = [r[key] for r in randoms if r[key] is not None]
        if value is None or len(values) < 2:
            return None
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        limit = mean + SIGMAS * std
        # A figure that chance never moves (one pack, one step) is judged with a rounding margin.
        return Check(name, value, mean, std, limit, value <= limit + 1e-9 * max(1.0, abs(limit)))

    checks = [
        check("source deviation", ours["source_deviation"] if n_sources > 1 else None, "source_deviation"),
        check("length deviation", ours["length_deviation"], "length_deviation"),
        check("length persistence", ours["length_autocorrelation"], "length_autocorrelation"),
    ]
    shares = (whole[:n_sources] / whole[:n_sources].sum().clamp_min(1)).tolist()
    sources = [
        SourceMix(names[s], shares[s], ours["mean_deviation"][s], ours["max_deviation"][s],
                  sum(r["mean_deviation"][s] for r in randoms) / max(1, len(randoms)))
        for s in range(n_sources)
    ]
    return OrderReport(
        packs=len(packs),
        packs_per_step=max(sizes),
        steps=len(steps),
        sources=sources,
        source_deviation=ours["source_deviation"],
        source_deviation_max=ours["source_deviation_max"],
        single_source_steps=ours["single_source_steps"],
        random_single_source_steps=sum(r["single_source_steps"] for r in randoms) / max(1, len(randoms)),
        mean_length=float(whole[n_sources + 1] / whole[n_sources].clamp_min(1)),
        length_deviation=ours["length_deviation"],
        length_autocorrelation=ours["length_autocorrelation"],
        draws=draws,
        checks=[c for c in checks if c is not None],
    )


class _Features:
    """Per pack, as a float64 row: trained tokens of each source, conversations, conversation tokens.

    Counting trained tokens reads every target once; each pack is counted once per report.
    """

    def __init__(self, n_sources: int):
        self.n_sources = n_sources
        self._rows: dict[int, torch.Tensor] = {}

    def row(self, pack: Pack) -> torch.Tensor:
        row = self._rows.get(id(pack))
        if row is None:
            values = [0.0] * (self.n_sources + 2)
            cu = pack.cu_seqlens
            for j, (start, end) in enumerate(itertools.pairwise(cu)):
                source = pack.sources[j] if pack.sources else 0
                values[source] += sum(t != IGNORE_INDEX for t in pack.targets[start:end])
            values[self.n_sources] = len(pack.seq_lens)
            values[self.n_sources + 1] = sum(pack.seq_lens)
            row = self._rows[id(pack)] = torch.tensor(values, dtype=torch.float64)
        return row

    def rows(self, packs: Sequence[Pack]) -> torch.Tensor:
        if not packs:
            return torch.zeros(0, self.n_sources + 2, dtype=torch.float64)
        return torch.stack([self.row(p) for p in packs])


def _random_steps(table: torch.Tensor, sizes: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """Step sums of the rows of `table` under uniformly random orders, one per epoch, laid end to end
    and cut into steps of `sizes` rows, as `train` takes its steps from its epochs' orders."""
    n, total = table.shape[0], sum(sizes)
    epochs = math.ceil(total / n)
    stream = torch.cat([torch.randperm(n, generator=generator) for _ in range(epochs)])[:total]
    step_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return torch.zeros(len(sizes), table.shape[1], dtype=table.dtype).index_add_(0, step_of, table[stream])


def _step_figures(step_sums: torch.Tensor, whole: torch.Tensor, n_sources: int) -> dict:
    """The figures of `order_report` from the per-step sums of the feature rows."""
    trained = step_sums[:, :n_sources]
    totals = trained.sum(1)
    kept = totals > 0
    target = whole[:n_sources] / whole[:n_sources].sum().clamp_min(1)
    deviation = (trained[kept] / totals[kept, None] - target).abs()
    tv = 0.5 * deviation.sum(1)
    lengths = step_sums[:, n_sources + 1] / step_sums[:, n_sources].clamp_min(1)
    overall = float(whole[n_sources + 1] / whole[n_sources].clamp_min(1))
    return {
        "mean_deviation": deviation.mean(0).tolist() if len(tv) else [0.0] * n_sources,
        "max_deviation": deviation.amax(0).tolist() if len(tv) else [0.0] * n_sources,
        "source_deviation": float(tv.mean()) if len(tv) else 0.0,
        "source_deviation_max": float(tv.max()) if len(tv) else 0.0,
        "single_source_steps": int(((trained[kept] > 0).sum(1) == 1).sum()) if n_sources > 1 else 0,
        "length_deviation": float(((lengths - overall).abs() / max(overall, 1e-12)).mean()),
        "length_autocorrelation": lag1_autocorrelation(lengths.tolist()),
    }


def lag1_autocorrelation(values: Sequence[float]) -> float | None:
    """sum_t (x_t - mean)(x_t+1 - mean) / sum_t (x_t - mean)^2; None for fewer than 3 values or none
    that differ (a constant sequence has no correlation to speak of)."""
    if len(values) < 3:
        return None
    mean = sum(values) / len(values)
    centred = [v - mean for v in values]
    variance = sum(c * c for c in centred)
    if variance <= 1e-12 * max(1.0, mean * mean) * len(values):
        return None
    return sum(a * b for a, b in itertools.pairwise(centred)) / variance
