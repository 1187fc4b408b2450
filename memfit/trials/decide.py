"""Which measured trial the tuner chooses: the leader when the rounds separate it from
every other trial beyond their noise, and in a tie the simplest setting.

The trials are timed in interleaved rounds (the tuner's
:func:`memfit.tuning.trials.time_in_rounds`, the Engine's :mod:`memfit.engine.split_trials`),
so the i-th timed step of two trials ran moments apart: their ratio cancels most of what
a busy moment of a shared machine did to both. For a trial against the leader (the
lowest median) the evidence is the paired ratios of their last common rounds:

- their median is the **gap** (1.04: 4% slower than the leader);
- their **noise** is the half-width of a 95% interval of that median, from the ratios'
  median absolute deviation (``1.4826 x MAD``, the normal-consistent spread, times
  ``2 / sqrt(n)``); a single round has no measured spread, so it is never separated.

A trial is **separated** from the leader when the gap exceeds 1 by more than the noise
and by more than :data:`TIE_MARGIN`, and **tied** with it otherwise. Rounds go on (the tuner decides how many) until every
trial is separated, or is within :data:`TIE_MARGIN` of the leader even at the far end of
its noise (more rounds could not make the difference worth having): the verdict is then
*settled*.

The choice is made among the leader and the trials tied with it. Where peers were
measured (settings a user reaches without the tuner: halving the micro-batch,
checkpointing every block), only settings whose median is no higher than every peer's
are eligible, so the choice is never one measured slower than a peer (the leader always
is). Of those the simplest wins: the least recompute, then the fewest micro-batches,
then the lower median.

Example::

    verdict = decide([Timed("a", [1.0, 1.1, 1.0], 0.0, 2, "halving"),
                      Timed("b", [0.7, 0.8, 0.7], 0.3, 1)])
    verdict.best.key, verdict.settled      # ("b", ...) when b is separated from a
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

#: Settings whose step times are within this share of each other are not worth separating:
#: the simpler one is as good a choice.
TIE_MARGIN = 0.02

#: The normal-consistent scale of the median absolute deviation.
_MAD_SCALE = 1.4826


@dataclass(frozen=True)
class Timed:
    """A measured trial as the decision sees it."""

    key: Hashable
    """What identifies the trial to the caller (its row)."""
    seconds: Sequence[float]
    """Its timed steps, one per round, in order."""
    recompute_fraction: float
    accumulation_steps: int
    peer: str | None = None
    """``"halving"`` or ``"per-block"`` for a usual fix the tuner measures beside its own
    candidates; None for a candidate of its own."""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class Gap:
    """A trial's step time against the leader's, over the rounds both were timed in."""

    ratio: float
    """The median of the paired ratios (1.04: 4% slower than the leader)."""
    noise: float
    """The half-width of the ratio's 95% interval, as a ratio (0.01: +-1%); infinite
    from a single round."""
    rounds: int

    @property
    def separated(self) -> bool:
        """Slower than the leader beyond the noise and by more than :data:`TIE_MARGIN`."""
        return self.ratio - 1.0 > max(self.noise, TIE_MARGIN)

    @property
    def settled(self) -> bool:
        """Separated, or within :data:`TIE_MARGIN` of the leader at its noise's far end."""
        return self.separated or abs(self.ratio - 1.0) + self.noise < TIE_MARGIN


def gap(seconds: Sequence[float], leader: Sequence[float]) -> Gap:
    """``seconds`` against ``leader``, paired over their last common rounds.

    Example::

        gap([1.1, 1.2, 1.1], [1.0, 1.1, 1.0]).separated   # True: 10% slower every round
    """
    n = min(len(seconds), len(leader))
    if n == 0:
        return Gap(math.inf, math.inf, 0)
    ratios = [a / b for a, b in zip(seconds[-n:], leader[-n:])]
    ratio = statistics.median(ratios)
    if n < 2:
        return Gap(ratio, math.inf, n)
    mad = statistics.median(abs(r - ratio) for r in ratios)
    return Gap(ratio, 2.0 * _MAD_SCALE * mad / math.sqrt(n), n)


@dataclass(frozen=True)
class Verdict:
    """The choice among measured trials and how firmly the rounds made it."""

    best: Timed
    leader: Timed
    """The lowest median."""
    tied: tuple[Timed, ...]
    """The leader and the trials not separated from it."""
    gaps: dict[Hashable, Gap]
    """Each other trial's gap to the leader, by key."""
    settled: bool
    """Every trial separated from the leader or tied within :data:`TIE_MARGIN`."""

    def describe(self) -> str:
        """One sentence: why ``best`` was chosen.

        Example::

            verdict.describe()   # "fastest, separated from every other trial (next: +12% +-3%)"
        """
        others = [g for k, g in self.gaps.items() if k != self.leader.key]
        if len(self.tied) == 1:
            if not others:
                return "the only trial measured"
            nearest = min(others, key=lambda g: g.ratio)
            return (
                f"fastest, separated from every other trial (the next "
                f"{_percent(nearest.ratio - 1)} {_noise(nearest)})"
            )
        how = "tied" if self.settled else "not separated after the rounds allowed"
        chosen = (
            "the fastest chosen"
            if self.best is self.leader
            else "the simplest of them chosen (less recompute, fewer micro-batches)"
        )
        return f"{len(self.tied)} trials {how} within their noise with the fastest; {chosen}"


def decide(trials: Sequence[Timed]) -> Verdict:
    """The verdict over ``trials`` (each with at least one timed step).

    Raises:
        ValueError: no trials.

    Example::

        decide(timed).best.key
    """
    if not trials:
        raise ValueError("decide() needs at least one measured trial")
    leader = min(trials, key=lambda t: t.median)
    gaps = {t.key: gap(t.seconds, leader.seconds) for t in trials if t is not leader}
    tied = (leader, *(t for t in trials if t is not leader and not gaps[t.key].separated))
    peers = [t.median for t in trials if t.peer is not None]
    eligible = [t for t in tied if not peers or t.median <= min(peers)]
    best = min(eligible, key=lambda t: (t.recompute_fraction, t.accumulation_steps, t.median))
    settled = all(g.settled for g in gaps.values())
    return Verdict(best, leader, tied, gaps, settled)


def _percent(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _noise(g: Gap) -> str:
    return "(one round)" if math.isinf(g.noise) else f"+-{g.noise * 100:.1f}%"


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of ``xs`` and ``ys`` (tied values get their mean rank);
    None for fewer than three pairs or a constant side.

    Example::

        rank_correlation([1, 2, 3], [10, 30, 20])   # 0.5
    """
    if len(xs) != len(ys) or len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
