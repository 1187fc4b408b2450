"""What a solver returns: :class:`Solution`, and how a chosen plan becomes one."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.checkpoint.costs import Decision
from memfit.checkpoint.solvers.frontier import FrontierPoint, pareto
from memfit.checkpoint.solvers.nodes import FlatUnit
from memfit.checkpoint.solvers.plan_cost import NodePlan


@dataclass
class Solution:
    """What a solver decided and what it predicts.

    >>> from memfit.checkpoint.costs import UnitCost
    >>> from memfit.checkpoint.solvers import solve
    >>> tree = UnitCost("", children=[UnitCost("a", own_saved_bytes=8.0)], own_saved_bytes=1.0)
    >>> solve(tree, "none", None).decisions
    {'': 'keep', 'a': 'keep'}
    """

    decisions: dict[str, Decision]
    """Every unit's decision: ``"keep"``, ``"recompute"`` or ``"selective"``. Units inside a
    recomputed piece (a recomputed unit's descendants, a segment's members) say ``"keep"``."""
    segments: dict[str, list[tuple[int, int]]]
    """Per ``sequential`` unit, the inclusive child index ranges ``(start, end)``, ``end >
    start``, each checkpointed as one piece. Units without segments are absent."""
    strategy: str
    """The strategy as given, normalized (``"uniform:4"``, ``"optimal"``, ...)."""
    budget_bytes: float | None
    """The budget the plan was made for (whole training step), or None."""
    static_bytes: float
    """Bytes checkpointing cannot change (parameters, gradients, optimizer state, ...)."""
    kept_bytes: float
    """Activation bytes held from forward to backward under the plan."""
    transient_bytes: float
    """What the peak holds beyond static and kept: the loss at the end of forward, or, when
    higher, a recomputed piece being rebuilt in backward (what is kept after that piece is
    freed by then)."""
    predicted_peak_bytes: float
    """static + kept + transient."""
    recompute_flops: float
    """Extra forward FLOPs per step spent recomputing."""
    recompute_seconds: float
    """Extra time per step spent recomputing: the rebuilds' forward time and the checkpoint
    machinery's cost per piece."""
    frontier: list[FrontierPoint] = field(default_factory=list)
    """The (peak, recompute time) trade-offs the strategy can reach, by increasing peak."""
    note: str | None = None
    """A plain remark on the choice, e.g. that the budget needs no checkpointing."""
    exact: bool = True
    """For ``"optimal"``: True when the plan is proven the cheapest that fits. False when
    the tree was too large for the exact programme within its work limit and frontiers were
    thinned: the plan is valid and its numbers exact, but a slightly cheaper one may exist.
    Always True for the fixed strategies, which have nothing to approximate."""
    edge: Solution | None = None
    """For ``"optimal"`` solved with a reserve and ``edge=True``: the cheapest plan within
    the budget itself (no reserve), when it recomputes less than this one; None otherwise.
    Its prediction lies in the reserve, so only a measured step can accept it
    (:func:`memfit.checkpoint.measured_fit.measured_within_reserve`)."""


def solution(
    nodes: list[FlatUnit],
    plan: NodePlan,
    label: str,
    budget: float | None,
    static: float,
    loss: float,
    family: list[NodePlan],
    *,
    exact: bool = True,
) -> Solution:
    """The solution that chose ``plan``; its frontier is that of the ``family`` of plans."""
    cost = plan.evaluated(nodes)
    peak = cost.peak(loss)
    costs = [p.evaluated(nodes) for p in family]
    points = [(static + c.peak(loss), c.seconds, c.flops) for c in costs]
    return Solution(
        decisions={n.name: plan.decision[n.index] for n in nodes},
        segments={nodes[u].name: sorted(r) for u, r in sorted(plan.segs.items())},
        strategy=label,
        budget_bytes=budget,
        static_bytes=static,
        kept_bytes=cost.kept_bytes,
        transient_bytes=peak - cost.kept_bytes,
        predicted_peak_bytes=static + peak,
        recompute_flops=cost.flops,
        recompute_seconds=cost.seconds,
        frontier=[FrontierPoint(p, s, f) for p, s, f in pareto(points)],
        exact=exact,
    )
