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
``"optimal"``     the cheapest plan under the budget: a dynamic programme that walks the
                  tree in forward order carrying the Pareto frontier of (bytes kept so far,
                  recompute time), exact under the cost model.

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

import heapq
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Literal

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

# The optimal solver's limits (docs/planner.md, "Large trees"). An exact pass may visit
# _EXACT_WORK frontier points; past that, passes are approximate: frontiers are thinned to
# _THIN_POINTS points (_SEGMENT_POINTS where segments start from) and segments of long
# chains start only at geometric distances (1, 2, 3, 4, 6, 8, 12, ...) before their end.
# Every plan is still valid and exactly evaluated; a cheaper one may have been dropped. The
# (peak, time) frontier is walked point by point for at most _STAIRCASE passes, then
# sampled at _SAMPLED caps (trees that needed approximate passes get only its ends). An
# approximate plan is walked for once more, under its own time, when the first walk
# visited fewer than _REFINE_WORK points; it is also planned block by block, each block
# walked exactly within _BLOCK_WORK points.
_EXACT_WORK = 150_000
_REFINE_WORK = 450_000
_BLOCK_WORK = 50_000
_THIN_POINTS = 128
_SEGMENT_POINTS = 16
_STAIRCASE = 24
_SAMPLED = 12
_SMALL_TREE = 64


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


@dataclass(frozen=True)
class Evaluation:
    """The cost model's verdict on one set of decisions (see :func:`evaluate`)."""

    kept_bytes: float
    """Activation bytes held at the end of forward."""
    transient_bytes: float
    """peak - static - kept: the loss, or the excess of the highest rebuild in backward."""
    peak_bytes: float
    """static + the larger of kept + loss and the highest rebuild."""
    recompute_seconds: float
    recompute_flops: float
    rebuild_bytes: float = 0.0
    """The highest point of backward's rebuilds: the bytes kept before the piece, its
    checkpointed input and everything it saves (0 when nothing is recomputed)."""


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
        "sel_ok",
        "seq",
        "hold",
        "whole_s",
        "whole_f",
        "pre_saved",
        "pre_rebuilt",
        "rebuilt",
        "grads",
        "kid_grads",
        "pre_s",
        "pre_f",
        "upto_s",
        "upto_f",
        "run_start",
        "kid_inp",
        "shared",
        "held",
    )

    def __init__(self, idx: int, unit: UnitCost, is_root: bool) -> None:
        self.idx = idx
        self.name = unit.name
        self.children: list[int] = []
        self.own = float(unit.own_saved_bytes)
        self.saved = 0.0
        self.inp = float(unit.input_bytes)
        # What a piece ending with this unit costs to rebuild: its forward less its tail,
        # the trailing ops a rebuild that stops early skips, plus the checkpoint machinery.
        self.fwd_s = _tick(unit.rebuild_seconds())
        self.fwd_f = float(unit.rebuild_flops())
        # Its whole forward, what it costs inside a segment that does not end with it.
        self.whole_s = _tick(unit.fwd_seconds)
        self.whole_f = float(unit.fwd_flops)
        self.sel_s = _tick(unit.selective_seconds())
        self.sel_f = float(unit.non_matmul_fwd_flops)
        self.mm = float(unit.matmul_saved_bytes)
        # Input bytes the sibling before this unit already saves (see evaluate's shared_inputs).
        self.shared = min(float(unit.input_saved_by_previous_bytes), self.inp)
        # Of those, what this unit saves too (held after a recomputed sibling before it).
        self.held = min(float(unit.input_saved_by_both_bytes), self.shared)
        # The root is the whole model: there is nothing outside it to hold its inputs.
        self.can_rec = bool(unit.can_recompute) and not is_root
        # Selective recompute fails where a matmul output it caches is changed in place.
        self.sel_ok = bool(unit.can_select)
        # It only differs from recompute when matmul outputs are saved.
        self.can_sel = self.can_rec and self.sel_ok and self.mm > 0
        self.seq = bool(unit.sequential)
        # What a rebuild of this unit as a piece holds above what is kept before it: its
        # input, the input's gradient, ``rebuilt`` and ``grads`` (set in _flatten).
        self.hold = 0.0
        self.pre_saved: list[float] = []
        self.pre_rebuilt: list[float] = []
        # What a rebuild holds besides the input and its gradient: everything the subtree
        # saves, and what recomputing it allocates besides (cast weights).
        self.rebuilt = float(unit.recompute_extra_bytes)
        # Parameter gradients that exist when backward reaches this unit.
        self.grads = float(unit.grads_from_bytes)
        self.kid_grads: list[float] = []
        # Segments i..j of the children cost upto_s[j] - pre_s[i]: the children's whole
        # forwards, but the last one's tail is skipped.
        self.pre_s: list[float] = []
        self.pre_f: list[float] = []
        self.upto_s: list[float] = []
        self.upto_f: list[float] = []
        self.run_start: list[int] = []
        self.kid_inp: list[float] = []

    def segment_hold(self, i: int, j: int) -> float:
        """What a rebuild of children ``i..j`` as one segment holds above what is kept
        before it: child ``i``'s input and its gradient, what they all rebuild, and the
        gradients made when backward reaches child ``i``."""
        return (
            2 * self.kid_inp[i] + self.pre_rebuilt[j + 1] - self.pre_rebuilt[i] + self.kid_grads[i]
        )


