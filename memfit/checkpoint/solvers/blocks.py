"""Planning block by block: the approximate plan that large trees of repeated blocks need."""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from itertools import accumulate
from operator import add

from memfit.checkpoint.costs import KEEP, Decision
from memfit.checkpoint.solvers import limits
from memfit.checkpoint.solvers.frontier import SEGMENT, START, Point, Steps, named
from memfit.checkpoint.solvers.nodes import FlatUnit
from memfit.checkpoint.solvers.plan_cost import NodePlan, Segments
from memfit.checkpoint.solvers.search import Bounds, Pass, TooLarge


def by_blocks(nodes: list[FlatUnit], cap: float, loss: float, bounds: Bounds) -> NodePlan | None:
    """A plan made block by block, for the unit with the most children (the model's block
    list; everything else keeps): each block planned exactly on its own, its options the
    lower convex hull of (kept, time), each with its highest rebuild; then, from every
    block's least-kept option, the upgrade that saves the most time per byte kept, while
    its rebuild, the rebuilds after it and the end of forward still fit (a multiple-choice
    knapsack, greedily). Segments across blocks are not tried. None when it finds no plan
    that fits.

    Blocks alike in every number (a model's repeated blocks) are walked once: a block's
    walk reads nothing outside it, so its options are those of the first block like it,
    with every unit shifted by the distance between the two."""
    spine = max(nodes, key=lambda n: (len(n.children), -n.index))
    blocks = spine.children
    if len(blocks) < 2:
        return None
    # Everything outside the spine keeps: what the units before it (in forward order,
    # its ancestors included) and the spine itself save, and what the units after it save.
    size = [1] * len(nodes)
    for node in reversed(nodes):
        size[node.index] += sum(size[c] for c in node.children)
    base = sum(n.own_saved_bytes for n in nodes[: spine.index + 1])
    after = sum(n.own_saved_bytes for n in nodes[spine.index + size[spine.index] :])
    menus: list[list[Point]] = []
    shifts: list[int] = []  # per block, how far its units lie from those its menu names
    walked: dict[Hashable, tuple[int, list[Point]]] = {}
    for b in blocks:
        shape = _shape(nodes, bounds, b, size[b])
        if shape not in walked:
            walk = Pass(nodes, bounds, cap, loss, least_peak=False)
            walk.work = limits.BLOCK_WORK  # each block is walked exactly, or not at all
            try:
                pieces, kept = walk.visit(b, [START], 0.0)
            except TooLarge:
                return None
            by_kept = sorted(named(pieces + kept), key=lambda p: (p.kept_bytes, p.seconds))
            walked[shape] = (b, _lower_hull(by_kept))
        first, hull = walked[shape]
        if not hull:
            return None
        menus.append(hull)
        shifts.append(b - first)
    choice = [0] * len(blocks)
    # The chosen options' kept bytes and highest rebuilds, block by block; the bytes kept
    # before each block, summed in forward order, and its rebuild's peak.
    kept = [m[0].kept_bytes for m in menus]
    rebuilds = [m[0].rebuild_bytes for m in menus]
    before = [base]
    peaks: list[float] = []

    def state(b: int) -> float:
        """Sum again from block ``b`` on (the choices before it are as they were); the
        bytes kept at the end of forward."""
        sums = list(accumulate(kept[b:], add, initial=before[b]))
        total = sums.pop()
        before[b:] = sums
        peaks[b:] = map(add, sums, rebuilds[b:])
        return total + after

    def gain(m: list[Point], i: int) -> float:
        """Time saved per byte kept by upgrading from option ``i`` to ``i + 1``."""
        return (m[i].seconds - m[i + 1].seconds) / max(m[i + 1].kept_bytes - m[i].kept_bytes, 1e-9)

    end = state(0)
    if max(peaks, default=0.0) > cap or end + loss > cap:
        return None
    heap = []
    for b, m in enumerate(menus):
        if len(m) > 1:
            heapq.heappush(heap, (-gain(m, 0), b))
    while heap:
        _, b = heapq.heappop(heap)
        m, i = menus[b], choice[b]
        grow = m[i + 1].kept_bytes - m[i].kept_bytes
        fits = before[b] + m[i + 1].rebuild_bytes <= cap and end + grow + loss <= cap
        # The rebuilds after it grow too (the longest check last).
        if fits and max(peaks[b + 1 :], default=0.0) + grow <= cap:
            choice[b] = i + 1
            kept[b], rebuilds[b] = m[i + 1].kept_bytes, m[i + 1].rebuild_bytes
            end = state(b)
            if i + 2 < len(m):
                heapq.heappush(heap, (-gain(m, i + 1), b))
    decision: list[Decision] = [KEEP] * len(nodes)
    segs: Segments = {}
    for m, i, shift in zip(menus, choice, shifts, strict=True):
        segs.update(_apply_steps(m[i].steps, shift, decision))
    plan = NodePlan(decision, segs)
    return plan if plan.peak(nodes, loss) <= cap else None


def _shape(nodes: list[FlatUnit], bounds: Bounds, b: int, size: int) -> tuple:
    """Everything a walk of block ``b`` (the ``size`` units from ``b`` on, in pre-order)
    reads, with units numbered from the block's start: equal for blocks alike."""
    low, keep_low = bounds
    return tuple((low[v], keep_low[v], nodes[v].shape(b)) for v in range(b, b + size))


def _apply_steps(steps: Steps, shift: int, decision: list[Decision]) -> Segments:
    """Set the decisions a block's option makes, its units ``shift`` further on, into
    ``decision``; returns its segments (each unit's ranges in order)."""
    segs: Segments = {}
    while steps is not None:
        steps, (kind, u, i, j) = steps
        if kind == SEGMENT:
            segs.setdefault(u + shift, []).append((i, j))
        else:
            decision[u + shift] = kind  # type: ignore[assignment]
    for ranges in segs.values():
        ranges.sort()
    return segs


def _lower_hull(points: list[Point]) -> list[Point]:
    """The lower convex hull of (kept, time), of points sorted by kept then time: the
    options a greedy upgrade walks."""
    hull: list[Point] = []
    for p in points:
        if hull and p.seconds >= hull[-1].seconds:
            continue
        while len(hull) >= 2:
            (k1, s1), (k2, s2) = hull[-2][:2], hull[-1][:2]
            if (s2 - s1) * (p.kept_bytes - k1) >= (p.seconds - s1) * (k2 - k1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull
