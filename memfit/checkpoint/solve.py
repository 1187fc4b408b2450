"""Checkpoint solvers: from a tree of unit costs to recompute decisions and a predicted peak.

Pure Python on plain cost tables (:class:`~memfit.checkpoint.costs.UnitCost`), with no
framework import, so the same planner can drive any recompute primitive.

Strategies (``docs/planner.md`` states them in full):

``"none"``        keep every activation.
``"full"``        recompute every *block* (see below) on its own.
``"uniform:k"``   segments of ``k`` consecutive blocks in chains memfit iterates
                  (``sequential`` units); blocks one by one elsewhere. ``"uniform"`` picks
                  ``k`` per chain from its length.
``"sqrt"``        about ``sqrt(n)`` memory-balanced segments per chain of ``n`` blocks
                  (Chen et al. 2016).
``"optimal"``     the cheapest plan under the budget: a dynamic programme over the tree
                  with Pareto frontiers of (memory, recompute time), exact under the cost
                  model; past its work limit, a Lagrangian relaxation with local search,
                  then the exact programme again bounded by that plan.

*Blocks*: a *chain* is a unit with two or more children. Walking down from the root,
the blocks are the outermost recomputable units whose parent is a chain. A single-child
unit is looked through, and so are ``sequential`` containers with two or more children
(the container only iterates; its children are the blocks) and units that cannot be
recomputed (their recomputable descendants are looked for instead).

With a budget, ``"uniform"`` and ``"sqrt"`` checkpoint only as many blocks as they need
(in forward order, so the earliest blocks first); ``"full"`` and ``"none"`` only check
that their plan fits. Every strategy returns the no-checkpoint plan when the budget is at
or above its peak.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Literal

from memfit.checkpoint.costs import UnitCost
from memfit.errors import BudgetError, ConfigError, PlanError
from memfit.units import format_bytes as _format_bytes

__all__ = [
    "STRATEGIES",
    "Decision",
    "Evaluation",
    "FrontierPoint",
    "Solution",
    "evaluate",
    "parse_strategy",
    "solve",
]

Decision = Literal["keep", "recompute", "selective"]

#: The strategy names :func:`solve` accepts (``"uniform"`` also as ``"uniform:k"``).
STRATEGIES: tuple[str, ...] = ("none", "full", "uniform", "sqrt", "optimal")

# The optimal solver's limits (docs/planner.md, "Exactness and its limits"). The exact
# frontier programme gives up after visiting _EXACT_WORK frontier points, or when the tree
# has more than _EXACT_LEVELS distinct transients; the Lagrangian relaxation then tries
# at most _RELAXED_LEVELS transient caps, and the exact programme bounded by its result
# gets _BOUNDED_WORK more on trees of at most _BOUNDED_UNITS units.
_EXACT_WORK = 60_000
_BOUNDED_WORK = 400_000
_BOUNDED_UNITS = 300
_EXACT_LEVELS = 400
_MAX_SEGMENT_SUMS = 20_000
_RELAXED_LEVELS = 24
# Points of the optimal frontier reported in a Solution (spread evenly in memory).
_MAX_REPORTED = 256


@dataclass(frozen=True)
class FrontierPoint:
    """One Pareto-optimal trade-off: no plan is both smaller and cheaper.

    >>> FrontierPoint(peak_bytes=2**30, recompute_seconds=0.01, recompute_flops=3e9)
    FrontierPoint(peak_bytes=1073741824, recompute_seconds=0.01, recompute_flops=3000000000.0)
    """

    peak_bytes: float
    """Predicted peak of a training step, static bytes included."""
    recompute_seconds: float
    """Extra forward time spent recomputing, per step."""
    recompute_flops: float
    """Extra forward FLOPs spent recomputing, per step."""


@dataclass
class Solution:
    """What a solver decided and what it predicts.

    >>> from memfit.checkpoint.costs import UnitCost
    >>> tree = UnitCost("", children=[UnitCost("a", own_saved_bytes=8.0)], own_saved_bytes=1.0)
    >>> solve(tree, "none", None).decisions
    {'': 'keep', 'a': 'keep'}
    """

    decisions: dict[str, str]
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
    """Largest extra bytes while one recomputed piece is rebuilt in backward."""
    predicted_peak_bytes: float
    """static + kept + transient."""
    recompute_flops: float
    """Extra forward FLOPs per step spent recomputing."""
    recompute_seconds: float
    """Extra forward time per step spent recomputing."""
    frontier: list[FrontierPoint] = field(default_factory=list)
    """The (peak, recompute time) trade-offs the strategy can reach, by increasing peak."""
    note: str | None = None
    """A plain remark on the choice, e.g. that the budget needs no checkpointing."""
    exact: bool = True
    """For ``"optimal"``: True when the plan is proven the cheapest that fits (and, when the
    whole frontier was computed, the frontier is exact). False when the tree was too large
    for the exact programme and the plan comes from the Lagrangian relaxation and local
    search: valid, its numbers exact, but a slightly cheaper plan may exist. Always True for
    the fixed strategies, which have nothing to approximate."""


@dataclass(frozen=True)
class Evaluation:
    """The cost model's verdict on one set of decisions (see :func:`evaluate`)."""

    kept_bytes: float
    transient_bytes: float
    peak_bytes: float
    recompute_seconds: float
    recompute_flops: float


# --------------------------------------------------------------------------- formatting


# --------------------------------------------------------------------------- the flat tree


class _Node:
    """A unit with the numbers the solvers use, indexed in pre-order."""

    __slots__ = (
        "idx",
        "name",
        "children",
        "saved",
        "own",
        "inp",
        "fwd_s",
        "fwd_f",
        "sel_s",
        "sel_f",
        "mm",
        "can_rec",
        "can_sel",
        "seq",
        "rec_t",
        "sel_t",
        "pre_saved",
        "pre_s",
        "pre_f",
        "run_start",
        "kid_inp",
    )

    def __init__(self, idx: int, unit: UnitCost, is_root: bool) -> None:
        self.idx = idx
        self.name = unit.name
        self.children: list[int] = []
        self.own = float(unit.own_saved_bytes)
        self.saved = 0.0
        self.inp = float(unit.input_bytes)
        self.fwd_s = float(unit.fwd_seconds)
        self.fwd_f = float(unit.fwd_flops)
        self.sel_s = float(unit.non_matmul_fwd_seconds)
        self.sel_f = float(unit.non_matmul_fwd_flops)
        self.mm = float(unit.matmul_saved_bytes)
        # The root is the whole model: there is nothing outside it to hold its inputs.
        self.can_rec = bool(unit.can_recompute) and not is_root
        # Selective recompute only differs from recompute when matmul outputs are saved.
        self.can_sel = self.can_rec and self.mm > 0
        self.seq = bool(unit.sequential)
        self.rec_t = 0.0
        self.sel_t = 0.0
        self.pre_saved: list[float] = []
        self.pre_s: list[float] = []
        self.pre_f: list[float] = []
        self.run_start: list[int] = []
        self.kid_inp: list[float] = []


def _flatten(root: UnitCost) -> list[_Node]:
    if not isinstance(root, UnitCost):
        raise PlanError(f"solve() needs the UnitCost tree's root, got {type(root).__name__}")
    nodes: list[_Node] = []
    seen: set[str] = set()
    stack: list[tuple[UnitCost, int]] = [(root, -1)]
    while stack:
        unit, parent = stack.pop()
        if unit.name in seen:
            raise PlanError(f"unit name {unit.name!r} appears twice in the cost tree")
        seen.add(unit.name)
        for attr in (
            "own_saved_bytes",
            "input_bytes",
            "output_bytes",
            "matmul_saved_bytes",
            "fwd_seconds",
            "fwd_flops",
            "non_matmul_fwd_seconds",
            "non_matmul_fwd_flops",
            "bwd_seconds",
        ):
            value = getattr(unit, attr)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise PlanError(
                    f"unit {unit.name!r}: {attr} must be a finite number >= 0, got {value!r}"
                )
        node = _Node(len(nodes), unit, is_root=parent < 0)
        nodes.append(node)
        if parent >= 0:
            nodes[parent].children.append(node.idx)
        # Reversed so that children pop, and are numbered, in forward order.
        for child in reversed(unit.children):
            stack.append((child, node.idx))
    for node in reversed(nodes):
        node.saved = node.own + sum(nodes[c].saved for c in node.children)
        node.rec_t = node.saved
        node.sel_t = max(0.0, node.saved - node.mm)
        if node.seq and len(node.children) >= 2:
            kids = [nodes[c] for c in node.children]
            node.pre_saved = _prefix(k.saved for k in kids)
            node.pre_s = _prefix(k.fwd_s for k in kids)
            node.pre_f = _prefix(k.fwd_f for k in kids)
            node.kid_inp = [k.inp for k in kids]
            # run_start[j]: the first child of the run of recomputable children ending at j.
            start = 0
            for j, kid in enumerate(kids):
                if not kid.can_rec:
                    start = j + 1
                node.run_start.append(min(start, j))
    return nodes


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


# --------------------------------------------------------------------------- evaluation


def _evaluate_nodes(
    nodes: list[_Node], decision: list[str], segs: Mapping[int, list[tuple[int, int]]]
) -> tuple[float, float, float, float]:
    """(kept, transient, seconds, flops) of a plan given per node index."""
    kept = [0.0] * len(nodes)
    trans = [0.0] * len(nodes)
    secs = [0.0] * len(nodes)
    flops = [0.0] * len(nodes)
    for node in reversed(nodes):
        u = node.idx
        d = decision[u]
        if d == "recompute":
            kept[u], trans[u], secs[u], flops[u] = node.inp, node.rec_t, node.fwd_s, node.fwd_f
            continue
        if d == "selective":
            kept[u], trans[u], secs[u], flops[u] = (
                node.inp + node.mm,
                node.sel_t,
                node.sel_s,
                node.sel_f,
            )
            continue
        k, t, s, f = node.own, 0.0, 0.0, 0.0
        in_segment: set[int] = set()
        for i, j in segs.get(u, ()):
            k += nodes[node.children[i]].inp
            t = max(t, node.pre_saved[j + 1] - node.pre_saved[i])
            s += node.pre_s[j + 1] - node.pre_s[i]
            f += node.pre_f[j + 1] - node.pre_f[i]
            in_segment.update(range(i, j + 1))
        for pos, c in enumerate(node.children):
            if pos not in in_segment:
                k += kept[c]
                t = max(t, trans[c])
                s += secs[c]
                f += flops[c]
        kept[u], trans[u], secs[u], flops[u] = k, t, s, f
    return kept[0], trans[0], secs[0], flops[0]


def _check_plan(
    nodes: list[_Node], decisions: Mapping[str, str], segments: Mapping[str, list[tuple[int, int]]]
) -> tuple[list[str], dict[int, list[tuple[int, int]]]]:
    by_name = {n.name: n for n in nodes}
    for name in decisions:
        if name not in by_name:
            raise PlanError(f"the plan names unit {name!r}, which is not in the cost tree")
    for name in segments:
        if name not in by_name:
            raise PlanError(f"the plan has segments for {name!r}, which is not in the cost tree")
    decision = ["keep"] * len(nodes)
    for node in nodes:
        d = decisions.get(node.name, "keep")
        if d not in ("keep", "recompute", "selective"):
            raise PlanError(
                f"unit {node.name!r}: decision {d!r} is not 'keep', 'recompute' or 'selective'"
            )
        if d != "keep" and not node.can_rec:
            what = "the root" if node.idx == 0 else "a unit marked can_recompute=False"
            raise PlanError(f"unit {node.name!r} cannot be recomputed: it is {what}")
        decision[node.idx] = d
    segs: dict[int, list[tuple[int, int]]] = {}
    for name, ranges in segments.items():
        node = by_name[name]
        if not node.seq:
            raise PlanError(f"unit {name!r} has segments but is not sequential")
        taken: set[int] = set()
        for i, j in ranges:
            if not (0 <= i < j < len(node.children)):
                raise PlanError(
                    f"unit {name!r}: segment ({i}, {j}) must satisfy 0 <= start < end < "
                    f"{len(node.children)}"
                )
            if node.run_start[j] > i:
                raise PlanError(
                    f"unit {name!r}: segment ({i}, {j}) contains a child that cannot be recomputed"
                )
            if taken.intersection(range(i, j + 1)):
                raise PlanError(f"unit {name!r}: segment ({i}, {j}) overlaps another one")
            taken.update(range(i, j + 1))
        if ranges:
            segs[node.idx] = [(int(i), int(j)) for i, j in ranges]
    return decision, segs


def evaluate(
    root: UnitCost,
    decisions: Mapping[str, str],
    segments: Mapping[str, list[tuple[int, int]]] | None = None,
    static_bytes: float = 0.0,
) -> Evaluation:
    """Predict memory and recompute cost of given decisions under the cost model.

    Units missing from ``decisions`` keep. Decisions below a recomputed unit, or on a
    segment's members, are ignored: nothing is nested inside a recomputed piece.

    >>> from memfit.checkpoint.costs import UnitCost
    >>> block = UnitCost("b", own_saved_bytes=100.0, input_bytes=10.0, fwd_seconds=0.5)
    >>> evaluate(UnitCost("", children=[block]), {"b": "recompute"}).peak_bytes
    110.0
    """
    nodes = _flatten(root)
    decision, segs = _check_plan(nodes, decisions, segments or {})
    k, t, s, f = _evaluate_nodes(nodes, decision, segs)
    return Evaluation(k, t, static_bytes + k + t, s, f)


# --------------------------------------------------------------------------- strategies


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


_VALID_STRATEGIES = "'none', 'full', 'uniform', 'uniform:k' (k >= 1 an integer), 'sqrt', 'optimal'"


