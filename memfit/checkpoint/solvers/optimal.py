"""The ``optimal`` strategy: the cheapest plan under the budget, and its frontier.

The walks themselves are in :mod:`~memfit.checkpoint.solvers.search`; this module runs
them for one solve: seeded by the fixed strategies, polished and planned block by block
where the tree was too large for exact walks, and walked along the (peak, time) frontier.
"""

from __future__ import annotations

import math

from memfit.checkpoint.costs import KEEP, SELECTIVE, UnitCost, counted_times
from memfit.checkpoint.solvers import limits, messages
from memfit.checkpoint.solvers.blocks import by_blocks
from memfit.checkpoint.solvers.fixed import family, family_plan
from memfit.checkpoint.solvers.nodes import Chains, FlatUnit, find_chains, flatten
from memfit.checkpoint.solvers.plan_cost import NodePlan, PlanCost, PlanKey, evaluate_nodes
from memfit.checkpoint.solvers.search import Search
from memfit.checkpoint.solvers.solution import Solution, solution
from memfit.errors import BudgetError

# The fixed strategies whose cheapest plan that fits bounds a walk's time.
_SEEDS = (("full", None), ("sqrt", None), ("uniform", 2), ("uniform", 4), ("uniform", 8))

#: Plans whose recompute is predicted within this share of the fastest plan's are too close
#: for a profile's timings to order. SegFormer with bf16 emulated on a 2-core CPU that two
#: other processes kept busy: six profiles chose plans of 139 to 226 recomputed MFLOP for
#: one budget; the one with the fewest FLOPs was timed 2% to 8% slower than the fastest in
#: one run of six profiles, more than 10% slower in two profiles of another. Among such
#: plans the one cheapest by counted FLOPs and bytes
#: (:func:`~memfit.checkpoint.costs.counted_times`) is taken: it does not depend on the
#: timings. What this can cost is a recompute this much slower, a few percent of a step.
TIE_SHARE = 0.15


def _seed(
    nodes: list[FlatUnit], chains: Chains, cap: float, loss: float, costs: dict[PlanKey, PlanCost]
) -> NodePlan | None:
    """The cheapest fixed-strategy plan within ``cap`` above static, or None. ``costs``:
    the solve's plans evaluated so far (see :func:`family`)."""
    fits = [
        plan
        for name, k in _SEEDS
        for plan in family(nodes, chains, name, k, cap, loss, costs)
        if plan.peak(nodes, loss) <= cap
    ]
    return min(fits, key=lambda p: p.evaluated(nodes).seconds, default=None)


def solve_optimal(
    nodes: list[FlatUnit],
    label: str,
    budget: float | None,
    static: float,
    loss: float,
    reserve: float,
    frontier: bool,
    edge_budget: float | None = None,
    settle_ties: UnitCost | None = None,
) -> Solution:
    """The cheapest plan that fits ``budget`` (the budget less the reserve), with the
    frontier when ``frontier``; and, given ``edge_budget`` (the budget itself), the cheapest
    plan within that as the solution's ``edge`` when it recomputes less. ``settle_ties``: the
    tree ``nodes`` were flattened from, to settle near-ties by its counted times
    (:data:`TIE_SHARE`); None takes the fastest plan as timed."""
    search = Search(nodes, loss)
    chains = find_chains(nodes)
    costs: dict[PlanKey, PlanCost] = {}  # the fixed strategies' plans, evaluated once

    def bound() -> float:
        # A bound for the least-peak search: the smallest peak of the fixed strategies.
        return min(
            search.none_peak,
            family_plan(nodes, chains, "full", None, None).peak(nodes, loss),
            family_plan(nodes, chains, "sqrt", None, None).peak(nodes, loss),
        )

    by_count = None
    if budget is None:
        chosen = search.none
    else:
        room = budget - static
        found = search.cheapest(room, _seed(nodes, chains, room, loss, costs))
        least = None
        if found is None:
            least = search.least_peak(bound())[0]
            if least <= room:  # an approximate walk lost the plans that fit; take the least
                found = search.cheapest(least)
        if found is None:
            smallest = search.cheapest(least) or search.none
            raise BudgetError(
                messages.too_small(budget, smallest.evaluated(nodes), static, loss, reserve)
            )
        chosen = found
        if not search.exact:
            chosen = polish(nodes, found, room, loss)
            # Two more plans, the faster kept: a walk under the polished plan's time (the
            # slower points dropped first, the thinned frontiers are finer where the cheaper
            # plans lie), when the first walk was short enough to afford twice; and one made
            # block by block, which the thinned walks do worse at loose budgets.
            again = search.cheapest(room, chosen) if search.last_work < limits.REFINE_WORK else None
            for other in (again, by_blocks(nodes, room, loss, search.bounds)):
                if other is not None and other is not chosen:
                    other = polish(nodes, other, room, loss)
                    if other.evaluated(nodes).seconds < chosen.evaluated(nodes).seconds:
                        chosen = other
        # Where the timed walks were exact (on trees too large for that, planning time
        # comes first, and identical blocks share one median time already).
        counted = counted_nodes(settle_ties) if settle_ties is not None and search.exact else None
        if counted is not None:
            by_count = Search(counted, loss)
        chosen = _settle_tie(nodes, by_count, chosen, room)
    exact = search.exact
    edge = None
    if budget is not None and edge_budget is not None and edge_budget > budget:
        edge = _cheaper_within(search, chosen, edge_budget - static)
        if edge is not None:
            # The edge must recompute less than the chosen plan: settled, only if it still does.
            settled = _settle_tie(nodes, by_count, edge, edge_budget - static)
            if settled.evaluated(nodes).seconds < chosen.evaluated(nodes).seconds:
                edge = settled
    walked = _frontier_plans(search, chains, bound(), costs) if frontier else []
    sol = solution(nodes, chosen, label, budget, static, loss, [*walked, chosen], exact=exact)
    if edge is not None:
        sol.edge = solution(
            nodes, edge, label, edge_budget, static, loss, [edge], exact=search.exact
        )
    if budget is None:
        sol.note = messages.NO_BUDGET
    return sol


