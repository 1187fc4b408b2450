""":func:`solve`: a strategy and a budget in, a :class:`Solution` out."""

from __future__ import annotations

import math

from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.solvers import messages
from memfit.checkpoint.solvers.fixed import family, family_plan, parse_strategy, pick_family
from memfit.checkpoint.solvers.nodes import find_chains, flatten
from memfit.checkpoint.solvers.optimal import solve_optimal
from memfit.checkpoint.solvers.plan_cost import NodePlan
from memfit.checkpoint.solvers.solution import Solution, solution
from memfit.errors import ConfigError


def solve(
    root: UnitCost,
    strategy: str,
    budget_bytes: float | None,
    static_bytes: float = 0.0,
    loss_bytes: float = 0.0,
    *,
    reserve: float = 0.0,
    frontier: bool = True,
    edge: bool = False,
    settle_ties: bool = True,
) -> Solution:
    """Choose which units to recompute.

    ``budget_bytes`` is the peak of a whole training step; ``static_bytes`` is the part of
    it checkpointing cannot change; ``loss_bytes`` is held at the end of forward only (the
    model's output and what the loss saves, freed before backward reaches the model; below
    0 where ``static_bytes`` counts what that moment does not hold, a gradient in flight). With
    ``budget_bytes=None`` the optimal solver has nothing to fit and returns the plan without
    recompute, and the other strategies apply their plan to every block. A budget above the
    unplanned peak makes ``optimal`` recompute nothing; ``full`` still recomputes every
    unit, and ``uniform``/``sqrt`` still apply their plan.

    ``reserve``: the share of the budget kept free (for allocator slack); plans fit
    ``budget_bytes * (1 - reserve)``, and errors say what budget would fit with it.
    ``frontier=False`` skips the (peak, time) frontier that the optimal solution shows,
    most of the solve's time on trees of hundreds of units; the frontier then holds the
    chosen plan alone. ``edge=True`` (``optimal`` with a reserve): the solution's ``edge``
    is also the cheapest plan within the budget itself when it recomputes less, found by
    the same search (seeded with the chosen plan's time, so it costs a fraction of a
    second solve). ``settle_ties`` (``optimal``): where the plan cheapest by counted FLOPs
    and bytes recomputes fewer FLOPs than the fastest and is timed within
    :data:`~memfit.checkpoint.solvers.optimal.TIE_SHARE` of it, take it: timings that
    close are noise (one more search, on trees whose timed walks were exact); False for a
    tree whose times are counted already.

    Raises :class:`~memfit.errors.BudgetError` when the strategy cannot fit the budget, and
    :class:`~memfit.errors.ConfigError` for an unknown strategy.

    >>> from memfit.checkpoint.costs import UnitCost
    >>> blocks = [UnitCost(f"b{i}", own_saved_bytes=100.0, input_bytes=10.0,
    ...                    fwd_seconds=1.0) for i in range(4)]
    >>> tree = UnitCost("", children=blocks, sequential=True)
    >>> sol = solve(tree, "optimal", budget_bytes=250.0)
    >>> sol.predicted_peak_bytes, sol.recompute_seconds
    (220.0, 2.0)
    >>> solve(tree, "uniform:2", None).segments
    {'': [(0, 1), (2, 3)]}
    """
    name, k = parse_strategy(strategy)
    label = name if k is None else f"uniform:{k}"
    if budget_bytes is not None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)):
            raise ConfigError(
                f"budget_bytes must be a number of bytes or None, got {budget_bytes!r}"
            )
        if not budget_bytes > 0:
            raise ConfigError(f"budget_bytes must be positive, got {budget_bytes!r}")
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
        raise ConfigError(f"reserve must be a number in [0, 1), got {reserve!r}")
    for what, value in (("static_bytes", static_bytes), ("loss_bytes", loss_bytes)):
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ConfigError(f"{what} must be a finite number of bytes, got {value!r}")
    if static_bytes < 0 or static_bytes + loss_bytes < 0:
        raise ConfigError(
            f"static_bytes ({static_bytes!r}) and static_bytes + loss_bytes "
            f"({static_bytes + loss_bytes!r}) must be >= 0"
        )
    budget = None if budget_bytes is None else float(budget_bytes) * (1 - reserve)
    static, loss = float(static_bytes), float(loss_bytes)
    nodes = flatten(root)
    none_peak = static + NodePlan.keep_all(nodes).peak(nodes, loss)

    # A budget the unplanned step meets needs no plan, when the plan is the solver's choice;
    # a strategy the user named ("full", "uniform:k", "sqrt") is applied all the same.
    if name in ("optimal", "none") and budget is not None and budget >= none_peak:
        plan = NodePlan.keep_all(nodes)
        sol = solution(nodes, plan, label, budget, static, loss, [plan])
        sol.note = messages.nothing_recomputed(budget, reserve, none_peak)
        return sol

    if name == "optimal":
        edge_budget = float(budget_bytes) if edge and reserve > 0 and budget is not None else None
        tie_root = root if settle_ties else None
        return solve_optimal(
            nodes, label, budget, static, loss, reserve, frontier, edge_budget, tie_root
        )
    if name == "none":
        plans = [NodePlan.keep_all(nodes)]
    else:
        chains = find_chains(nodes)
        if name == "full":
            plans = [family_plan(nodes, chains, "full", None, None)]
        else:
            room = None if budget is None else budget - static
            plans = family(nodes, chains, name, k, room, loss)
    return pick_family(nodes, plans, label, budget, static, loss, reserve)
