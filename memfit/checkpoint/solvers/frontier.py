"""Frontier points: the public (peak, time) trade-off, and the optimal search's own points.

The search walks the tree carrying frontiers, lists of points Pareto-optimal in (bytes kept
so far, recompute time). A point is laid out as :class:`Point`; in the walk's inner loops
points are made as plain tuples of that layout (a named tuple costs about twice as much to
make, and the walk makes millions), read by unpacking or by the indices below. Walks hand
their results back as :class:`Point`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple


@dataclass(frozen=True)
class FrontierPoint:
    """One Pareto-optimal trade-off: no plan is both smaller and cheaper.

    >>> FrontierPoint(peak_bytes=2**30, recompute_seconds=0.01, recompute_flops=3e9)
    FrontierPoint(peak_bytes=1073741824, recompute_seconds=0.01, recompute_flops=3000000000.0)
    """

    peak_bytes: float
    """Predicted peak of a training step, static bytes included."""
    recompute_seconds: float
    """Extra time spent recomputing, per step: the rebuilds' forward time and the
    checkpoint machinery's cost per piece."""
    recompute_flops: float
    """Extra forward FLOPs spent recomputing, per step."""


def pareto(points: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The (peak, seconds, flops) points no other point beats in peak and (seconds, flops),
    by increasing peak."""
    out: list[tuple[float, float, float]] = []
    best = (math.inf, math.inf)
    for p in sorted(points):
        if (p[1], p[2]) < best:
            out.append(p)
            best = (p[1], p[2])
    return out


#: One choice: ``(kind, unit, start, end)``: ``kind`` is ``RECOMPUTE`` or ``SELECTIVE``
#: (``unit`` recomputed; start = end = 0) or SEGMENT (children ``start..end`` of ``unit``).
Step = tuple[str, int, int, int]
#: A point's choices, a linked list for reconstruction: None (nothing recomputed yet), or
#: ``(previous, step)`` (a pair, not the step spread out: the walk makes one for every point
#: of every piece, and all the points of one piece share its step).
Steps = tuple["Steps", Step] | None
SEGMENT = "segment"


class Point(NamedTuple):
    """One plan of the part of the tree walked so far."""

    kept_bytes: float
    """Bytes kept so far (by the end of the walked part of forward)."""
    seconds: float
    """Recompute time so far."""
    flops: float
    """Recompute FLOPs so far."""
    rebuild_bytes: float
    """The highest rebuild so far, what is kept before it included."""
    steps: Steps
    """The choices that made the plan."""


# Point's fields by index, for the inner loops over plain tuples.
KEPT, SECONDS, FLOPS, REBUILD, STEPS = range(len(Point._fields))

#: The orders frontiers are pruned in: by kept bytes, then by these keys: time (then FLOPs,
#: then the highest rebuild), or the highest rebuild (then time, then FLOPs) in the
#: least-peak walk. Both leave the steps out.
TIME_TIES = itemgetter(SECONDS, FLOPS, REBUILD)
REBUILD_TIES = itemgetter(REBUILD, SECONDS, FLOPS)

#: The point walks start from: nothing kept, nothing recomputed.
START = Point(0.0, 0.0, 0.0, 0.0, None)


def named(points: list) -> list[Point]:
    """A walk's plain-tuple points as :class:`Point`."""
    return [Point._make(p) for p in points]
