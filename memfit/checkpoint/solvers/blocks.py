"""Planning block by block: the approximate plan that large trees of repeated blocks need."""

from __future__ import annotations

import heapq

from memfit.checkpoint.costs import KEEP
from memfit.checkpoint.solvers import limits
from memfit.checkpoint.solvers.frontier import START, Point, named
from memfit.checkpoint.solvers.nodes import FlatUnit
from memfit.checkpoint.solvers.plan_cost import NodePlan, Segments
from memfit.checkpoint.solvers.search import Bounds, Pass, TooLarge, rebuild_plan


def by_blocks(nodes: list[FlatUnit], cap: float, loss: float, bounds: Bounds) -> NodePlan | None:
    """A plan made block by block, for the unit with the most children (the model's block
    list; everything else keeps): each block planned exactly on its own, its options the
    lower convex hull of (kept, time), each with its highest rebuild; then, from every
    block's least-kept option, the upgrade that saves the most time per byte kept, while
    its rebuild, the rebuilds after it and the end of forward still fit (a multiple-choice
    knapsack, greedily). Segments across blocks are not tried. None when it finds no plan
    that fits."""
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
    for b in blocks:
        walk = Pass(nodes, bounds, cap, loss, least_peak=False)
        walk.work = limits.BLOCK_WORK  # each block is walked exactly, or not at all
        try:
            pieces, kept = walk.visit(b, [START], 0.0)
        except TooLarge:
            return None
        hull = _lower_hull(sorted(named(pieces + kept), key=lambda p: (p.kept_bytes, p.seconds)))
        if not hull:
            return None
        menus.append(hull)
    choice = [0] * len(blocks)

    def state() -> tuple[list[float], list[float], float]:
        before, peaks, k = [], [], base
        for m, i in zip(menus, choice, strict=True):
            before.append(k)
            peaks.append(k + m[i].rebuild_bytes)
            k += m[i].kept_bytes
        return before, peaks, k + after

    def gain(m: list[Point], i: int) -> float:
        """Time saved per byte kept by upgrading from option ``i`` to ``i + 1``."""
        return (m[i].seconds - m[i + 1].seconds) / max(m[i + 1].kept_bytes - m[i].kept_bytes, 1e-9)

    before, peaks, end = state()
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
        later = max(peaks[b + 1 :], default=0.0)
        fits = before[b] + m[i + 1].rebuild_bytes <= cap
        if fits and later + grow <= cap and end + grow + loss <= cap:
            choice[b] = i + 1
            before, peaks, end = state()
            if i + 2 < len(m):
                heapq.heappush(heap, (-gain(m, i + 1), b))
    decision = [KEEP] * len(nodes)
    segs: Segments = {}
    for m, i in zip(menus, choice, strict=True):
        part = rebuild_plan(nodes, m[i].steps)
        for v, d in enumerate(part.decision):
            if d != KEEP:
                decision[v] = d
        for v, r in part.segs.items():
            segs.setdefault(v, []).extend(r)
    plan = NodePlan(decision, segs)
    return plan if plan.peak(nodes, loss) <= cap else None


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
