"""Strategy names, and the fixed strategies: ``none``, ``full``, ``uniform:k``, ``sqrt``.

Each fixed strategy is a family of plans that checkpoint the first ``n`` blocks in forward
order (blocks and chains are defined in the package's docstring); with a budget, the
fewest blocks that fit are found by bisection.
"""

from __future__ import annotations

import math
import re

from memfit.checkpoint.costs import KEEP, RECOMPUTE
from memfit.checkpoint.solvers import messages
from memfit.checkpoint.solvers.nodes import Chains, FlatUnit
from memfit.checkpoint.solvers.plan_cost import NodePlan, PlanCost, PlanKey, Segments
from memfit.checkpoint.solvers.solution import Solution, solution
from memfit.errors import BudgetError, ConfigError

#: The strategy names :func:`solve` accepts (``"uniform"`` also as ``"uniform:k"``).
STRATEGIES: tuple[str, ...] = ("none", "full", "uniform", "sqrt", "optimal")

# The names as an error lists them, "uniform:k" beside "uniform".
_VALID_STRATEGIES = ", ".join(
    f"'{s}', 'uniform:k' (k >= 1 an integer)" if s == "uniform" else f"'{s}'" for s in STRATEGIES
)


def parse_strategy(strategy: str) -> tuple[str, int | None]:
    """Split a strategy string into its name and the ``k`` of ``"uniform:k"``.

    >>> parse_strategy("uniform:4")
    ('uniform', 4)
    >>> parse_strategy("optimal")
    ('optimal', None)
    """
    if not isinstance(strategy, str):
        raise ConfigError(
            f"strategy must be a string, got {type(strategy).__name__}; valid: {_VALID_STRATEGIES}"
        )
    text = strategy.strip().lower()
    if text in STRATEGIES:
        return text, None
    match = re.fullmatch(r"uniform\s*:\s*([+-]?\d+)", text)
    if match:
        k = int(match.group(1))
        if k < 1:
            raise ConfigError(
                f"strategy {strategy!r}: k must be a whole number >= 1 (k consecutive blocks "
                f"per checkpointed segment); valid: {_VALID_STRATEGIES}"
            )
        return "uniform", k
    raise ConfigError(f"unknown checkpoint strategy {strategy!r}; valid: {_VALID_STRATEGIES}")


def _default_k(n: int) -> int:
    # At least 8 checkpoints per chain, at most 4 blocks per segment: every-2-to-4-layers
    # is the common practice, and short chains gain nothing from segments.
    return max(1, min(4, n // 8))


def family_plan(
    nodes: list[FlatUnit],
    chains: Chains,
    name: str,
    k: int | None,
    limit: int | None,
) -> NodePlan:
    """Checkpoint the first ``limit`` blocks (all when None) in forward order, a block on
    its own only where recomputing it can free memory (:func:`_frees`)."""
    decision = [KEEP] * len(nodes)
    segs: Segments = {}
    left = math.inf if limit is None else limit
    for u, blocks in chains:
        if left <= 0:
            break
        node = nodes[u]
        alone = not node.sequential or name == "full"
        if alone:  # every block a piece of its own: those that free nothing are not counted
            blocks = [p for p in blocks if _frees(nodes[node.children[p]])]
        chosen = blocks[: int(min(left, len(blocks)))]
        left -= len(chosen)
        if alone:
            groups = [[p] for p in chosen]
        else:
            groups = []
            for run in _runs(chosen):
                if name == "sqrt":
                    groups.extend(_balanced(node, run))
                else:
                    size = k if k is not None else _default_k(len(blocks))
                    groups.extend(run[i : i + size] for i in range(0, len(run), size))
        for group in groups:
            if len(group) == 1:
                block = nodes[node.children[group[0]]]
                if _frees(block):
                    decision[block.index] = RECOMPUTE
            else:
                segs.setdefault(u, []).append((group[0], group[-1]))
    return NodePlan(decision, segs)


def _frees(block: FlatUnit) -> bool:
    """Whether recomputing ``block`` alone can free memory: it saves more than its input,
    which its checkpoint holds. One that saves no more (an embedding lookup, a frozen or
    ``no_grad`` layer, a view or a parameter-free reshape) frees nothing its checkpoint
    does not hold again, and its rebuild costs time and memory."""
    return block.saved_bytes > block.input_bytes


def _runs(positions: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _balanced(node: FlatUnit, run: list[int]) -> list[list[int]]:
    # Chen et al.'s greedy: close a segment when adding the next block would take it past
    # an equal share of the run's saved bytes, with round(sqrt(n)) shares.
    n = len(run)
    total = node.saved_before[run[-1] + 1] - node.saved_before[run[0]]
    cap = total / max(1, round(math.sqrt(n)))
    groups: list[list[int]] = [[]]
    acc = 0.0
    for p in run:
        s = node.saved_before[p + 1] - node.saved_before[p]
        if groups[-1] and acc + s > cap * (1 + 1e-12):
            groups.append([])
            acc = 0.0
        groups[-1].append(p)
        acc += s
    return groups


def family(
    nodes: list[FlatUnit],
    chains: Chains,
    name: str,
    k: int | None,
    room: float | None,
    loss: float,
    costs: dict[PlanKey, PlanCost] | None = None,
) -> list[NodePlan]:
    """Evaluated plans of a fixed strategy: all blocks when ``room`` (bytes above static)
    is None, else a bisection for the fewest blocks, in forward order, that
    fit in it (the time only grows with the count; the peak mostly falls).

    ``costs``: plans' costs by :meth:`NodePlan.key`, kept between calls and added to, so
    that a plan is evaluated once (strategies often make the same plans: all of them
    recompute block by block outside sequential units, and the optimal solver asks for
    the same strategies under many caps)."""
    total = sum(len(b) for _, b in chains)
    tried: dict[int, NodePlan] = {}

    def at(count: int) -> NodePlan:
        if count not in tried:
            plan = family_plan(nodes, chains, name, k, count)
            if costs is None:
                plan.evaluated(nodes)
            else:
                key = plan.key()
                if key not in costs:
                    costs[key] = plan.evaluated(nodes)
                plan.cost = costs[key]
            tried[count] = plan
        return tried[count]

    def fits(count: int) -> bool:
        return at(count).peak(nodes, loss) <= room  # type: ignore[operator]

    if room is None:
        return [at(total)]
    if not fits(total):
        # Nothing fits: map the family for the error message's smallest peak.
        for i in range(17):
            at(round(total * i / 16))
        return list(tried.values())
    low, high = 0, total  # low does not fit (or is 0), high fits
    if fits(0):
        return [at(0)]
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return list(tried.values())


def pick_family(
    nodes: list[FlatUnit],
    plans: list[NodePlan],
    label: str,
    budget: float | None,
    static: float,
    loss: float,
    reserve: float,
) -> Solution:
    """The cheapest of a fixed strategy's plans that fits (all blocks without a budget)."""
    if budget is None:
        chosen = plans[-1]
    else:
        fits = [p for p in plans if static + p.peak(nodes, loss) <= budget]
        if not fits:
            best = min(plans, key=lambda p: p.peak(nodes, loss))
            raise BudgetError(
                messages.strategy_cannot_fit(
                    label, budget, best.evaluated(nodes), static, loss, reserve
                )
            )

        def cost(p: NodePlan) -> tuple[float, float, float]:
            c = p.evaluated(nodes)
            return c.seconds, c.flops, c.peak(loss)

        chosen = min(fits, key=cost)
    return solution(nodes, chosen, label, budget, static, loss, plans)
