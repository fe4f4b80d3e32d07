"""The loss-spike watch: a step whose loss stands far above the recent ones.

Over the last W finite step losses x_1..x_W (`train.spike_window`), with median M and median
absolute deviation MAD = median_i |x_i - M|, the robust standard deviation is
s = 1.4826 MAD (the factor makes s the standard deviation for normally distributed losses).
A finite loss x is a spike when

    (x - M) / s > k          (`train.spike_threshold`, default 6)

Only rises count: a falling loss is progress. Median and MAD ignore a few outliers, so a spike in
the window does not hide the next one, while a lasting change of level (a new data mix) becomes the
new normal once it fills half the window. Where the losses are flat to the last bit (MAD 0), s is
floored at 1e-3 |M|, so that a loss must rise by at least k per mille of the median to count. The
watch starts once it holds W losses; every finite loss enters it after being judged, spike or not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MAD_TO_STD = 1.4826
"""1 / Phi^-1(3/4): MAD x this estimates the standard deviation of a normal distribution."""

FLAT_FLOOR = 1e-3
"""The smallest robust deviation, relative to the median's size, for losses that do not move."""


@dataclass(frozen=True)
class Spike:
    """A loss judged a spike, and what it was judged against."""

    loss: float
    median: float
    deviation: float
    """The robust standard deviation s = 1.4826 MAD (floored)."""
    score: float
    """(loss - median) / deviation."""


def find_spike(loss: float, recent: Sequence[float], *, threshold: float, window: int) -> Spike | None:
    """`loss` judged against the last `window` of `recent` (finite losses, oldest first): the spike,
    or None (also while fewer than `window` losses are known, or for a loss that is not finite)."""
    recent = recent[-window:]
    if len(recent) < window or not math.isfinite(loss):
        return None
    median = statistics.median(recent)
    mad = statistics.median(abs(x - median) for x in recent)
    deviation = max(MAD_TO_STD * mad, FLAT_FLOOR * abs(median), math.ulp(abs(median)))
    score = (loss - median) / deviation
    return Spike(loss, median, deviation, score) if score > threshold else None


def remember(recent: Sequence[float], loss: float, *, window: int) -> list[float]:
    """`recent` with `loss` appended, keeping the last `window` (non-finite losses are not kept)."""
    kept = [*recent, loss] if math.isfinite(loss) else list(recent)
    return kept[-window:]