def solve(
    root: UnitCost,
    strategy: str,
    budget_bytes: float | None,
    static_bytes: float = 0.0,
) -> Solution:
    """Choose which units to recompute.

    ``budget_bytes`` is the peak of a whole training step; ``static_bytes`` is the part of
    it checkpointing cannot change. With ``budget_bytes=None`` the optimal solver has
    nothing to fit and returns the plan without recompute, and the other strategies apply
    their plan to every block. Raises :class:`~memfit.errors.BudgetError` when the
    strategy cannot fit the budget, and :class:`~memfit.errors.ConfigError` for an
    unknown strategy.

    >>> from memfit.checkpoint.costs import UnitCost
    >>> blocks = [UnitCost(f"b{i}", own_saved_bytes=100.0, input_bytes=10.0,
    ...                    fwd_seconds=1.0) for i in range(4)]
    >>> tree = UnitCost("", children=blocks, sequential=True)
    >>> sol = solve(tree, "optimal", budget_bytes=250.0)
    >>> sol.predicted_peak_bytes, sol.recompute_seconds
    (230.0, 3.0)
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
    if not (isinstance(static_bytes, (int, float)) and static_bytes >= 0):
        raise ConfigError(f"static_bytes must be a number >= 0, got {static_bytes!r}")
    budget = None if budget_bytes is None else float(budget_bytes)
    static = float(static_bytes)
    nodes = _flatten(root)
    none_peak = static + nodes[0].saved

    if budget is not None and budget >= none_peak:
        plan = _Plan(["keep"] * len(nodes), {})
        sol = _solution(nodes, plan, label, budget, static, [plan])
        sol.note = (
            f"budget {_format_bytes(budget)} is at or above the no-checkpoint peak "
            f"{_format_bytes(none_peak)}: nothing is recomputed"
        )
        return sol

    if name == "optimal":
        return _solve_optimal(nodes, label, budget, static)
    if name == "none":
        plans = [_Plan(["keep"] * len(nodes), {})]
    else:
        chains = _find_chains(nodes)
        if name == "full":
            plans = [_family_plan(nodes, chains, "full", None, None)]
        else:
            plans = _family(nodes, chains, name, k, None if budget is None else budget - static)
    return _pick_family(nodes, plans, label, budget, static)


# --------------------------------------------------------------------------- simple strategies


@dataclass
class _Plan:
    decision: list[str]
    segs: dict[int, list[tuple[int, int]]]
    value: tuple[float, float, float, float] | None = None  # kept, transient, seconds, flops


def _find_chains(nodes: list[_Node]) -> list[tuple[int, list[int]]]:
    """(chain unit, positions of its block children), chains in pre-order."""
    chains: list[tuple[int, list[int]]] = []
    stack = [0]
    while stack:
        u = stack.pop()
        kids = nodes[u].children
        if len(kids) == 1:
            stack.append(kids[0])
            continue
        blocks: list[int] = []
        inner: list[int] = []
        for pos, c in enumerate(kids):
            child = nodes[c]
            if child.seq and len(child.children) >= 2:
                inner.append(c)  # a container that only iterates: its children are the blocks
            elif child.can_rec:
                blocks.append(pos)
            else:
                inner.append(c)
        if blocks:
            chains.append((u, blocks))
        stack.extend(reversed(inner))
    chains.sort()
    return chains


def _default_k(n: int) -> int:
    # At least 8 checkpoints per chain, at most 4 blocks per segment: every-2-to-4-layers
    # is the common practice, and short chains gain nothing from segments.
    return max(1, min(4, n // 8))


def _family_plan(
    nodes: list[_Node],
    chains: list[tuple[int, list[int]]],
    name: str,
    k: int | None,
    limit: int | None,
) -> _Plan:
    """Checkpoint the first ``limit`` blocks (all when None) in forward order."""
    decision = ["keep"] * len(nodes)
    segs: dict[int, list[tuple[int, int]]] = {}
    left = math.inf if limit is None else limit
    for u, blocks in chains:
        if left <= 0:
            break
        chosen = blocks[: int(min(left, len(blocks)))]
        left -= len(chosen)
        node = nodes[u]
        if not node.seq or name == "full":
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
                decision[node.children[group[0]]] = "recompute"
            else:
                segs.setdefault(u, []).append((group[0], group[-1]))
    return _Plan(decision, segs)


def _runs(positions: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _balanced(node: _Node, run: list[int]) -> list[list[int]]:
    # Chen et al.'s greedy: close a segment when adding the next block would take it past
    # an equal share of the run's saved bytes, with round(sqrt(n)) shares.
    n = len(run)
    total = node.pre_saved[run[-1] + 1] - node.pre_saved[run[0]]
    cap = total / max(1, round(math.sqrt(n)))
    groups: list[list[int]] = [[]]
    acc = 0.0
    for p in run:
        s = node.pre_saved[p + 1] - node.pre_saved[p]
        if groups[-1] and acc + s > cap * (1 + 1e-12):
            groups.append([])
            acc = 0.0
        groups[-1].append(p)
        acc += s
    return groups


def _family(
    nodes: list[_Node],
    chains: list[tuple[int, list[int]]],
    name: str,
    k: int | None,
    room: float | None,
) -> list[_Plan]:
    """Evaluated plans of a fixed strategy: all blocks when ``room`` (bytes for kept +
    transient) is None, else a bisection for the fewest blocks, in forward order, that
    fit in it (the time only grows with the count; the peak mostly falls)."""
    total = sum(len(b) for _, b in chains)
    tried: dict[int, _Plan] = {}

    def at(count: int) -> _Plan:
        if count not in tried:
            plan = _family_plan(nodes, chains, name, k, count)
            plan.value = _evaluate_nodes(nodes, plan.decision, plan.segs)
            tried[count] = plan
        return tried[count]

    def fits(count: int) -> bool:
        value = at(count).value
        return value[0] + value[1] <= room  # type: ignore[index, operator]

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


def _pick_family(
    nodes: list[_Node], plans: list[_Plan], label: str, budget: float | None, static: float
) -> Solution:
    for plan in plans:
        if plan.value is None:
            plan.value = _evaluate_nodes(nodes, plan.decision, plan.segs)
    if budget is None:
        chosen = plans[-1]
    else:
        fits = [p for p in plans if static + p.value[0] + p.value[1] <= budget]  # type: ignore[index]
        if not fits:
            best = min(plans, key=lambda p: p.value[0] + p.value[1])  # type: ignore[index]
            k_, t_, _, _ = best.value  # type: ignore[misc]
            smallest = static + k_ + t_
            raise BudgetError(
                f"strategy {label!r} cannot fit the budget {_format_bytes(budget)}: its smallest "
                f"peak is {_format_bytes(smallest)} ({smallest:.0f} bytes; "
                f"{_breakdown(static, k_, t_)}). Use strategy 'optimal', which finds the "
                f"smallest peak any plan reaches, or a budget of at least {_format_bytes(smallest)}"
            )
        chosen = min(fits, key=lambda p: (p.value[2], p.value[3], p.value[0] + p.value[1]))  # type: ignore[index]
    return _solution(nodes, chosen, label, budget, static, plans)


def _breakdown(static: float, kept: float, transient: float) -> str:
    return (
        f"static {_format_bytes(static)}, kept activations {_format_bytes(kept)}, "
        f"largest recompute transient {_format_bytes(transient)}"
    )


def _solution(
    nodes: list[_Node],
    plan: _Plan,
    label: str,
    budget: float | None,
    static: float,
    family: list[_Plan],
    *,
    exact: bool = True,
) -> Solution:
    if plan.value is None:
        plan.value = _evaluate_nodes(nodes, plan.decision, plan.segs)
    kept, trans, secs, flops = plan.value
    points = []
    for p in family:
        if p.value is None:
            p.value = _evaluate_nodes(nodes, p.decision, p.segs)
        points.append((static + p.value[0] + p.value[1], p.value[2], p.value[3]))
    return Solution(
        decisions={n.name: plan.decision[n.idx] for n in nodes},
        segments={nodes[u].name: sorted(r) for u, r in sorted(plan.segs.items())},
        strategy=label,
        budget_bytes=budget,
        static_bytes=static,
        kept_bytes=kept,
        transient_bytes=trans,
        predicted_peak_bytes=static + kept + trans,
        recompute_flops=flops,
        recompute_seconds=secs,
        frontier=[FrontierPoint(p, s, f) for p, s, f in _pareto3(points)],
        exact=exact,
    )


def _pareto3(points: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    out: list[tuple[float, float, float]] = []
    best = (math.inf, math.inf)
    for p in sorted(points):
        if (p[1], p[2]) < best:
            out.append(p)
            best = (p[1], p[2])
    return out


# --------------------------------------------------------------------------- optimal: exact
#
# A frontier is a list of points (kept, seconds, flops, ref) sorted by kept, on which no
# point is matched or beaten in kept by one that is cheaper in (seconds, flops), compared
# lexicographically. ``ref`` records how the point was built, for reconstruction: None
# (nothing recomputed), a pair (ref, ref) of two parts, ("recompute" | "selective", unit)
# or ("segment", unit, start, end, ref of what precedes the segment).

_KEY = itemgetter(0)
_EMPTY: list = [(0.0, 0.0, 0.0, None)]


class _TooLarge(Exception):
    """The exact programme outgrew its work limit; the relaxation takes over."""


class _Work:
    """The exact programme's work limit, and the bounds it may prune with: points that take
    ``seconds`` or more, or keep more than ``kept`` bytes, cannot lead to a better plan
    (kept only grows towards the root, and so does time)."""

    __slots__ = ("left", "seconds", "kept")

    def __init__(self, limit: int, seconds: float = math.inf, kept: float = math.inf) -> None:
        self.left = limit
        self.seconds = seconds
        self.kept = kept

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _TooLarge


def _prune(points: list, work: _Work) -> list:
    """Sort points by memory and drop the dominated ones."""
    work.spend(len(points))
    # Sorting on memory alone is several times faster than on (memory, time, flops); a
    # point that ties the last one kept on memory but is cheaper replaces it instead.
    points.sort(key=_KEY)
    out: list = []
    append = out.append
    best_s, best_f = work.seconds, math.inf
    for p in points:
        if p[0] > work.kept:
            break
        s = p[1]
        if s < best_s or (s == best_s and p[2] < best_f):
            if out and out[-1][0] == p[0]:
                out[-1] = p
            else:
                append(p)
            best_s, best_f = s, p[2]
    return out


def _minkowski(a: list, b: list, work: _Work) -> list:
    """Frontier of the sums of one point of ``a`` and one of ``b``."""
    if len(a) == 1:
        a, b = b, a
    if len(b) == 1:
        bk, bs, bf, br = b[0]
        if br is None and bk == 0.0 and bs == 0.0 and bf == 0.0:
            return a
        work.spend(len(a))
        return [(k + bk, s + bs, f + bf, (r, br)) for k, s, f, r in a]
    work.spend(len(a) * len(b))
    return _prune(
        [(ak + bk, as_ + bs, af + bf, (ar, br)) for ak, as_, af, ar in a for bk, bs, bf, br in b],
        work,
    )


def _node_frontier(
    node: _Node,
    rec_ok: bool,
    sel_ok: bool,
    lo: list[int] | None,
    kids: list[list],
    work: _Work,
) -> list:
    if lo is not None:
        combined = _chain(node, lo, kids, work)
    else:
        combined = _EMPTY
        for f in kids:
            combined = _minkowski(combined, f, work)
    own = node.own
    points = [(k + own, s, f, r) for k, s, f, r in combined] if own else list(combined)
    if not (rec_ok or sel_ok):
        return points
    if rec_ok:
        points.append((node.inp, node.fwd_s, node.fwd_f, ("recompute", node.idx)))
    if sel_ok:
        points.append((node.inp + node.mm, node.sel_s, node.sel_f, ("selective", node.idx)))
    return _prune(points, work)


class _WindowUnion:
    """Pareto union of a sliding window of frontiers (a queue), amortized O(size) per step.

    The classic two-stack queue: the union is associative, so the front stack keeps
    running unions from its bottom and the back stack one running union.
    """

    def __init__(self, work: _Work) -> None:
        self.work = work
        self.front: list[tuple[int, list]] = []  # (start index, frontier); top is oldest
        self.front_union: list[list] = []
        self.back: list[tuple[int, list]] = []
        self.back_union: list = []

    def push(self, index: int, frontier: list) -> None:
        self.back.append((index, frontier))
        self.back_union = _prune(self.back_union + frontier, self.work)

    def pop_before(self, index: int) -> None:
        while True:
            if not self.front:
                if not self.back:
                    return
                self.front = self.back[::-1]
                self.front_union = []
                for _, f in self.front:
                    prev = self.front_union[-1] if self.front_union else []
                    self.front_union.append(_prune(prev + f, self.work))
                self.back, self.back_union = [], []
            if self.front[-1][0] >= index:
                return
            self.front.pop()
            self.front_union.pop()

    def parts(self) -> list[list]:
        """Frontiers whose union is the window's union (merged by the caller's prune)."""
        out = [self.back_union] if self.back_union else []
        if self.front_union:
            out.append(self.front_union[-1])
        return out


def _chain(node: _Node, lo: list[int], kids: list[list], work: _Work) -> list:
    """Frontier of a sequential unit's children, segments [i..j] allowed for lo[j] <= i < j.

    prefix[j] is the frontier of children 0..j-1. A segment [i..j] adds child i's input to
    kept and the forward times of children i..j, so its candidates for prefix[j + 1] are
    prefix[i] shifted; storing prefix[i] shifted by -pre_s[i] makes the shift the same,
    +pre_s[j + 1], for every start, and the window of starts a sliding one.
    """
    pre_s, pre_f, kid_inp, idx = node.pre_s, node.pre_f, node.kid_inp, node.idx
    window = _WindowUnion(work)
    older: list = []  # prefix[j - 1]
    prefix = _EMPTY  # prefix[j]
    for j, f in enumerate(kids):
        if j > 0:
            i = j - 1
            inp, ds, df = kid_inp[i], pre_s[i], pre_f[i]
            work.spend(len(older))
            window.push(i, [(k + inp, s - ds, fl - df, r, i) for k, s, fl, r in older])
        window.pop_before(lo[j])
        if lo[j] < j:
            # One prune for both kinds of candidates: child j alone after prefix[j], and
            # the segments ending at j.
            cand = [
                (ak + bk, as_ + bs, af + bf, (ar, br))
                for bk, bs, bf, br in f
                for ak, as_, af, ar in prefix
            ]
            ds, df = pre_s[j + 1], pre_f[j + 1]
            for part in window.parts():
                cand.extend(
                    (k, s + ds, fl + df, ("segment", idx, i, j, r)) for k, s, fl, r, i in part
                )
            cand = _prune(cand, work)
        else:
            cand = _minkowski(prefix, f, work)
        older, prefix = prefix, cand
    return prefix


def _window(node: _Node, cap: float) -> list[int] | None:
    """lo[j]: the first child a segment ending at child j may start at under transient
    ``cap``; None when no segment fits at all (or the unit is not sequential)."""
    if not node.pre_saved:
        return None
    pre, run_start = node.pre_saved, node.run_start
    lo: list[int] = []
    i = 0
    any_segment = False
    for j in range(len(run_start)):
        i = max(i, run_start[j])
        while i < j and pre[j + 1] - pre[i] > cap:
            i += 1
        lo.append(i)
        any_segment = any_segment or i < j
    return lo if any_segment else None


def _transients(nodes: list[_Node], limit: int) -> list[float] | None:
    """Every distinct transient a piece can have, below the no-checkpoint activations
    (a larger one never beats keeping everything), ascending and after 0; None when there
    are more than ``limit``."""
    top = nodes[0].saved
    caps: set[float] = set()
    for node in nodes[1:]:
        if node.can_rec:
            caps.add(node.rec_t)
        if node.can_sel:
            caps.add(node.sel_t)
    seq = [n for n in nodes if n.pre_saved]
    if sum(j - start for n in seq for j, start in enumerate(n.run_start)) > _MAX_SEGMENT_SUMS:
        return None
    for node in seq:
        pre = node.pre_saved
        for j, start in enumerate(node.run_start):
            end = pre[j + 1]
            caps.update(end - pre[i] for i in range(start, j))
    positive = sorted(c for c in caps if 0 < c < top)
    return None if len(positive) + 1 > limit else [0.0, *positive]


def _reconstruct(nodes: list[_Node], ref: object) -> _Plan:
    decision = ["keep"] * len(nodes)
    segs: dict[int, list[tuple[int, int]]] = {}
    stack = [ref]
    while stack:
        r = stack.pop()
        if r is None:
            continue
        kind = r[0]  # type: ignore[index]
        if type(kind) is not str:
            stack.extend(r)  # type: ignore[arg-type]
        elif kind == "segment":
            _, node, i, j, prev = r  # type: ignore[misc]
            segs.setdefault(node, []).append((i, j))
            stack.append(prev)
        else:
            decision[r[1]] = kind  # type: ignore[index]
    for ranges in segs.values():
        ranges.sort()
    return _Plan(decision, segs)


def _exact_points(nodes: list[_Node], work: _Work, keep_cap: Any = None) -> list:
    """The tree's exact Pareto frontier as points (kept + cap, seconds, flops, ref).

    For each cap T on the transient, one bottom-up pass computes every unit's frontier of
    (kept, seconds) over the plans whose recomputed pieces each fit in T; such a plan
    peaks at no more than static + kept + T, with equality when its largest piece is T.
    Every plan is counted exactly under the cap equal to its largest piece, so the union
    over all distinct transients, pruned, is the exact frontier. Raises _TooLarge past the
    work limit. With bounds in ``work``, only the frontier's points within them are kept,
    and only the caps ``keep_cap(cap)`` accepts are tried.
    """
    levels = _transients(nodes, 10**9 if keep_cap else _EXACT_LEVELS)
    if levels is not None and keep_cap is not None:
        levels = [cap for cap in levels if keep_cap(cap)]
    if levels is None or len(levels) > _EXACT_LEVELS:
        raise _TooLarge
    # A unit's frontier depends only on which pieces inside it the cap allows, so it is
    # keyed by that (interned to an int) and reused across caps that allow the same ones.
    interned: dict[tuple, int] = {}
    cache: list[dict[int, list]] = [{} for _ in nodes]
    key_of = [0] * len(nodes)
    post_order = nodes[::-1]
    union: list = []
    previous_root = -1
    for cap in levels:
        for node in post_order:
            rec_ok = node.can_rec and node.rec_t <= cap
            sel_ok = node.can_sel and node.sel_t <= cap
            lo = _window(node, cap)
            kids = node.children
            key = (
                rec_ok,
                sel_ok,
                tuple([key_of[c] for c in kids]),
                None if lo is None else tuple(lo),
            )
            k = interned.get(key)
            if k is None:
                k = interned[key] = len(interned)
            key_of[node.idx] = k
            if k not in cache[node.idx]:
                frontiers = [cache[c][key_of[c]] for c in kids]
                cache[node.idx][k] = _node_frontier(node, rec_ok, sel_ok, lo, frontiers, work)
        if key_of[0] == previous_root:
            continue  # the same plans as under the previous, smaller cap: nothing new
        previous_root = key_of[0]
        union.extend((k + cap, s, f, r) for k, s, f, r in cache[0][key_of[0]])
    return _prune(union, _Work(len(union) + 1, work.seconds))


# --------------------------------------------------------------------------- optimal: relaxation
#
# Past the exact programme's reach, the solver minimizes seconds + lam * kept for a fixed
# cap T on the transient: one scalar pass over the tree, linear in its size (a chain
# keeps its window of segment starts in a monotone queue). Each pass returns a plan on the
# lower convex hull of the frontier under T. A Newton search over lam finds the two hull
# vertices around the budget; a local search then spends the memory the one that fits
# leaves unused, from it and from the fixed strategies' best plans. Last, the exact
# programme runs again, pruning all that cannot beat the plan found.


class _Vertex:
    """A plan found by a scalar pass: its totals and the choices to rebuild it."""

    __slots__ = ("kept", "secs", "flops", "trans", "choice", "chains")

    def __init__(self, root: tuple, choice: list[int], chains: dict[int, list[int]]) -> None:
        _, self.kept, self.secs, self.flops, self.trans = root
        self.choice = choice
        self.chains = chains

    def plan(self, nodes: list[_Node]) -> _Plan:
        decision = ["keep"] * len(nodes)
        segs: dict[int, list[tuple[int, int]]] = {}
        stack = [0]
        while stack:
            u = stack.pop()
            ch = self.choice[u]
            if ch:
                decision[u] = "recompute" if ch == 1 else "selective"
                continue
            picks = self.chains.get(u)
            kids = nodes[u].children
            if picks is None:
                stack.extend(kids)
                continue
            j = len(picks)
            while j > 0:
                i = picks[j - 1]
                if i < 0:
                    stack.append(kids[j - 1])
                    j -= 1
                else:
                    segs.setdefault(u, []).append((i, j - 1))
                    j = i
        for ranges in segs.values():
            ranges.sort()
        return _Plan(decision, segs, (self.kept, self.trans, self.secs, self.flops))


def _scalar_pass(
    nodes: list[_Node],
    cap: float,
    windows: dict[int, list[int] | None],
    a: float,
    b: float,
    tie_memory: bool,
) -> _Vertex:
    """The plan minimizing a * seconds + b * kept with every piece's transient <= cap.

    Ties go to less memory when ``tie_memory``, else to less time. Values are tuples
    (objective, kept, seconds, flops, largest transient).
    """
    best: list[tuple] = [()] * len(nodes)
    choice = [0] * len(nodes)
    chains: dict[int, list[int]] = {}
    for node in reversed(nodes):
        u = node.idx
        own = node.own
        lo = windows.get(u)
        if lo is not None:
            v, k, s, f, t = _scalar_chain(node, lo, best, a, b, tie_memory, chains)
            v += b * own
            k += own
        else:
            v, k, s, f, t = b * own, own, 0.0, 0.0, 0.0
            for c in node.children:
                cv, ck, cs, cf, ct = best[c]
                v += cv
                k += ck
                s += cs
                f += cf
                if ct > t:
                    t = ct
        cur = (v, k, s, f, t)
        tie = k if tie_memory else s
        ch = 0
        if node.can_rec and node.rec_t <= cap:
            rv = a * node.fwd_s + b * node.inp
            rt = node.inp if tie_memory else node.fwd_s
            if rv < v or (rv == v and rt < tie):
                cur = (rv, node.inp, node.fwd_s, node.fwd_f, node.rec_t)
                v, tie, ch = rv, rt, 1
        if node.can_sel and node.sel_t <= cap:
            sk = node.inp + node.mm
            sv = a * node.sel_s + b * sk
            st = sk if tie_memory else node.sel_s
            if sv < v or (sv == v and st < tie):
                cur = (sv, sk, node.sel_s, node.sel_f, node.sel_t)
                ch = 2
        best[u] = cur
        choice[u] = ch
    return _Vertex(best[0], choice, chains)


def _scalar_chain(
    node: _Node,
    lo: list[int],
    best: list[tuple],
    a: float,
    b: float,
    tie_memory: bool,
    chains: dict[int, list[int]],
) -> tuple:
    # d[j]: the best plan of children 0..j-1. A segment [i..j] scores
    # d[i] + b * input_i + a * (pre_s[j + 1] - pre_s[i]): the part that depends on i is
    # kept, for the window of starts, in a queue of increasing scores.
    kids, pre_s, pre_f, pre_t, kid_inp = (
        node.children,
        node.pre_s,
        node.pre_f,
        node.pre_saved,
        node.kid_inp,
    )
    d: list[tuple] = [(0.0, 0.0, 0.0, 0.0, 0.0)]
    picks: list[int] = []
    queue: deque[tuple[float, float, int]] = deque()
    for j, c in enumerate(kids):
        if j > 0:
            i = j - 1
            pv, pk, ps, _, _ = d[i]
            score = pv + b * kid_inp[i] - a * pre_s[i]
            tie = pk + kid_inp[i] if tie_memory else ps - pre_s[i]
            while queue and (
                queue[-1][0] > score or (queue[-1][0] == score and queue[-1][1] >= tie)
            ):
                queue.pop()
            queue.append((score, tie, i))
        while queue and queue[0][2] < lo[j]:
            queue.popleft()
        pv, pk, ps, pf, pt = d[j]
        cv, ck, cs, cf, ct = best[c]
        cur = (pv + cv, pk + ck, ps + cs, pf + cf, max(pt, ct))
        pick = -1
        if queue:
            score, tie, i = queue[0]
            sv = score + a * pre_s[j + 1]
            if not tie_memory:
                tie += pre_s[j + 1]
            if sv < cur[0] or (sv == cur[0] and tie < (cur[1] if tie_memory else cur[2])):
                qv, qk, qs, qf, qt = d[i]
                cur = (
                    sv,
                    qk + kid_inp[i],
                    qs + pre_s[j + 1] - pre_s[i],
                    qf + pre_f[j + 1] - pre_f[i],
                    max(qt, pre_t[j + 1] - pre_t[i]),
                )
                pick = i
        d.append(cur)
        picks.append(pick)
    chains[node.idx] = picks
    return d[-1]


def _unit_transients(nodes: list[_Node]) -> set[float]:
    caps: set[float] = set()
    for node in nodes[1:]:
        if node.can_rec:
            caps.add(node.rec_t)
        if node.can_sel:
            caps.add(node.sel_t)
    return caps


def _segment_transients(nodes: list[_Node], low: float, high: float) -> list[float]:
    """Distinct segment transients in (low, high); a geometric grid over that part of
    their range instead when there are too many to list."""
    seq = [n for n in nodes if n.pre_saved]
    if sum(j - start for n in seq for j, start in enumerate(n.run_start)) <= _MAX_SEGMENT_SUMS:
        caps: set[float] = set()
        for node in seq:
            pre = node.pre_saved
            for j, start in enumerate(node.run_start):
                end = pre[j + 1]
                caps.update(end - pre[i] for i in range(start, j))
        return sorted(c for c in caps if low < c < high)
    least, most = math.inf, 0.0
    for node in seq:
        pre = node.pre_saved
        for j, start in enumerate(node.run_start):
            if start < j:
                least = min(least, pre[j + 1] - pre[j - 1])
                most = max(most, pre[j + 1] - pre[start])
    least, most = max(least, low), min(most, high)
    if not 0 < least < most:
        return []
    steps = 4 * _RELAXED_LEVELS
    return [least * (most / least) ** (q / steps) for q in range(steps + 1)]


def _pick(values: list[float], count: int) -> list[float]:
    """At most ``count`` of the sorted ``values``: half spread by rank (where transients
    crowd) and half geometrically (so every scale is covered), the largest always."""
    if len(values) <= count:
        return values
    chosen = {values[-1]}
    half = max(1, count // 2)
    chosen.update(values[round(q * (len(values) - 1) / half)] for q in range(half))
    low, high = values[0], values[-1]
    if low > 0:
        for q in range(count - half - 1):
            target = low * (high / low) ** (q / max(1, count - half - 1))
            chosen.add(values[max(0, bisect_right(values, target * (1 + 1e-12)) - 1)])
    return sorted(chosen)


def _first_caps(nodes: list[_Node]) -> list[float]:
    """The caps of the relaxation's first sweep: every distinct transient when the passes
    stay within _PASS_WORK, else at most that many, the units' own transients first (they
    are few when blocks repeat) and segment transients in the room left."""
    top = nodes[0].saved
    count = max(_RELAXED_LEVELS, _PASS_WORK // (_PASSES_PER_CAP * len(nodes)))
    units = sorted(c for c in _unit_transients(nodes) if 0 < c < top)
    caps = _pick(units, count // 2)
    segments = _segment_transients(nodes, 0.0, top)
    caps = sorted(set(caps) | set(_pick(segments, count - len(caps))))
    if len(caps) < count:
        caps = sorted(set(caps) | set(_pick(units, count - len(caps))))
    return [0.0, *caps]


def _caps_between(nodes: list[_Node], low: float, high: float, count: int) -> list[float]:
    values = {c for c in _unit_transients(nodes) if low < c < high}
    values.update(_segment_transients(nodes, low, high))
    return _pick(sorted(values), count)


class _Level:
    """What the relaxation found under one cap: the vertices, the one that fits, the
    lower bound on the time of any plan that fits, and the (lam, min of seconds + lam *
    kept) pairs the bound came from."""

    __slots__ = ("cap", "found", "fits", "bound", "duals")

    def __init__(
        self,
        cap: float,
        found: list[_Vertex],
        fits: _Vertex | None,
        bound: float,
        duals: list[tuple[float, float]] | None = None,
    ) -> None:
        self.cap, self.found, self.fits, self.bound = cap, found, fits, bound
        self.duals = duals or []

    def bound_at(self, room: float) -> float:
        """A lower bound on the time of plans under this cap that keep at most ``room``."""
        return max((v - lam * room for lam, v in self.duals), default=-math.inf)


def _relax_level(nodes: list[_Node], cap: float, room: float | None) -> _Level:
    """Hull vertices under ``cap``: the least-memory and least-time plans and, given the
    room (bytes for kept activations), the Newton search's vertices around it, with the
    vertex that fits and the Lagrangian lower bound on the time of any plan that fits.
    With ``room`` None, a fixed spread of multipliers maps the hull for the report."""
    windows = {n.idx: _window(n, cap) for n in nodes if n.pre_saved}
    least_memory = _scalar_pass(nodes, cap, windows, 0.0, 1.0, False)
    least_time = _scalar_pass(nodes, cap, windows, 1.0, 0.0, True)
    found = [least_memory, least_time]
    span = least_time.kept - least_memory.kept
    if room is None:
        if span > 0:
            slope = (least_memory.secs - least_time.secs) / span
            for q in (-3, -2, -1, 0, 1, 2, 3):
                found.append(_scalar_pass(nodes, cap, windows, 1.0, slope * 4.0**q, True))
        return _Level(cap, found, None, math.inf)
    duals = [(0.0, least_time.secs)]
    if least_memory.kept > room:
        return _Level(cap, found, None, math.inf, duals)
    if least_time.kept <= room:
        return _Level(cap, found, least_time, least_time.secs, duals)
    low, high = least_time, least_memory  # low: too big; high: fits
    # Every pass gives a lower bound on the time of any plan that fits under this cap:
    # min(seconds + lam * kept) - lam * room (lam = 0: the least time at all). At the last
    # lam, with low and high adjacent on the hull, it is the best such bound.
    bound = least_time.secs
    for _ in range(_NEWTON_STEPS):
        lam = (high.secs - low.secs) / (low.kept - high.kept)
        if not lam > 0:
            break
        x = _scalar_pass(nodes, cap, windows, 1.0, lam, True)
        duals.append((lam, x.secs + lam * x.kept))
        bound = max(bound, x.secs + lam * (x.kept - room))
        line = low.secs + lam * low.kept
        if x.secs + lam * x.kept >= line - 1e-9 * abs(line):
            break  # no vertex between the two: they are adjacent on the hull
        found.append(x)
        if x.kept <= room:
            high = x
        else:
            low = x
    return _Level(cap, found, high, bound, duals)


_NEWTON_STEPS = 40
# How many caps the relaxation adds around the most promising one, and how many of the
# caps' best plans the local search polishes.
_REFINE = 8
_REFINED = 3
_POLISHED = 3
# Node visits the first sweep may spend (about _PASSES_PER_CAP passes per cap): all the
# distinct transients of a mid-sized tree fit in it.
_PASS_WORK = 200_000
_PASSES_PER_CAP = 8
# Fixed strategies whose plans seed the relaxation: (name, k).
_SEEDS: tuple[tuple[str, int | None], ...] = (
    ("full", None),
    ("uniform", None),
    ("uniform", 2),
    ("uniform", 4),
    ("uniform", 8),
    ("sqrt", None),
)


def _solve_relaxed(
    nodes: list[_Node], label: str, budget: float | None, static: float, retry: bool = True
) -> Solution:
    caps = _first_caps(nodes)
    if budget is None:
        # Nothing to fit. For the report: the least-memory plan under every cap of the
        # sweep (the frontier's smallest peak) and the hull under a few of them.
        plans = [
            v.plan(nodes)
            for cap in caps[:: max(1, len(caps) // 8)]
            for v in _relax_level(nodes, cap, None).found
        ]
        for cap in caps:
            windows = {n.idx: _window(n, cap) for n in nodes if n.pre_saved}
            plans.append(_scalar_pass(nodes, cap, windows, 0.0, 1.0, False).plan(nodes))
        chosen = _Plan(["keep"] * len(nodes), {})
        plans.append(chosen)
        sol = _solution(nodes, chosen, label, budget, static, plans, exact=False)
        sol.note = "no budget given: the cheapest plan is chosen, and it recomputes nothing"
        return sol
    room = budget - static
    levels = [_relax_level(nodes, cap, room - cap) for cap in caps]
    # Refine around the caps with the lowest bounds: the best cap is rarely far from them.
    ranked = sorted(range(len(levels)), key=lambda i: levels[i].bound)
    tried = {level.cap for level in levels}
    # (around the best one only on large trees, where each cap costs more)
    for i in ranked[: _REFINED if len(nodes) <= _BOUNDED_UNITS else 1]:
        if levels[i].bound == math.inf:
            break
        low = levels[i - 1].cap if i > 0 else 0.0
        high = levels[i + 1].cap if i + 1 < len(caps) else nodes[0].saved
        for cap in _caps_between(nodes, low, high, _REFINE):
            if cap not in tried:
                tried.add(cap)
                levels.append(_relax_level(nodes, cap, room - cap))
    plans = [v.plan(nodes) for level in levels for v in level.found]

    def peak(p: _Plan) -> float:
        return p.value[0] + p.value[1]  # type: ignore[index]

    def cost(p: _Plan) -> tuple[float, float, float]:
        return (p.value[2], p.value[3], peak(p))  # type: ignore[index]

    # The fixed strategies' best plans are cheap to find and seed the local search: the
    # result is never worse than theirs.
    chains = _find_chains(nodes)
    for name, k in _SEEDS:
        plans.extend(_family(nodes, chains, name, k, room))
    fits = [p for p in plans if peak(p) <= room]
    if fits:
        # Polish the fitting vertex of the caps with the lowest bounds (the bound says how
        # much a cap could still gain; the vertex's own time does not), and the best plan.
        promising = sorted((lv for lv in levels if lv.fits is not None), key=lambda lv: lv.bound)
        starts = [level.fits.plan(nodes) for level in promising[:_POLISHED]]  # type: ignore[union-attr]
        starts.append(min(fits, key=cost))
        polished = [_polish(nodes, start, room) for start in starts]
        fits.extend(polished)
        plans.extend(polished)
    best = min(fits, key=cost) if fits else None
    # The exact programme again, now pruning every point that cannot beat the best plan
    # found or fit the room: it often finishes on mid-sized trees, and then the plan is
    # proven optimal.
    exact = False
    if retry:
        # A cap whose Lagrangian bound is no better than the plan in hand cannot give a
        # better plan: only the others are tried (with a margin for the passes' rounding).
        limit = best.value[2] if best else math.inf  # type: ignore[index]
        bound = _cap_bounds(levels, room)
        try:
            points = _exact_points(
                nodes,
                _Work(_BOUNDED_WORK, limit, room),
                lambda cap: bound(cap) < limit * (1 + 1e-9) + 1e-12,
            )
        except _TooLarge:
            points = []
        else:
            exact = True
        fitting = [p for p in points if p[0] <= room]
        if fitting:
            candidate = _reconstruct(nodes, fitting[-1][3])
            candidate.value = _evaluate_nodes(nodes, candidate.decision, candidate.segs)
            plans.append(candidate)
            fits.append(candidate)
    # The scalar passes sum in another order than the evaluation: take the numbers of the
    # chosen plan from the evaluation, and the next plan should rounding push it out.
    for plan in sorted(fits, key=cost):
        plan.value = _evaluate_nodes(nodes, plan.decision, plan.segs)
        if peak(plan) <= room:
            return _solution(nodes, plan, label, budget, static, plans, exact=exact)
    raise BudgetError(_too_small(budget, _least_peak(nodes), static))


def _cap_bounds(levels: list[_Level], room: float) -> Any:
    """A lower bound on the time of plans that fit under any cap T, from the caps tried.

    Tried: its own bound. Between tried caps a < T < b: plans under T are plans under b
    (fewer pieces allowed) that keep at most room - T <= room - a, so b's Lagrangian
    bound at room - a holds for them.
    """
    tried = sorted(levels, key=lambda lv: lv.cap)
    caps = [lv.cap for lv in tried]
    exact = {lv.cap: lv.bound for lv in tried}

    def bound(cap: float) -> float:
        if cap in exact:
            return exact[cap]
        k = bisect_right(caps, cap)
        if k == len(caps):
            return -math.inf
        below = caps[k - 1] if k > 0 else 0.0
        return tried[k].bound_at(room - below)

    return bound


def _least_peak(nodes: list[_Node]) -> _Plan:
    """The plan with the smallest peak: the least-memory plan under each distinct cap (or,
    past 512 of them, under a spread of 512)."""
    caps = _transients(nodes, 10**9) or [
        0.0,
        *_unit_transients(nodes),
        *_segment_transients(nodes, 0.0, math.inf),
    ]
    best: _Plan | None = None
    for cap in _pick(sorted(set(caps)), 512):
        windows = {n.idx: _window(n, cap) for n in nodes if n.pre_saved}
        plan = _scalar_pass(nodes, cap, windows, 0.0, 1.0, False).plan(nodes)
        if best is None or plan.value[0] + plan.value[1] < best.value[0] + best.value[1]:  # type: ignore[index]
            best = plan
    return best  # type: ignore[return-value]


def _polish(nodes: list[_Node], plan: _Plan, room: float) -> _Plan:
    """Local search from ``plan``: spend the memory it leaves under ``room`` (bytes for
    kept + transient) on recomputing less.

    Moves that save time: keep a recomputed unit whole ("drop"), recompute it selectively,
    recompute its children one by one instead ("split"), or take one child off either end
    of a segment. Moves that save memory at no time: merge two adjacent pieces of a chain
    into one segment. Each round applies the time-saving moves that fit, most time saved
    per byte spent first, else the merge that frees the most memory. A move depends only on
    its piece (and, for a merge, its neighbour), so moves are kept per piece and only the
    pieces a round changes are looked at again.
    """
    state = _PolishState(nodes, plan)
    for _ in range(4 * len(nodes) + 16):
        if not state.round(room):
            break
    polished = _Plan(state.decision, {u: sorted(r) for u, r in state.segs.items() if r})
    polished.value = _evaluate_nodes(nodes, polished.decision, polished.segs)
    if polished.value[0] + polished.value[1] > room or polished.value[2] > plan.value[2]:  # type: ignore[index]
        return plan  # cannot happen under the cost model; a safety net for rounding
    return polished


class _PolishState:
    """A plan as pieces, with running totals and the moves of each piece (see _polish).

    A piece is ("u", unit) for a unit recomputed or selective, or ("s", unit, i, j) for a
    segment of a sequential unit. A move is (d_kept, d_seconds, d_flops, transients
    removed, transients added, pieces removed, pieces added, decisions to set).
    """

    def __init__(self, nodes: list[_Node], plan: _Plan) -> None:
        self.nodes = nodes
        self.decision = list(plan.decision)
        self.segs: dict[int, list[tuple[int, int]]] = {u: list(r) for u, r in plan.segs.items()}
        self.kept = plan.value[0]  # type: ignore[index]
        self.parent = [-1] * len(nodes)
        self.position = [0] * len(nodes)
        for node in nodes:
            for pos, c in enumerate(node.children):
                self.parent[c], self.position[c] = node.idx, pos
        self.moves: dict[tuple, list[tuple]] = {}
        self.ranges: dict[int, list[tuple[int, int]]] = {}  # mergeable pieces per chain
        self.ts: list[float] = []
        for u, d in enumerate(self.decision):
            if d != "keep":
                self._add(("u", u))
        for u, ranges in self.segs.items():
            for i, j in ranges:
                self._add(("s", u, i, j))

    # ---------------------------------------------------------------- pieces

    def _piece(self, u: int, i: int, j: int) -> tuple:
        """The piece covering children i..j of chain u: a segment, or child i alone."""
        return ("u", self.nodes[u].children[i]) if i == j else ("s", u, i, j)

    def _transient(self, piece: tuple) -> float:
        if piece[0] == "s":
            pre = self.nodes[piece[1]].pre_saved
            return pre[piece[3] + 1] - pre[piece[2]]
        node = self.nodes[piece[1]]
        return node.rec_t if self.decision[node.idx] == "recompute" else node.sel_t

    def _chain_range(self, piece: tuple) -> tuple[int, tuple[int, int]] | None:
        if piece[0] == "s":
            return piece[1], (piece[2], piece[3])
        u = piece[1]
        if self.decision[u] == "recompute" and u and self.nodes[self.parent[u]].pre_saved:
            return self.parent[u], (self.position[u], self.position[u])
        return None

    def _add(self, piece: tuple) -> None:
        insort(self.ts, self._transient(piece))
        self.moves[piece] = self._piece_moves(piece)
        where = self._chain_range(piece)
        if where is None:
            return
        u, (i, j) = where
        ranges = self.ranges.setdefault(u, [])
        k = bisect_right(ranges, (i, j))
        ranges.insert(k, (i, j))
        if k > 0 and ranges[k - 1][1] + 1 == i:
            self._add_merge(u, ranges[k - 1], (i, j))
        if k + 1 < len(ranges) and ranges[k + 1][0] == j + 1:
            self._add_merge(u, (i, j), ranges[k + 1])

    def _remove(self, piece: tuple) -> None:
        self.ts.remove(self._transient(piece))
        del self.moves[piece]
        where = self._chain_range(piece)
        if where is None:
            return
        u, (i, j) = where
        ranges = self.ranges[u]
        k = ranges.index((i, j))
        if k > 0:
            self.moves.pop(("m", u, ranges[k - 1], (i, j)), None)
        if k + 1 < len(ranges):
            self.moves.pop(("m", u, (i, j), ranges[k + 1]), None)
        del ranges[k]

    def _add_merge(self, u: int, left: tuple[int, int], right: tuple[int, int]) -> None:
        node = self.nodes[u]
        if node.run_start[right[1]] > left[0]:
            return
        a, b = self._piece(u, *left), self._piece(u, *right)
        pre = node.pre_saved
        self.moves[("m", u, left, right)] = [
            (
                -node.kid_inp[right[0]],
                0.0,
                0.0,
                (self._transient(a), self._transient(b)),
                (pre[right[1] + 1] - pre[left[0]],),
                (a, b),
                (("s", u, left[0], right[1]),),
                tuple((p[1], "keep") for p in (a, b) if p[0] == "u"),
            )
        ]

    def _piece_moves(self, piece: tuple) -> list[tuple]:
        nodes = self.nodes
        out: list[tuple] = []
        if piece[0] == "s":
            _, u, i, j = piece
            node = nodes[u]
            old = (self._transient(piece),)
            first, last = nodes[node.children[i]], nodes[node.children[j]]
            pre = node.pre_saved
            # Off the end: the segment shrinks, or the child left becomes a single piece.
            out.append(
                (
                    last.saved,
                    -last.fwd_s,
                    -last.fwd_f,
                    old,
                    (first.rec_t if i == j - 1 else pre[j] - pre[i],),
                    (piece,),
                    (self._piece(u, i, j - 1),),
                    ((first.idx, "recompute"),) if i == j - 1 else (),
                )
            )
            out.append(
                (
                    first.saved - node.kid_inp[i] + node.kid_inp[i + 1],
                    -first.fwd_s,
                    -first.fwd_f,
                    old,
                    (last.rec_t if i + 1 == j else pre[j + 1] - pre[i + 1],),
                    (piece,),
                    (self._piece(u, i + 1, j),),
                    ((last.idx, "recompute"),) if i + 1 == j else (),
                )
            )
            return out
        u = piece[1]
        node = nodes[u]
        if self.decision[u] == "recompute":
            pk, ps, pf, pt = node.inp, node.fwd_s, node.fwd_f, node.rec_t
        else:
            pk, ps, pf, pt = node.inp + node.mm, node.sel_s, node.sel_f, node.sel_t
        out.append((node.saved - pk, -ps, -pf, (pt,), (), (piece,), (), ((u, "keep"),)))
        if self.decision[u] == "recompute" and node.can_sel:
            out.append(
                (
                    node.mm,
                    node.sel_s - ps,
                    node.sel_f - pf,
                    (pt,),
                    (node.sel_t,),
                    (piece,),
                    (piece,),
                    ((u, "selective"),),
                )
            )
        if self.decision[u] == "recompute" and node.children:
            dk, ds, df = node.own - pk, -ps, -pf
            added: list[float] = []
            pieces: list[tuple] = []
            changes: list[tuple[int, str]] = [(u, "keep")]
            for c in node.children:
                child = nodes[c]
                if child.can_rec:
                    dk, ds, df = dk + child.inp, ds + child.fwd_s, df + child.fwd_f
                    added.append(child.rec_t)
                    pieces.append(("u", c))
                    changes.append((c, "recompute"))
                else:
                    dk += child.saved
            out.append((dk, ds, df, (pt,), tuple(added), (piece,), tuple(pieces), tuple(changes)))
        return out

    # ---------------------------------------------------------------- search

    def _largest_without(self, removed: tuple) -> float:
        skip = list(removed)
        for v in reversed(self.ts):
            if v in skip:
                skip.remove(v)
            else:
                return v
        return 0.0

    def _peak(self, move: tuple) -> float:
        """kept + largest transient after ``move``."""
        ts = self.ts
        top = ts[-1] if ts else 0.0
        removed = move[3]
        # Many pieces often share the largest transient: removing one of them then leaves
        # the largest as it is, with no search.
        if top in removed and removed.count(top) >= len(ts) - bisect_left(ts, top):
            top = self._largest_without(removed)
        for t in move[4]:
            if t > top:
                top = t
        return self.kept + move[0] + top

    def round(self, room: float) -> bool:
        """Apply this round's moves; False when there is none left.

        The time-saving moves that fit are applied by time saved per byte spent, each if it
        still fits and touches no piece an earlier one changed; without any, the merge that
        frees the most memory.
        """
        current = self.kept + (self.ts[-1] if self.ts else 0.0)
        scored: list[tuple[float, int, tuple]] = []
        best_merge, best_peak = None, current
        for moves in self.moves.values():
            for move in moves:
                peak = self._peak(move)
                if peak > room:
                    continue
                dk, ds, df = move[:3]
                if ds < 0 or (ds == 0 and df < 0 and dk <= 0):
                    ratio = -ds / max(peak - current, 1e-12 * room) if ds < 0 else math.inf
                    scored.append((ratio, len(scored), move))
                elif ds == 0 and df == 0 and peak < best_peak:
                    best_peak, best_merge = peak, move
        if not scored:
            if best_merge is None:
                return False
            self.apply(best_merge)
            return True
        scored.sort(key=lambda x: (-x[0], x[1]))
        touched: set[tuple] = set()
        for _, _, move in scored:
            if touched.isdisjoint(move[5]) and self._peak(move) <= room:
                self.apply(move)
                touched.update(move[5])
                touched.update(move[6])
        return True

    def apply(self, move: tuple) -> None:
        # Pieces are removed under the old decisions (their transients depend on them) and
        # added under the new ones.
        self.kept += move[0]
        for piece in move[5]:
            self._remove(piece)
            if piece[0] == "s":
                self.segs[piece[1]].remove((piece[2], piece[3]))
        for u, d in move[7]:
            self.decision[u] = d
        for piece in move[6]:
            if piece[0] == "s":
                self.segs.setdefault(piece[1], []).append((piece[2], piece[3]))
            self._add(piece)


def _solve_optimal(nodes: list[_Node], label: str, budget: float | None, static: float) -> Solution:
    try:
        points = _exact_points(nodes, _Work(_EXACT_WORK))
    except _TooLarge:
        points = None
    if points is None:
        # The exact retry bounded by the relaxation's plan finishes on mid-sized trees (it
        # needs 2 to 6 times less work than the full programme); on large ones it would
        # only spend the time.
        retry = len(nodes) <= _BOUNDED_UNITS
        return _solve_relaxed(nodes, label, budget, static, retry)
    # points run from least memory to least time; each one's peak is static + p[0].
    if budget is None:
        chosen = len(points) - 1
    else:
        fits = [i for i, p in enumerate(points) if static + p[0] <= budget]
        if not fits:
            plan = _reconstruct(nodes, points[0][3])
            plan.value = _evaluate_nodes(nodes, plan.decision, plan.segs)
            raise BudgetError(_too_small(budget, plan, static))
        chosen = fits[-1]  # the cheapest that fits: time falls along the frontier
    shown = _spread(len(points), _MAX_REPORTED, chosen)
    plans = {i: _reconstruct(nodes, points[i][3]) for i in shown}
    sol = _solution(nodes, plans[chosen], label, budget, static, list(plans.values()))
    if budget is None:
        sol.note = "no budget given: the cheapest plan is chosen" + (
            ", and it recomputes nothing" if sol.recompute_seconds == 0 else ""
        )
    return sol


def _spread(n: int, count: int, must: int) -> list[int]:
    """About ``count`` indices spread evenly over range(n), always with ``must``."""
    if n <= count:
        return list(range(n))
    return sorted({round(q * (n - 1) / (count - 1)) for q in range(count)} | {must})


def _too_small(budget: float, plan: _Plan, static: float) -> str:
    kept, trans = plan.value[0], plan.value[1]  # type: ignore[index]
    smallest = static + kept + trans
    head = (
        f"budget {_format_bytes(budget)} is below the smallest peak any checkpoint plan "
        f"reaches, {_format_bytes(smallest)} ({smallest:.0f} bytes): "
        f"{_breakdown(static, kept, trans)}. "
    )
    if static >= budget:
        return head + (
            f"Static memory alone ({_format_bytes(static)}: parameters, gradients, optimizer "
            "state) exceeds the budget and checkpointing cannot lower it; shrink it (lower "
            "precision master weights, a sharded or smaller optimizer state, a smaller model) "
            f"or raise the budget to at least {_format_bytes(smallest)}"
        )
    if static >= kept + trans:
        return head + (
            "Static memory dominates and checkpointing cannot lower it; shrink it or raise "
            f"the budget to at least {_format_bytes(smallest)}"
        )
    return head + (
        "Activations dominate even with everything possible recomputed; use a smaller "
        f"micro-batch or sequence, or raise the budget to at least {_format_bytes(smallest)}"
    )