def counted_nodes(root: UnitCost) -> list[FlatUnit] | None:
    """The nodes of ``root`` with counted times, for :func:`solve_optimal` to settle
    near-ties by; None where the tree counts no FLOPs (nothing to settle them by)."""
    if not any(u.fwd_flops > 0 for u in root.walk()):
        return None
    return flatten(counted_times(root))


def _settle_tie(
    nodes: list[FlatUnit], by_count: Search | None, chosen: NodePlan, room: float
) -> NodePlan:
    """``chosen``, or the plan within ``room`` cheapest by counted costs (``by_count``: a
    search of the same nodes with counted times) where that one recomputes fewer FLOPs
    and its timed recompute is within :data:`TIE_SHARE` of ``chosen``'s. Both trees
    predict the same bytes (only the times differ), so the counted plan fits as the timed
    one would. ``chosen`` bounds the search: only plans cheaper by count are followed."""
    if by_count is None or chosen.evaluated(nodes).seconds <= 0:
        return chosen
    seed = NodePlan(chosen.decision, chosen.segs)  # its counted cost, evaluated afresh
    found = by_count.cheapest(room, seed)
    if found is None or found.key() == chosen.key():
        return chosen
    other = NodePlan(found.decision, found.segs)  # evaluated afresh, on the timed nodes
    mine, theirs = chosen.evaluated(nodes), other.evaluated(nodes)
    close = theirs.seconds <= mine.seconds * (1 + TIE_SHARE)
    if theirs.peak(by_count.loss) <= room and theirs.flops < mine.flops and close:
        return other
    return chosen


def _cheaper_within(search: Search, chosen: NodePlan, room: float) -> NodePlan | None:
    """The cheapest plan within ``room`` (above the budget ``chosen`` was found under) when it
    recomputes less than ``chosen``, else None. Exact searches walk again, bounded by
    ``chosen``'s time (only faster plans are followed: a fraction of the first walk); on
    trees too large for exact walks, ``chosen`` is polished into the larger room instead
    (its slowest recomputed pieces kept while they fit, at most
    :data:`~memfit.checkpoint.solvers.limits.EDGE_PIECES` of them), which costs a few
    evaluations rather than a walk."""
    nodes, loss = search.nodes, search.loss
    if search.exact:
        found = search.cheapest(room, chosen)
    else:
        found = polish(nodes, chosen, room, loss, most=limits.EDGE_PIECES)
    if found is None or found is chosen:
        return None
    faster = found.evaluated(nodes).seconds < chosen.evaluated(nodes).seconds
    return found if faster else None


