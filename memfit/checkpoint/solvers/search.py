"""The optimal search's walks: one pass of the tree under a cap, and the passes of a solve.

A pass walks the tree in forward order. Its state is a frontier: the plans of everything
walked so far that are Pareto-optimal in (bytes kept so far, recompute time), each a point
laid out as :class:`~memfit.checkpoint.solvers.frontier.Point`, its steps the choices made.
A cap on the peak above static turns every rebuild into a constraint on the bytes kept
before it, which the walk checks as it goes; so one pass finds the cheapest plan under one
cap, exactly.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import islice
from operator import itemgetter

from memfit.checkpoint.costs import KEEP, RECOMPUTE, SELECTIVE
from memfit.checkpoint.solvers import limits
from memfit.checkpoint.solvers.frontier import (
    FLOPS,
    KEPT,
    REBUILD,
    REBUILD_TIES,
    SECONDS,
    SEGMENT,
    START,
    TIME_TIES,
    Point,
    Step,
    Steps,
    named,
)
from memfit.checkpoint.solvers.nodes import FlatUnit
from memfit.checkpoint.solvers.plan_cost import NodePlan, Segments

Bounds = tuple[list[float], list[float]]
"""Per unit, the least it keeps under any plan, and the least it keeps when kept."""


def least_kept(nodes: list[FlatUnit]) -> Bounds:
    """Lower bounds on the bytes each unit keeps under any plan, and when it keeps."""
    low = [0.0] * len(nodes)
    keep_low = [0.0] * len(nodes)
    for node in reversed(nodes):
        chain = node.is_chain()
        # In a chain, a recomputable child may sit inside a segment and keep nothing.
        inner = sum(0.0 if chain and nodes[c].can_recompute else low[c] for c in node.children)
        keep_low[node.index] = low[node.index] = node.own_saved_bytes + inner
        if node.can_recompute:
            low[node.index] = min(low[node.index], node.input_bytes)
    return low, keep_low


# A point's kept bytes: frontiers are sorted by them, so a cap on them cuts a frontier at
# one place, found by bisection.
_KEPT_OF = itemgetter(KEPT)
_SECONDS_OF = itemgetter(SECONDS)


class TooLarge(Exception):
    """An exact pass outgrew its work limit; the approximate passes take over."""


# Distances from a segment's end to its start that approximate passes try.
_GEOMETRIC = sorted({1, 2, 3} | {1 << e for e in range(2, 20)} | {3 << e for e in range(1, 19)})


class Pass:
    """One walk of the tree under a cap on the peak above static.

    ``least_peak=False``: frontiers in (kept, time), every rebuild within ``cap``; the
    cheapest final point is the cheapest plan whose peak is within ``cap``.
    ``least_peak=True``: frontiers in (kept, highest rebuild), for the smallest peak any
    plan reaches (``cap`` then only bounds the search).

    Points that cannot lead to a plan are dropped as the walk goes: those whose kept bytes,
    plus the least that the rest of the walk must keep, pass the cap, and those slower than
    ``seconds`` (the time of a plan already known to fit).

    Frontiers are lists of points, plain tuples laid out as ``Point`` (see the frontier
    module), sorted by kept bytes; the loops below unpack them as ``k, s, f, h, ref``: kept
    bytes, seconds, FLOPs, highest rebuild, steps.
    """

    def __init__(
        self,
        nodes: list[FlatUnit],
        bounds: Bounds,
        cap: float,
        loss: float,
        least_peak: bool,
        seconds: float = math.inf,
        thin: bool = False,
    ) -> None:
        self.nodes = nodes
        self.low, self.keep_low = bounds
        self.cap = cap
        self.limit = cap - loss  # kept bytes only grow, and must end within this
        self.least_peak = least_peak
        self.seconds = seconds
        self.work = limits.EXACT_WORK
        self.thin = thin

    def run(self) -> list[Point]:
        """The final frontier."""
        ended, kept = self.visit(0, [START], 0.0)
        if ended and kept:
            return named(self.prune(ended + kept))
        return named(ended or kept)

    # -- frontiers

    def prune(self, points: list) -> list:
        """Sort by kept bytes and drop dominated points (thin them past the work limit)."""
        self.work -= len(points)
        out = _least_rebuilds(points) if self.least_peak else _fastest(points)
        if self.thin:
            return self.thinned(out, limits.THIN_POINTS)
        if self.work < 0:
            raise TooLarge
        return out

    @staticmethod
    def thinned(points: list, count: int) -> list:
        # Split the kept range into ``count`` equal slices and keep the fastest point of
        # each (the last), and the least-kept point of all: every kept plan is real, only
        # some in-between trade-offs are lost.
        if len(points) <= count:
            return points
        low, high = points[0][KEPT], points[-1][KEPT]
        width = (high - low) / count or 1.0
        out = [points[0]]
        append = out.append
        # A point is the last of its slice when the next one lies in another.
        p = points[1]
        slice_p = (p[KEPT] - low) // width
        for q in islice(points, 2, None):
            slice_q = (q[KEPT] - low) // width
            if slice_q != slice_p:
                append(p)
            p, slice_p = q, slice_q
        append(points[-1])
        return out

    def rebuilt(
        self,
        frontier: list,
        add: float,
        rebuild: float,
        secs: float,
        flops: float,
        limit: float,
        how: Step,
    ) -> list:
        """The frontier after a recomputed piece that keeps ``add`` bytes and, when rebuilt,
        holds ``rebuild`` bytes above what was kept before it. ``how``: the step's kind,
        unit, start and end."""
        top = min(self.cap - rebuild, limit - add)
        # By increasing k: the points up to the first that keeps more than ``top``.
        cut = bisect_right(frontier, top, key=_KEPT_OF)
        points = frontier if cut == len(frontier) else frontier[:cut]
        # By time, the cap is checked as the walk goes; the highest rebuild is carried to
        # break ties: of two plans as fast with as much kept, the one whose rebuilds peak
        # lower (pieces earlier in the step) sorts first and is the one kept.
        slowest = self.seconds - secs
        if self.least_peak or slowest == math.inf:  # no plan known to fit: none too slow
            return [
                (k + add, s + secs, f + flops, h if h > (high := k + rebuild) else high, (ref, how))
                for k, s, f, h, ref in points
            ]
        return [
            (k + add, s + secs, f + flops, h if h > (high := k + rebuild) else high, (ref, how))
            for k, s, f, h, ref in points
            if s <= slowest
        ]

    # -- the walk

    def visit(
        self, u: int, frontier: list, after: float, keep_in: list | None = None
    ) -> tuple[list, list]:
        """The frontiers after unit ``u`` (pieces ending at ``u``, and ``u`` kept), from
        ``frontier`` (``keep_in`` for the keep option, when it differs: see ``boundary``).
        ``after``: the least the rest of the walk must keep."""
        node = self.nodes[u]
        limit = self.limit - after
        pieces: list = []
        if node.can_recompute:
            pieces += self.rebuilt(
                frontier,
                node.input_bytes,
                node.rebuild_hold_bytes,
                node.rebuild_seconds,
                node.rebuild_flops,
                limit,
                (RECOMPUTE, u, 0, 0),
            )
        if node.offers_selective:
            pieces += self.rebuilt(
                frontier,
                node.input_bytes + node.matmul_saved_bytes,
                node.rebuild_hold_bytes,
                node.selective_seconds,
                node.selective_flops,
                limit,
                (SELECTIVE, u, 0, 0),
            )
        if len(pieces) > 1 and node.offers_selective:
            pieces = self.prune(pieces)
        # Keep: the unit's own saved bytes are counted from its start (a bound: some of its
        # ops may run between children, whose rebuilds would then not see them), but for
        # those saved after its last child, which backward frees before reaching any child.
        tail = node.own_saved_after_children_bytes
        kept = self.kept_own(node, frontier if keep_in is None else keep_in, limit)
        inner_ended: list = []
        if kept and node.children:
            if node.is_chain():
                inner_ended, kept = self.chain(node, kept, after + tail)
            else:
                inner_ended, kept = self.sequence(node, kept, after + tail)
            if tail:
                kept = [(k + tail, s, f, h, r) for k, s, f, h, r in kept if k + tail <= limit]
                inner_ended = [
                    (k + tail, s, f, h, r) for k, s, f, h, r in inner_ended if k + tail <= limit
                ]
        hold = node.kept_hold_bytes
        if hold and not node.children:
            # A kept leaf's backward runs with all kept through it still held, and its
            # forward ran so: a rebuild of sorts, checked against the cap the same way.
            kept = self.held_through(kept, hold)
            inner_ended = self.held_through(inner_ended, hold)
        # A kept unit whose last child ended a piece ends with that piece too.
        if inner_ended:
            pieces = self.prune(pieces + inner_ended) if pieces else inner_ended
        return pieces, kept

    def kept_own(self, node: FlatUnit, source: list, limit: float) -> list:
        """``source`` with ``node`` kept: its own saved bytes added (but for those saved
        after its last child), the points that cannot finish within ``limit`` dropped."""
        own = node.own_saved_bytes - node.own_saved_after_children_bytes
        cut = bisect_right(source, limit - self.keep_low[node.index], key=_KEPT_OF)
        if own:
            return [(k + own, s, f, h, r) for k, s, f, h, r in islice(source, cut)]
        return source[:cut]  # k + 0.0 is k: the points themselves

    def held_through(self, frontier: list, hold: float) -> list:
        """``frontier`` after a kept unit whose own backward holds ``hold`` bytes above
        what is kept through it: points over the cap dropped, the highest rebuild raised."""
        cut = bisect_right(frontier, self.cap - hold, key=_KEPT_OF)
        return [
            (k, s, f, h if h > (high := k + hold) else high, ref)
            for k, s, f, h, ref in islice(frontier, cut)
        ]

    def boundary(self, ended: list, kept: list, nxt: int | None) -> tuple[list, list]:
        """(all, keep_in) before sibling ``nxt``: when a piece ended just before it and
        ``nxt`` is kept, the piece's output that ``nxt`` saves stays held (the piece's saved
        bytes, now freed, had counted it), and a leaf's forward holds the rest of its input
        (``FlatUnit.after_piece_hold_bytes``, checked against the cap here). ``ended``: the
        points whose last unit ended with a piece; ``kept``: the others."""
        merged = self.prune(ended + kept) if ended and kept else (ended or kept)
        if nxt is None or not ended:
            return merged, merged
        node = self.nodes[nxt]
        shared = node.input_saved_by_both_bytes
        more = not node.children and node.after_piece_hold_bytes > node.kept_hold_bytes
        if not shared and not more:
            return merged, merged
        moved = [(k + shared, s, f, h, r) for k, s, f, h, r in ended] if shared else ended
        if more:  # the leaf's forward moment: what it saves, and what it holds above that
            moved = self.held_through(moved, node.own_saved_bytes + node.after_piece_hold_bytes)
        return merged, self.prune(moved + kept) if kept else moved

    def unmetered(self) -> bool:
        """Whether the walk's count of points no longer matters: an approximate walk for
        time, once past ``REFINE_WORK`` points (it raises no ``TooLarge``, and the only
        reading of its count, whether to walk again, is decided). Only then may
        :meth:`past_pieces` leave pieces out uncounted."""
        return (
            self.thin
            and not self.least_peak
            and limits.EXACT_WORK - self.work >= limits.REFINE_WORK
        )

    def past_pieces(self, u: int, frontier: list, after: float, nxt: int) -> list | None:
        """The frontier before sibling ``nxt`` when leaf ``u`` (walked from ``frontier``)
        can only be kept: what ``visit`` and ``boundary`` make, without making the pieces;
        or None when that is not shown (``visit`` then walks the leaf).

        A piece made from a point is behind the kept point made from the same one when it
        keeps at least as much and takes at least as long, and more of one of the two: in
        a GPT block the projections and norms save their input and nothing else (8 of 19
        units), so recomputing one keeps as much and takes longer, and recomputing it
        selectively keeps its input and its outputs. Such a piece never outranks a point
        in a prune (one as good comes first, or ties it and wins by time), and prunes
        measure their slices on the points that stay: merged with the kept points, the
        pieces drop out, and the boundary's merge is the kept points, pruned when any piece
        would have reached it (as they are, as ``boundary`` leaves them, when none would).
        Shifted by what ``nxt`` holds of them, they lie further behind still. Every piece
        is behind when, for each option: the points it is made from are among the kept
        ones (the cuts by kept bytes and a kept leaf's backward hold leave them in), it
        adds no less than the keep does and no negative time, and either its bytes beyond
        the keep's or its time exceed what rounding a sum can take back (an ulp). Prunes
        count pieces (``prune``); see :meth:`unmetered` for why these may go uncounted."""
        node = self.nodes[u]
        if node.children or self.nodes[nxt].input_saved_by_both_bytes < 0.0:
            return None
        options = []  # (bytes kept, seconds, FLOPs) of each piece
        if node.can_recompute:
            options.append((node.input_bytes, node.rebuild_seconds, node.rebuild_flops))
        if node.offers_selective:
            options.append(
                (
                    node.input_bytes + node.matmul_saved_bytes,
                    node.selective_seconds,
                    node.selective_flops,
                )
            )
        if not options:
            return None
        own = node.own_saved_bytes - node.own_saved_after_children_bytes
        limit = self.limit - after
        kept = self.kept_own(node, frontier, limit)
        if node.kept_hold_bytes:
            kept = self.held_through(kept, node.kept_hold_bytes)
        reached = False  # whether any piece would have been made
        for add, secs, flops in options:
            if not (add >= own and 0.0 <= secs < math.inf and flops >= 0.0):
                return None
            # The points the piece is made from, as ``rebuilt`` cuts them.
            cut = bisect_right(
                frontier, min(self.cap - node.rebuild_hold_bytes, limit - add), key=_KEPT_OF
            )
            if not cut:
                continue
            if cut > len(kept):
                return None
            # The largest sum k + add or k + own is at most ``most``: each rounds by at most
            # half its ulp, and add - own by as much.
            most = max(abs(frontier[0][KEPT]), abs(frontier[cut - 1][KEPT])) + max(
                abs(add), abs(own)
            )
            times = None
            if not (most < math.inf and add - own > 2 * math.ulp(most)):
                times = list(map(_SECONDS_OF, islice(frontier, cut)))
                widest = max(max(times), -min(times))
                # Not more bytes for sure: more time for sure (s + secs > s for every s).
                if not (widest < math.inf and math.ulp(widest) <= secs):
                    return None
            if not reached:
                slowest = self.seconds - secs  # as ``rebuilt`` drops the slower points
                if slowest == math.inf:
                    reached = True
                else:
                    if times is None:
                        times = list(map(_SECONDS_OF, islice(frontier, cut)))
                    reached = min(times) <= slowest
        if not reached:  # no piece: ``boundary`` merges nothing
            return self.boundary([], kept, nxt)[0]
        return self.prune(kept)

    def sequence(self, node: FlatUnit, frontier: list, after: float) -> tuple[list, list]:
        """Children of a unit that are not a chain memfit iterates: one after another.
        Returns the frontiers after the last child: ended with a piece, and the others."""
        low = self.low
        kids = node.children
        rest = sum(low[c] for c in kids)
        current, keep_in = frontier, frontier
        last = len(kids) - 1
        for pos in range(last):
            c, nxt = kids[pos], kids[pos + 1]
            rest -= low[c]
            merged = None
            if keep_in is current and self.unmetered():
                merged = self.past_pieces(c, current, after + rest, nxt)
            if merged is not None:
                current = keep_in = merged
            else:
                ended, kept = self.visit(c, current, after + rest, keep_in)
                current, keep_in = self.boundary(ended, kept, nxt)
            if not current:
                return [], []
        rest -= low[kids[last]]
        return self.visit(kids[last], current, after + rest, keep_in)

    def chain(self, node: FlatUnit, frontier: list, after: float) -> tuple[list, list]:
        """Children of a sequential unit, each on its own or in segments of two or more."""
        nodes, low = self.nodes, self.low
        kids = node.children
        # What the children after position j must keep at least (recomputable ones may be
        # segment members, which keep nothing).
        rest = [0.0] * (len(kids) + 1)
        for pos in range(len(kids) - 1, -1, -1):
            c = kids[pos]
            rest[pos] = rest[pos + 1] + (0.0 if nodes[c].can_recompute else low[c])
        before = [frontier]  # before[i]: the frontier before child i
        # Where segments start from: in approximate passes, thinned further (a long chain
        # tries every start for every end).
        from_ = [self.thinned(frontier, limits.SEGMENT_POINTS) if self.thin else frontier]
        keep_in = frontier  # the same, for child i's keep option
        live: list[int] = []  # segment starts that can still be extended
        for j, c in enumerate(kids):
            if before[j]:
                ended, kept = self.visit(c, before[j], after + rest[j + 1], keep_in)
            else:
                ended, kept = [], []
            if nodes[c].can_recompute:
                limit = self.limit - after - rest[j + 1]
                still = []
                if self.thin:  # only starts at geometric distances (see the limits module)
                    starts = [j - d for d in _GEOMETRIC if j - d >= node.run_start[j]]
                else:
                    starts = live
                for i in starts:
                    start = from_[i]
                    rebuild = node.segment_hold_bytes(i, j)
                    if not start or start[0][KEPT] + rebuild > self.cap:
                        continue  # longer segments from i only save more: it stays dead
                    still.append(i)
                    ended += self.rebuilt(
                        start,
                        node.child_input_bytes[i],
                        rebuild,
                        node.segment_seconds(i, j),
                        node.segment_flops(i, j),
                        limit,
                        (SEGMENT, node.index, i, j),
                    )
                live = [*still, j]
            else:
                live = []
            if len(ended) > 1:
                ended = self.prune(ended)
            if j + 1 == len(kids):
                return ended, kept
            merged, keep_in = self.boundary(ended, kept, kids[j + 1])
            before.append(merged)
            from_.append(self.thinned(merged, limits.SEGMENT_POINTS) if self.thin else merged)
        return [], before[-1]


def _fastest(points: list) -> list:
    """The points that no point keeping as little beats in (seconds, FLOPs), by increasing
    kept bytes, sorted by kept bytes and TIME_TIES. The sort is by kept bytes alone
    (floats compare faster than tuples): of the points that keep as much, only the first
    by TIME_TIES can be kept, and it is found as the scan passes them."""
    out: list = []
    if not points:
        return out
    append = out.append
    points.sort(key=_KEPT_OF)
    best_s = best_f = math.inf
    rest = iter(points)
    pick = next(rest)  # of the points that keep as much as it, the first by TIME_TIES
    pick_k = pick[KEPT]
    for p in rest:
        k = p[KEPT]
        if k == pick_k:
            if TIME_TIES(p) < TIME_TIES(pick):
                pick = p
            continue
        s = pick[SECONDS]
        if s < best_s or (s == best_s and pick[FLOPS] < best_f):
            append(pick)
            best_s = s
            best_f = pick[FLOPS]
        pick, pick_k = p, k
    s = pick[SECONDS]
    if s < best_s or (s == best_s and pick[FLOPS] < best_f):
        append(pick)
    return out


def _least_rebuilds(points: list) -> list:
    """The points that no point keeping as little beats in highest rebuild, by increasing
    kept bytes, sorted by kept bytes and REBUILD_TIES (as :func:`_fastest`)."""
    out: list = []
    if not points:
        return out
    append = out.append
    points.sort(key=_KEPT_OF)
    best = math.inf
    rest = iter(points)
    pick = next(rest)  # of the points that keep as much as it, the first by REBUILD_TIES
    pick_k = pick[KEPT]
    for p in rest:
        k = p[KEPT]
        if k == pick_k:
            if REBUILD_TIES(p) < REBUILD_TIES(pick):
                pick = p
            continue
        if pick[REBUILD] < best:
            append(pick)
            best = pick[REBUILD]
        pick, pick_k = p, k
    if pick[REBUILD] < best:
        append(pick)
    return out


def rebuild_plan(nodes: list[FlatUnit], steps: Steps) -> NodePlan:
    """The plan a point's steps make."""
    decision = [KEEP] * len(nodes)
    segs: Segments = {}
    while steps is not None:
        steps, (kind, u, i, j) = steps
        if kind == SEGMENT:
            segs.setdefault(u, []).append((i, j))
        else:
            decision[u] = kind  # type: ignore[assignment]
    for ranges in segs.values():
        ranges.sort()
    return NodePlan(decision, segs)


class Search:
    """The passes of one optimal solve: exact until one outgrows its work limit, then
    approximate (``exact`` becomes False)."""

    def __init__(self, nodes: list[FlatUnit], loss: float) -> None:
        self.nodes = nodes
        self.loss = loss
        self.bounds = least_kept(nodes)
        self.exact = True
        self.none = NodePlan.keep_all(nodes)
        self.none_peak = self.none.peak(nodes, loss)
        self.last_work = 0  # frontier points the last walk visited

    def walk(self, cap: float, least_peak: bool, seconds: float = math.inf) -> list[Point]:
        while True:
            walk = Pass(
                self.nodes, self.bounds, cap, self.loss, least_peak, seconds, not self.exact
            )
            try:
                final = walk.run()
            except TooLarge:
                self.exact = False
                continue
            self.last_work = limits.EXACT_WORK - walk.work
            return final

    def cheapest(self, cap: float, seed: NodePlan | None = None) -> NodePlan | None:
        """The cheapest plan whose peak above static is within ``cap``, or None.
        ``seed``, a plan known to fit, bounds the search."""
        nodes, loss = self.nodes, self.loss
        if cap >= self.none_peak:
            return self.none  # recomputes nothing: nothing is cheaper
        if cap < 0.0:
            # No plan peaks below static: a plan's highest moment counts from 0 (the end of
            # forward may lie lower, with a negative loss, but the step holds static).
            return None
        seconds = math.inf
        if seed is not None and seed.peak(nodes, loss) <= cap:
            seconds = seed.evaluated(nodes).seconds
        final = self.walk(cap, False, seconds)
        if not final:
            # An approximate pass can lose every plan as fast as the seed; the seed fits.
            return seed if seconds < math.inf else None
        # Pruned by time: the last point is the cheapest; among equal times the least kept.
        return rebuild_plan(nodes, final[-1].steps)

    def least_peak(self, bound: float) -> tuple[float, NodePlan | None]:
        """The smallest peak above static any plan reaches (searched within ``bound``), and
        a plan that reaches it (not always the cheapest one)."""
        final = self.walk(bound, True)
        if not final:
            return bound, None

        def peak(p: Point) -> float:
            return max(p.kept_bytes + self.loss, p.rebuild_bytes)

        best = min(final, key=lambda p: (peak(p), p.seconds))
        return peak(best), rebuild_plan(self.nodes, best.steps)