def _tick(seconds: float) -> float:
    """``seconds`` rounded to a multiple of 2**-40 s (about a picosecond). Sums of such
    numbers (below 2**13 s) are exact in any order, so plans that cost the same tie
    exactly and the tie-breaks decide, not rounding."""
    return round(float(seconds) * 2**40) / 2**40


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
            "input_saved_by_previous_bytes",
            "input_saved_by_both_bytes",
            "recompute_extra_bytes",
            "grads_from_bytes",
            "tail_seconds",
            "tail_flops",
            "piece_seconds",
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
        node.rebuilt += node.saved
        node.hold = 2 * node.inp + node.rebuilt + node.grads
        if node.seq and len(node.children) >= 2:
            kids = [nodes[c] for c in node.children]
            node.pre_saved = _prefix(k.saved for k in kids)
            node.pre_rebuilt = _prefix(k.rebuilt for k in kids)
            node.kid_grads = [k.grads for k in kids]
            node.pre_s = _prefix(k.whole_s for k in kids)
            node.pre_f = _prefix(k.whole_f for k in kids)
            node.upto_s = [node.pre_s[j] + k.fwd_s for j, k in enumerate(kids)]
            node.upto_f = [node.pre_f[j] + k.fwd_f for j, k in enumerate(kids)]
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
    nodes: list[_Node],
    decision: list[str],
    segs: Mapping[int, list[tuple[int, int]]],
    shared_inputs: bool = False,
    rebuilds: list[tuple[tuple[int, tuple[int, int] | None], float]] | None = None,
) -> tuple[float, float, float, float]:
    """(kept, highest rebuild, seconds, flops) of a plan given per node index.

    Walks the tree in forward order with the bytes kept so far: backward rebuilds a piece
    when everything after it has been freed and everything before it is still kept.
    ``rebuilds``, when given, receives each piece's ``((unit, segment or None), rebuild)``
    in forward order.
    """
    # untouched[u]: u and everything below it keep, and u is no segment's member.
    untouched = [True] * len(nodes)
    if shared_inputs:
        members = {
            nodes[u].children[p] for u, r in segs.items() for i, j in r for p in range(i, j + 1)
        }
        for node in reversed(nodes):
            u = node.idx
            untouched[u] = (
                decision[u] == "keep"
                and u not in members
                and not segs.get(u)
                and all(untouched[c] for c in node.children)
            )

    def visit(u: int, k: float, credit: float) -> tuple[float, float, float, float, bool]:
        """(kept after u, highest rebuild, seconds, flops, whether u ends with a piece)."""
        node = nodes[u]
        inherited = credit
        d = decision[u]
        if d != "keep":  # a piece of its own: it keeps its input (selective: and matmul outputs)
            high = k - credit + node.hold
            k += node.inp - credit
            if rebuilds is not None:
                rebuilds.append(((u, None), high))
            if d == "selective":
                return k + node.mm, high, node.sel_s, node.sel_f, True
            return k, high, node.fwd_s, node.fwd_f, True
        k += node.own
        high, secs, flops = 0.0, 0.0, 0.0
        ends = dict(segs.get(u, ()))
        kids = node.children
        pos = 0
        after_piece = False  # the sibling before ended a recomputed piece
        while pos < len(kids):
            c = kids[pos]
            # A piece whose input the wholly kept sibling before it saves keeps nothing new;
            # a first child receives its parent's input, and the parent's credit with it.
            if pos == 0:
                credit = min(inherited, nodes[c].inp)
                if shared_inputs:  # or what the kept parent's own ops save of it
                    credit = max(credit, nodes[c].shared)
            elif shared_inputs and untouched[kids[pos - 1]]:
                credit = nodes[c].shared
            else:
                credit = 0.0
            if pos in ends:
                end = ends[pos]
                piece = k - credit + node.segment_hold(pos, end)
                k += nodes[c].inp - credit
                if rebuilds is not None:
                    rebuilds.append(((u, (pos, end)), piece))
                high = max(high, piece)
                secs += node.upto_s[end] - node.pre_s[pos]
                flops += node.upto_f[end] - node.pre_f[pos]
                pos = end + 1
                after_piece = True
                continue
            if after_piece and decision[c] == "keep":
                # The piece before is freed after forward, but its output, which this
                # unit receives and saves, stays: the piece's saved bytes counted it.
                k += nodes[c].held
            k, h, s, f, after_piece = visit(c, k, credit)
            high, secs, flops = max(high, h), secs + s, flops + f
            pos += 1
        return k, high, secs, flops, after_piece

    return visit(0, 0.0, 0.0)[:4]


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
        if d == "selective" and not node.sel_ok:
            raise PlanError(
                f"unit {node.name!r} cannot be selective: it is marked can_select=False (a "
                "matmul output made in it is changed in place); use 'recompute'"
            )
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
    loss_bytes: float = 0.0,
    shared_inputs: bool = False,
) -> Evaluation:
    """Predict memory and recompute cost of given decisions under the cost model.

    Units missing from ``decisions`` keep. Decisions below a recomputed unit, or on a
    segment's members, are ignored: nothing is nested inside a recomputed piece.
    ``loss_bytes`` is held at the end of forward only (the model's output and what the
    loss saves). With ``shared_inputs``, a recomputed piece whose input the wholly kept
    sibling before it already saves keeps no second copy (the solvers plan without this
    credit, a bound; predictions use it).

    >>> from memfit.checkpoint.costs import UnitCost
    >>> block = UnitCost("b", own_saved_bytes=100.0, input_bytes=10.0, fwd_seconds=0.5)
    >>> evaluate(UnitCost("", children=[block]), {"b": "recompute"}).peak_bytes
    120.0
    """
    nodes = _flatten(root)
    decision, segs = _check_plan(nodes, decisions, segments or {})
    k, high, s, f = _evaluate_nodes(nodes, decision, segs, shared_inputs)
    peak = max(k + loss_bytes, high)
    return Evaluation(k, peak - k, static_bytes + peak, s, f, high)


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
    loss_bytes: float = 0.0,
    *,
    reserve: float = 0.0,
    frontier: bool = True,
) -> Solution:
    """Choose which units to recompute.

    ``budget_bytes`` is the peak of a whole training step; ``static_bytes`` is the part of
    it checkpointing cannot change; ``loss_bytes`` is held at the end of forward only (the
    model's output and what the loss saves, freed before backward reaches the model). With
    ``budget_bytes=None`` the optimal solver has nothing to fit and returns the plan without
    recompute, and the other strategies apply their plan to every block.

    ``reserve``: the share of the budget kept free (for allocator slack); plans fit
    ``budget_bytes * (1 - reserve)``, and errors say what budget would fit with it.
    ``frontier=False`` skips the (peak, time) frontier that the optimal solution shows,
    most of the solve's time on trees of hundreds of units; the frontier then holds the
    chosen plan alone.

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
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    budget = None if budget_bytes is None else float(budget_bytes) * (1 - reserve)
    static, loss = float(static_bytes), float(loss_bytes)
    nodes = _flatten(root)
    none_peak = static + nodes[0].saved + loss

    if budget is not None and budget >= none_peak:
        plan = _Plan(["keep"] * len(nodes), {})
        sol = _solution(nodes, plan, label, budget, static, loss, [plan])
        sol.note = (
            f"budget {_budget_words(budget, reserve)} is at or above the no-checkpoint peak "
            f"{_format_bytes(none_peak)}: nothing is recomputed"
        )
        return sol

    if name == "optimal":
        return _solve_optimal(nodes, label, budget, static, loss, reserve, frontier)
    if name == "none":
        plans = [_Plan(["keep"] * len(nodes), {})]
    else:
        chains = _find_chains(nodes)
        if name == "full":
            plans = [_family_plan(nodes, chains, "full", None, None)]
        else:
            room = None if budget is None else budget - static
            plans = _family(nodes, chains, name, k, room, loss)
    return _pick_family(nodes, plans, label, budget, static, loss, reserve)


# --------------------------------------------------------------------------- simple strategies


@dataclass
class _Plan:
    decision: list[str]
    segs: dict[int, list[tuple[int, int]]]
    value: tuple[float, float, float, float] | None = None  # kept, rebuild, seconds, flops

    def evaluated(self, nodes: list[_Node]) -> tuple[float, float, float, float]:
        if self.value is None:
            self.value = _evaluate_nodes(nodes, self.decision, self.segs)
        return self.value

    def peak(self, nodes: list[_Node], loss: float) -> float:
        """Peak above static: the end of forward or the highest rebuild."""
        kept, high, _, _ = self.evaluated(nodes)
        return max(kept + loss, high)


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
    loss: float,
) -> list[_Plan]:
    """Evaluated plans of a fixed strategy: all blocks when ``room`` (bytes above static)
    is None, else a bisection for the fewest blocks, in forward order, that
    fit in it (the time only grows with the count; the peak mostly falls)."""
    total = sum(len(b) for _, b in chains)
    tried: dict[int, _Plan] = {}

    def at(count: int) -> _Plan:
        if count not in tried:
            plan = _family_plan(nodes, chains, name, k, count)
            plan.evaluated(nodes)
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


def _pick_family(
    nodes: list[_Node],
    plans: list[_Plan],
    label: str,
    budget: float | None,
    static: float,
    loss: float,
    reserve: float,
) -> Solution:
    if budget is None:
        chosen = plans[-1]
    else:
        fits = [p for p in plans if static + p.peak(nodes, loss) <= budget]
        if not fits:
            best = min(plans, key=lambda p: p.peak(nodes, loss))
            smallest = static + best.peak(nodes, loss)
            raise BudgetError(
                f"strategy {label!r} cannot fit the budget {_budget_words(budget, reserve)}: "
                f"its smallest peak is {_format_bytes(smallest)} ({smallest:.0f} bytes; "
                f"{_breakdown(nodes, best, static, loss)}). Use strategy 'optimal', which finds "
                f"the smallest peak any plan reaches, or a budget of at least "
                f"{_at_least(smallest / (1 - reserve))}"
            )
        chosen = min(
            fits, key=lambda p: (p.evaluated(nodes)[2], p.evaluated(nodes)[3], p.peak(nodes, loss))
        )
    return _solution(nodes, chosen, label, budget, static, loss, plans)


def _breakdown(nodes: list[_Node], plan: _Plan, static: float, loss: float) -> str:
    kept, high, _, _ = plan.evaluated(nodes)
    if high > kept + loss:
        where = f"the highest rebuild in backward {_format_bytes(high - kept)} above the kept"
    else:
        where = f"the loss {_format_bytes(loss)} at the end of forward"
    return f"static {_format_bytes(static)}, kept activations {_format_bytes(kept)}, then {where}"


def _solution(
    nodes: list[_Node],
    plan: _Plan,
    label: str,
    budget: float | None,
    static: float,
    loss: float,
    family: list[_Plan],
    *,
    exact: bool = True,
) -> Solution:
    kept, _, secs, flops = plan.evaluated(nodes)
    peak = plan.peak(nodes, loss)
    points = [(static + p.peak(nodes, loss),) + p.evaluated(nodes)[2:] for p in family]
    return Solution(
        decisions={n.name: plan.decision[n.idx] for n in nodes},
        segments={nodes[u].name: sorted(r) for u, r in sorted(plan.segs.items())},
        strategy=label,
        budget_bytes=budget,
        static_bytes=static,
        kept_bytes=kept,
        transient_bytes=peak - kept,
        predicted_peak_bytes=static + peak,
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


# --------------------------------------------------------------------------- optimal
#
# The programme walks the tree in forward order. Its state is a frontier: the plans of
# everything walked so far that are Pareto-optimal in (bytes kept so far, recompute time),
# each a point (kept, seconds, flops, highest rebuild, ref). ``ref`` is a linked list of
# the choices made, for reconstruction: None, or (ref, code, unit, start, end) with code 0
# recompute, 1 selective, 2 segment. A cap on the peak above static turns every rebuild
# into a constraint on the bytes kept before it, which the walk checks as it goes; so one
# pass finds the cheapest plan under one cap, exactly.

_RECOMPUTE, _SELECTIVE, _SEGMENT = 0, 1, 2
_BY_TIME = itemgetter(0, 1, 2, 3)
_BY_HIGH = itemgetter(0, 3, 1, 2)
_START: list = [(0.0, 0.0, 0.0, 0.0, None)]


def _least_kept(nodes: list[_Node]) -> tuple[list[float], list[float]]:
    """Lower bounds on the bytes each unit keeps under any plan, and when it keeps."""
    low = [0.0] * len(nodes)
    keep_low = [0.0] * len(nodes)
    for node in reversed(nodes):
        seq = node.seq and len(node.children) >= 2
        # In a chain, a recomputable child may sit inside a segment and keep nothing.
        inner = sum(0.0 if seq and nodes[c].can_rec else low[c] for c in node.children)
        keep_low[node.idx] = low[node.idx] = node.own + inner
        if node.can_rec:
            low[node.idx] = min(low[node.idx], node.inp)
    return low, keep_low


class _Pass:
    """One walk of the tree under a cap on the peak above static.

    ``least_peak=False``: frontiers in (kept, time), every rebuild within ``cap``; the
    cheapest final point is the cheapest plan whose peak is within ``cap``.
    ``least_peak=True``: frontiers in (kept, highest rebuild), for the smallest peak any
    plan reaches (``cap`` then only bounds the search).

    Points that cannot lead to a plan are dropped as the walk goes: those whose kept bytes,
    plus the least that the rest of the walk must keep, pass the cap, and those slower than
    ``seconds`` (the time of a plan already known to fit).
    """

    def __init__(
        self,
        nodes: list[_Node],
        bounds: tuple[list[float], list[float]],
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
        self.work = _EXACT_WORK
        self.thin = thin

    def run(self) -> list:
        ended, kept = self.visit(0, _START, 0.0)
        if ended and kept:
            return self.prune(ended + kept)
        return ended or kept

    # -- frontiers

    def prune(self, points: list) -> list:
        """Sort by kept bytes and drop dominated points (thin them past the work limit)."""
        self.work -= len(points)
        out: list = []
        append = out.append
        if self.least_peak:
            points.sort(key=_BY_HIGH)
            best = math.inf
            for p in points:
                if p[3] < best:
                    append(p)
                    best = p[3]
        else:
            points.sort(key=_BY_TIME)
            best_s = best_f = math.inf
            for p in points:
                if p[1] < best_s or (p[1] == best_s and p[2] < best_f):
                    append(p)
                    best_s, best_f = p[1], p[2]
        if self.thin:
            return self.thinned(out, _THIN_POINTS)
        if self.work < 0:
            raise _TooLarge
        return out

    @staticmethod
    def thinned(points: list, count: int) -> list:
        # Split the kept range into ``count`` equal slices and keep the fastest point of
        # each (the last), and the least-kept point of all: every kept plan is real, only
        # some in-between trade-offs are lost.
        if len(points) <= count:
            return points
        low, high = points[0][0], points[-1][0]
        width = (high - low) / count or 1.0
        out = [points[0]]
        for p, q in zip(points[1:], points[2:], strict=False):
            if (q[0] - low) // width != (p[0] - low) // width:
                out.append(p)
        out.append(points[-1])
        return out

    def rebuilt(
        self,
        frontier: list,
        add: float,
        rebuild: float,
        secs: float,
        flops: float,
        limit: float,
        how: tuple,
    ) -> list:
        """The frontier after a recomputed piece that keeps ``add`` bytes and, when rebuilt,
        holds ``rebuild`` bytes above what was kept before it."""
        out = []
        append = out.append
        top = min(self.cap - rebuild, limit - add)
        if self.least_peak:
            for k, s, f, h, ref in frontier:  # by increasing k: stop at the first that fails
                if k > top:
                    break
                high = k + rebuild
                append((k + add, s + secs, f + flops, h if h > high else high, (ref, *how)))
            return out
        # By time, the cap is checked as the walk goes; the highest rebuild is carried to
        # break ties: of two plans as fast with as much kept, the one whose rebuilds peak
        # lower (pieces earlier in the step) sorts first and is the one kept.
        slowest = self.seconds - secs
        for k, s, f, h, ref in frontier:
            if k > top:
                break
            if s <= slowest:
                high = k + rebuild
                append((k + add, s + secs, f + flops, h if h > high else high, (ref, *how)))
        return out

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
        if node.can_rec:
            how = (_RECOMPUTE, u, 0, 0)
            pieces += self.rebuilt(
                frontier, node.inp, node.hold, node.fwd_s, node.fwd_f, limit, how
            )
        if node.can_sel:
            how = (_SELECTIVE, u, 0, 0)
            add = node.inp + node.mm
            pieces += self.rebuilt(frontier, add, node.hold, node.sel_s, node.sel_f, limit, how)
        if len(pieces) > 1 and node.can_sel:
            pieces = self.prune(pieces)
        # Keep: the unit's own saved bytes are counted from its start (a bound: some of its
        # ops may run after a child, whose rebuild would then not see them).
        own = node.own
        top = limit - self.keep_low[u]
        source = frontier if keep_in is None else keep_in
        kept = [(k + own, s, f, h, r) for k, s, f, h, r in source if k <= top]
        if kept and node.children:
            if node.seq and len(node.children) >= 2:
                inner_ended, kept = self.chain(node, kept, after)
            else:
                inner_ended, kept = self.sequence(node, kept, after)
            # A kept unit whose last child ended a piece ends with that piece too.
            if inner_ended:
                pieces = self.prune(pieces + inner_ended) if pieces else inner_ended
        return pieces, kept

    def boundary(self, ended: list, kept: list, nxt: int | None) -> tuple[list, list]:
        """(all, keep_in) before sibling ``nxt``: when a piece ended just before it and
        ``nxt`` is kept, the piece's output that ``nxt`` saves stays held (the piece's saved
        bytes, now freed, had counted it). ``ended``: the points whose last unit ended with
        a piece; ``kept``: the others."""
        merged = self.prune(ended + kept) if ended and kept else (ended or kept)
        shared = self.nodes[nxt].held if nxt is not None else 0.0
        if not shared or not ended:
            return merged, merged
        moved = [(k + shared, s, f, h, r) for k, s, f, h, r in ended]
        return merged, self.prune(moved + kept) if kept else moved

    def sequence(self, node: _Node, frontier: list, after: float) -> tuple[list, list]:
        """Children of a unit that are not a chain memfit iterates: one after another.
        Returns the frontiers after the last child: ended with a piece, and the others."""
        low = self.low
        kids = node.children
        rest = sum(low[c] for c in kids)
        current, keep_in = frontier, frontier
        ended: list = []
        kept: list = frontier
        for pos, c in enumerate(kids):
            rest -= low[c]
            ended, kept = self.visit(c, current, after + rest, keep_in)
            nxt = kids[pos + 1] if pos + 1 < len(kids) else None
            if nxt is not None:
                current, keep_in = self.boundary(ended, kept, nxt)
                if not current:
                    return [], []
        return ended, kept

    def chain(self, node: _Node, frontier: list, after: float) -> list:
        """Children of a sequential unit, each on its own or in segments of two or more."""
        nodes, low = self.nodes, self.low
        kids = node.children
        # What the children after position j must keep at least (recomputable ones may be
        # segment members, which keep nothing).
        rest = [0.0] * (len(kids) + 1)
        for pos in range(len(kids) - 1, -1, -1):
            c = kids[pos]
            rest[pos] = rest[pos + 1] + (0.0 if nodes[c].can_rec else low[c])
        before = [frontier]  # before[i]: the frontier before child i
        # Where segments start from: in approximate passes, thinned further (a long chain
        # tries every start for every end).
        from_ = [self.thinned(frontier, _SEGMENT_POINTS) if self.thin else frontier]
        keep_in = frontier  # the same, for child i's keep option
        live: list[int] = []  # segment starts that can still be extended
        for j, c in enumerate(kids):
            if before[j]:
                ended, kept = self.visit(c, before[j], after + rest[j + 1], keep_in)
            else:
                ended, kept = [], []
            if nodes[c].can_rec:
                limit = self.limit - after - rest[j + 1]
                still = []
                if self.thin:  # only starts at geometric distances (see _EXACT_WORK)
                    starts = [j - d for d in _GEOMETRIC if j - d >= node.run_start[j]]
                else:
                    starts = live
                for i in starts:
                    start = from_[i]
                    inp = node.kid_inp[i]
                    rebuild = node.segment_hold(i, j)
                    if not start or start[0][0] + rebuild > self.cap:
                        continue  # longer segments from i only save more: it stays dead
                    still.append(i)
                    ended += self.rebuilt(
                        start,
                        inp,
                        rebuild,
                        node.upto_s[j] - node.pre_s[i],
                        node.upto_f[j] - node.pre_f[i],
                        limit,
                        (_SEGMENT, node.idx, i, j),
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
            from_.append(self.thinned(merged, _SEGMENT_POINTS) if self.thin else merged)
        return [], before[-1]


class _TooLarge(Exception):
    """An exact pass outgrew its work limit; the approximate passes take over."""


# Distances from a segment's end to its start that approximate passes try.
_GEOMETRIC = sorted({1, 2, 3} | {1 << e for e in range(2, 20)} | {3 << e for e in range(1, 19)})


def _rebuild_plan(nodes: list[_Node], ref: object) -> _Plan:
    decision = ["keep"] * len(nodes)
    segs: dict[int, list[tuple[int, int]]] = {}
    while ref is not None:
        ref, code, u, i, j = ref  # type: ignore[misc]
        if code == _SEGMENT:
            segs.setdefault(u, []).append((i, j))
        else:
            decision[u] = "recompute" if code == _RECOMPUTE else "selective"
    for ranges in segs.values():
        ranges.sort()
    return _Plan(decision, segs)


class _Search:
    """The passes of one optimal solve: exact until one outgrows its work limit, then
    approximate (``exact`` becomes False)."""

    def __init__(self, nodes: list[_Node], loss: float) -> None:
        self.nodes = nodes
        self.loss = loss
        self.bounds = _least_kept(nodes)
        self.exact = True
        self.none = _Plan(["keep"] * len(nodes), {})
        self.none_peak = self.none.peak(nodes, loss)
        self.last_work = 0  # frontier points the last walk visited

    def walk(self, cap: float, least_peak: bool, seconds: float = math.inf) -> list:
        while True:
            walk = _Pass(
                self.nodes, self.bounds, cap, self.loss, least_peak, seconds, not self.exact
            )
            try:
                final = walk.run()
            except _TooLarge:
                self.exact = False
                continue
            self.last_work = _EXACT_WORK - walk.work
            return final

    def cheapest(self, cap: float, seed: _Plan | None = None) -> _Plan | None:
        """The cheapest plan whose peak above static is within ``cap``, or None.
        ``seed``, a plan known to fit, bounds the search."""
        nodes, loss = self.nodes, self.loss
        if cap >= self.none_peak:
            return self.none  # recomputes nothing: nothing is cheaper
        seconds = math.inf
        if seed is not None and seed.peak(nodes, loss) <= cap:
            seconds = seed.evaluated(nodes)[2]
        final = self.walk(cap, False, seconds)
        if not final:
            # An approximate pass can lose every plan as fast as the seed; the seed fits.
            return seed if seconds < math.inf else None
        # Pruned by time: the last point is the cheapest; among equal times the least kept.
        return _rebuild_plan(nodes, final[-1][4])

    def least_peak(self, bound: float) -> tuple[float, _Plan | None]:
        """The smallest peak above static any plan reaches (searched within ``bound``), and
        a plan that reaches it (not always the cheapest one)."""
        final = self.walk(bound, True)
        if not final:
            return bound, None
        best = min(final, key=lambda p: (max(p[0] + self.loss, p[3]), p[1]))
        return max(best[0] + self.loss, best[3]), _rebuild_plan(self.nodes, best[4])


def _seed(nodes: list[_Node], chains: list, cap: float, loss: float) -> _Plan | None:
    """The cheapest fixed-strategy plan within ``cap`` above static, or None."""
    fits = [
        plan
        for name, k in _SEEDS
        for plan in _family(nodes, chains, name, k, cap, loss)
        if plan.peak(nodes, loss) <= cap
    ]
    return min(fits, key=lambda p: p.evaluated(nodes)[2], default=None)


_SEEDS = (("full", None), ("sqrt", None), ("uniform", 2), ("uniform", 4), ("uniform", 8))


def _solve_optimal(
    nodes: list[_Node],
    label: str,
    budget: float | None,
    static: float,
    loss: float,
    reserve: float,
    frontier: bool,
) -> Solution:
    search = _Search(nodes, loss)
    chains = _find_chains(nodes)

    def bound() -> float:
        # A bound for the least-peak search: the smallest peak of the fixed strategies.
        return min(
            search.none_peak,
            _family_plan(nodes, chains, "full", None, None).peak(nodes, loss),
            _family_plan(nodes, chains, "sqrt", None, None).peak(nodes, loss),
        )

    if budget is None:
        chosen = search.none
    else:
        room = budget - static
        found = search.cheapest(room, _seed(nodes, chains, room, loss))
        least = None
        if found is None:
            least = search.least_peak(bound())[0]
            if least <= room:  # an approximate walk lost the plans that fit; take the least
                found = search.cheapest(least)
        if found is None:
            smallest = search.cheapest(least) or search.none
            raise BudgetError(_too_small(nodes, budget, smallest, static, loss, reserve))
        chosen = found
        if not search.exact:
            chosen = _polish(nodes, found, room, loss)
            # Two more plans, the faster kept: a walk under the polished plan's time (the
            # slower points dropped first, the thinned frontiers are finer where the cheaper
            # plans lie), when the first walk was short enough to afford twice; and one made
            # block by block, which the thinned walks do worse at loose budgets.
            again = search.cheapest(room, chosen) if search.last_work < _REFINE_WORK else None
            for other in (again, _by_blocks(nodes, room, loss, search.bounds)):
                if other is not None and other is not chosen:
                    other = _polish(nodes, other, room, loss)
                    if other.evaluated(nodes)[2] < chosen.evaluated(nodes)[2]:
                        chosen = other
    exact = search.exact
    family = _frontier_plans(search, chains, bound()) if frontier else []
    sol = _solution(nodes, chosen, label, budget, static, loss, [*family, chosen], exact=exact)
    if budget is None:
        sol.note = "no budget given: the cheapest plan is chosen, and it recomputes nothing"
    return sol


def _polish(nodes: list[_Node], plan: _Plan, cap: float, loss: float) -> _Plan:
    """An approximate plan, with every recomputed piece that the budget can afford to keep
    kept instead, the slowest first (each one tried once; a kept piece's units keep).

    Keeping a piece adds what it saves, less its input, to everything kept after it, so
    every later rebuild and the end of forward grow by that much (less the boundary
    tensors the piece's end no longer holds): a piece that cannot fit by that count is
    passed over without evaluating the plan again."""
    pieces = [(nodes[u].fwd_s, u, None) for u, d in enumerate(plan.decision) if d != "keep"]
    for u, ranges in plan.segs.items():
        node = nodes[u]
        pieces += [(node.upto_s[j] - node.pre_s[i], u, (i, j)) for i, j in ranges]
    depth = [0] * len(nodes)
    for node in nodes:
        for c in node.children:
            depth[c] = depth[node.idx] + 1
    # What a piece's end can hold across boundaries, at most: one tensor per level.
    slack = max((n.held for n in nodes), default=0.0) * (max(depth) + 1)
    order: dict = {}
    after: list[float] = []

    def survey() -> float:
        # Each piece's place in forward order, and the highest rebuild after it.
        rebuilds: list = []
        plan.value = _evaluate_nodes(nodes, plan.decision, plan.segs, rebuilds=rebuilds)
        order.clear()
        after[:] = [0.0] * (len(rebuilds) + 1)
        for pos in range(len(rebuilds) - 1, -1, -1):
            order[rebuilds[pos][0]] = pos
            after[pos] = max(after[pos + 1], rebuilds[pos][1])
        return plan.value[0]

    kept = survey()
    for _, u, rng in sorted(pieces, key=lambda p: -p[0]):
        node = nodes[u]
        if rng is None:
            grows = node.saved - node.inp - (node.mm if plan.decision[u] == "selective" else 0.0)
        else:
            i, j = rng
            grows = node.pre_saved[j + 1] - node.pre_saved[i] - node.kid_inp[i]
        grows -= slack
        if max(after[order[(u, rng)] + 1], kept + loss) + grows > cap:
            continue
        decision = list(plan.decision)
        segs = {k: list(v) for k, v in plan.segs.items()}
        if rng is None:
            decision[u] = "keep"
        else:
            segs[u].remove(rng)
            if not segs[u]:
                del segs[u]
        trial = _Plan(decision, segs)
        if trial.peak(nodes, loss) <= cap:
            plan = trial
            kept = survey()
    return plan


def _by_blocks(nodes: list[_Node], cap: float, loss: float, bounds: tuple) -> _Plan | None:
    """A plan made block by block, for the unit with the most children (the model's block
    list; everything else keeps): each block planned exactly on its own, its options the
    lower convex hull of (kept, time), each with its highest rebuild; then, from every
    block's least-kept option, the upgrade that saves the most time per byte kept, while
    its rebuild, the rebuilds after it and the end of forward still fit (a multiple-choice
    knapsack, greedily). Segments across blocks are not tried. None when it finds no plan
    that fits."""
    spine = max(nodes, key=lambda n: (len(n.children), -n.idx))
    blocks = spine.children
    if len(blocks) < 2:
        return None
    # Everything outside the spine keeps: what the units before it (in forward order,
    # its ancestors included) and the spine itself save, and what the units after it save.
    size = [1] * len(nodes)
    for node in reversed(nodes):
        size[node.idx] += sum(size[c] for c in node.children)
    base = sum(n.own for n in nodes[: spine.idx + 1])
    after = sum(n.own for n in nodes[spine.idx + size[spine.idx] :])
    menus: list[list] = []
    for b in blocks:
        walk = _Pass(nodes, bounds, cap, loss, least_peak=False)
        walk.work = _BLOCK_WORK  # each block is walked exactly, or not at all
        try:
            pieces, kept = walk.visit(b, [(0.0, 0.0, 0.0, 0.0, None)], 0.0)
        except _TooLarge:
            return None
        points = sorted(pieces + kept, key=lambda p: (p[0], p[1]))
        # The lower convex hull of (kept, time): the options a greedy upgrade walks.
        hull: list = []
        for p in points:
            if hull and p[1] >= hull[-1][1]:
                continue
            while len(hull) >= 2:
                (k1, s1), (k2, s2) = hull[-2][:2], hull[-1][:2]
                if (s2 - s1) * (p[0] - k1) >= (p[1] - s1) * (k2 - k1):
                    hull.pop()
                else:
                    break
            hull.append(p)
        if not hull:
            return None
        menus.append(hull)
    choice = [0] * len(blocks)

    def state() -> tuple[list[float], list[float], float]:
        before, peaks, k = [], [], base
        for m, i in zip(menus, choice, strict=True):
            before.append(k)
            peaks.append(k + m[i][3])
            k += m[i][0]
        return before, peaks, k + after

    before, peaks, end = state()
    if max(peaks, default=0.0) > cap or end + loss > cap:
        return None
    heap = []
    for b, m in enumerate(menus):
        if len(m) > 1:
            heapq.heappush(heap, (-(m[0][1] - m[1][1]) / max(m[1][0] - m[0][0], 1e-9), b))
    while heap:
        _, b = heapq.heappop(heap)
        m, i = menus[b], choice[b]
        grow = m[i + 1][0] - m[i][0]
        later = max(peaks[b + 1 :], default=0.0)
        if before[b] + m[i + 1][3] <= cap and later + grow <= cap and end + grow + loss <= cap:
            choice[b] = i + 1
            before, peaks, end = state()
            if i + 2 < len(m):
                ratio = (m[i + 1][1] - m[i + 2][1]) / max(m[i + 2][0] - m[i + 1][0], 1e-9)
                heapq.heappush(heap, (-ratio, b))
    decision = ["keep"] * len(nodes)
    segs: dict[int, list[tuple[int, int]]] = {}
    for m, i in zip(menus, choice, strict=True):
        part = _rebuild_plan(nodes, m[i][4])
        for v, d in enumerate(part.decision):
            if d != "keep":
                decision[v] = d
        for v, r in part.segs.items():
            segs.setdefault(v, []).extend(r)
    plan = _Plan(decision, segs)
    return plan if plan.peak(nodes, loss) <= cap else None


def _frontier_plans(search: _Search, chains: list, bound: float) -> list[_Plan]:
    """Plans on the (peak, time) frontier: walked point by point from the no-checkpoint
    end (each pass finds the cheapest plan below the last one's peak), then sampled at
    evenly spread caps down to the least peak when the walk is long."""
    nodes, loss = search.nodes, search.loss
    plans: list[_Plan] = []
    cap = search.none_peak
    # Small trees get their whole frontier, point by point.
    steps = _STAIRCASE if len(nodes) > _SMALL_TREE else math.inf
    while steps > 0 and search.exact:
        steps -= 1
        found = search.cheapest(cap, _seed(nodes, chains, cap, loss))
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
    count = _SAMPLED
    for q in range(count + 1):
        at = least + (cap - least) * q / count
        found = search.cheapest(at, _seed(nodes, chains, at, loss))
        if found is not None:
            plans.append(found)
    return plans


def _at_least(n: float) -> str:
    """``n`` bytes written as a budget that fits: rounded up, and exactly in bytes."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    shown = f"{math.ceil(value)} B" if unit == "B" else f"{math.ceil(value * 100) / 100:.2f} {unit}"
    return f"{shown} ({math.ceil(n)} bytes)"


def _budget_words(planned: float, reserve: float) -> str:
    """The caller's budget, and what of it is planned when part is kept free."""
    if not reserve:
        return _format_bytes(planned)
    return (
        f"{_format_bytes(planned / (1 - reserve))} ({_format_bytes(planned)} of it planned, "
        f"{reserve:.0%} kept free for allocator slack)"
    )


def _too_small(
    nodes: list[_Node], budget: float, plan: _Plan, static: float, loss: float, reserve: float
) -> str:
    smallest = static + plan.peak(nodes, loss)
    needed = _at_least(smallest / (1 - reserve))
    head = (
        f"budget {_budget_words(budget, reserve)} is below the smallest peak any checkpoint plan "
        f"reaches, {_format_bytes(smallest)} ({smallest:.0f} bytes): "
        f"{_breakdown(nodes, plan, static, loss)}. "
    )
    if static >= budget:
        return head + (
            f"Static memory alone ({_format_bytes(static)}: parameters, gradients, optimizer "
            "state) exceeds the budget and checkpointing cannot lower it; shrink it (lower "
            "precision master weights, a sharded or smaller optimizer state, a smaller model) "
            f"or raise the budget to at least {needed}"
        )
    if static >= smallest - static:
        return head + (
            "Static memory dominates and checkpointing cannot lower it; shrink it or raise "
            f"the budget to at least {needed}"
        )
    return head + (
        "Activations dominate even with everything possible recomputed; use a smaller "
        f"micro-batch or sequence, or raise the budget to at least {needed}"
    )