def polish(
    nodes: list[FlatUnit], plan: NodePlan, cap: float, loss: float, most: float = math.inf
) -> NodePlan:
    """An approximate plan, with every recomputed piece that the budget can afford to keep
    kept instead, the slowest first (each one tried once; a kept piece's units keep), at
    most ``most`` of them (each kept piece costs an evaluation of the whole plan).

    Keeping a piece adds what it saves, less its input, to everything kept after it, so
    every later rebuild and the end of forward grow by that much (less the boundary
    tensors the piece's end no longer holds): a piece that cannot fit by that count is
    passed over without evaluating the plan again."""
    pieces = [(nodes[u].rebuild_seconds, u, None) for u, d in enumerate(plan.decision) if d != KEEP]
    for u, ranges in plan.segs.items():
        node = nodes[u]
        pieces += [(node.segment_seconds(i, j), u, (i, j)) for i, j in ranges]
    depth = [0] * len(nodes)
    for node in nodes:
        for c in node.children:
            depth[c] = depth[node.index] + 1
    # What a piece's end can hold across boundaries, at most: one tensor per level.
    slack = max((n.input_saved_by_both_bytes for n in nodes), default=0.0) * (max(depth) + 1)
    order: dict = {}
    after: list[float] = []

    def survey(candidate: NodePlan, taken: bool = False) -> PlanCost:
        # Its cost; when it fits (or is ``taken`` regardless), each piece's place in
        # forward order and the highest rebuild after it are recorded from the same
        # evaluation: a trial that fits is not evaluated a second time.
        rebuilds: list = []
        cost = evaluate_nodes(nodes, candidate.decision, candidate.segs, rebuilds=rebuilds)
        if taken or cost.peak(loss) <= cap:
            candidate.cost = cost
            order.clear()
            after[:] = [0.0] * (len(rebuilds) + 1)
            for pos in range(len(rebuilds) - 1, -1, -1):
                order[rebuilds[pos][0]] = pos
                after[pos] = max(after[pos + 1], rebuilds[pos][1])
        return cost

    kept = survey(plan, taken=True).kept_bytes
    kept_pieces = 0
    for _, u, rng in sorted(pieces, key=lambda p: -p[0]):
        if kept_pieces >= most:
            break
        node = nodes[u]
        if rng is None:
            matmul = node.matmul_saved_bytes if plan.decision[u] == SELECTIVE else 0.0
            grows = node.saved_bytes - node.input_bytes - matmul
        else:
            i, j = rng
            grows = node.saved_before[j + 1] - node.saved_before[i] - node.child_input_bytes[i]
        grows -= slack
        if max(after[order[(u, rng)] + 1], kept + loss) + grows > cap:
            continue
        decision = list(plan.decision)
        segs = {k: list(v) for k, v in plan.segs.items()}
        if rng is None:
            decision[u] = KEEP
        else:
            segs[u].remove(rng)
            if not segs[u]:
                del segs[u]
        trial = NodePlan(decision, segs)
        cost = survey(trial)
        if cost.peak(loss) <= cap:
            plan = trial
            kept = cost.kept_bytes
            kept_pieces += 1
    return plan


def _frontier_plans(
    search: Search, chains: Chains, bound: float, costs: dict[PlanKey, PlanCost]
) -> list[NodePlan]:
    """Plans on the (peak, time) frontier: walked point by point from the no-checkpoint
    end (each pass finds the cheapest plan below the last one's peak), then sampled at
    evenly spread caps down to the least peak when the walk is long."""
    nodes, loss = search.nodes, search.loss
    plans: list[NodePlan] = []
    cap = search.none_peak
    # Small trees get their whole frontier, point by point.
    steps = limits.STAIRCASE if len(nodes) > limits.SMALL_TREE else math.inf
    while steps > 0 and search.exact:
        steps -= 1
        found = search.cheapest(cap, _seed(nodes, chains, cap, loss, costs))
        if found is None:
            return plans
        plans.append(found)
        # min(): with fractional costs, sums taken in another order can put the evaluated
        # peak an ulp above the cap the walk checked; the cap must still go down.
        cap = math.nextafter(min(cap, found.peak(nodes, loss)), -math.inf)
    least, reaches = search.least_peak(min(bound, cap))
    if not search.exact:
        # Large trees: the plan the least-peak walk found stands for the low end (a second
        # walk for the cheapest plan at that peak would cost as much as the solve).
        return [*plans, *([reaches] if reaches is not None else []), search.none]
    count = limits.SAMPLED
    for q in range(count + 1):
        at = least + (cap - least) * q / count
        found = search.cheapest(at, _seed(nodes, chains, at, loss, costs))
        if found is not None:
            plans.append(found)
    return plans
