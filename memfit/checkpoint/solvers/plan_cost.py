"""A plan's cost under the cost model: what it keeps, its highest rebuild, its recompute."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from memfit.checkpoint.costs import DECISIONS, KEEP, SELECTIVE, Decision, UnitCost
from memfit.checkpoint.solvers.nodes import FlatUnit, flatten
from memfit.errors import PlanError

Segments = dict[int, list[tuple[int, int]]]
"""Per sequential unit's index, the inclusive child ranges checkpointed as one piece."""

PlanKey = tuple[tuple[Decision, ...], tuple[tuple[int, tuple[tuple[int, int], ...]], ...]]
"""A plan's decisions and segments as a dictionary key (see :meth:`NodePlan.key`)."""


@dataclass(frozen=True)
class Evaluation:
    """The cost model's verdict on one set of decisions (see :func:`plan_cost`)."""

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


class PlanCost(NamedTuple):
    """What a plan given per unit index costs (static bytes left out)."""

    kept_bytes: float
    """Activation bytes held at the end of forward."""
    rebuild_bytes: float
    """The highest rebuild in backward, what is kept before it included."""
    seconds: float
    flops: float

    def peak(self, loss: float) -> float:
        """Peak above static: the end of forward, with the loss, or the highest rebuild."""
        return max(self.kept_bytes + loss, self.rebuild_bytes)


@dataclass
class NodePlan:
    """A plan given per unit index, its cost evaluated once."""

    decision: list[Decision]
    segs: Segments
    cost: PlanCost | None = None

    def evaluated(self, nodes: list[FlatUnit]) -> PlanCost:
        if self.cost is None:
            self.cost = evaluate_nodes(nodes, self.decision, self.segs)
        return self.cost

    def peak(self, nodes: list[FlatUnit], loss: float) -> float:
        """Peak above static: the end of forward or the highest rebuild."""
        return self.evaluated(nodes).peak(loss)

    def key(self) -> PlanKey:
        """The decisions and segments, hashable: equal for plans that decide alike."""
        return tuple(self.decision), tuple((u, tuple(r)) for u, r in self.segs.items())

    @classmethod
    def keep_all(cls, nodes: list[FlatUnit]) -> NodePlan:
        """The plan that recomputes nothing."""
        return cls([KEEP] * len(nodes), {})


def evaluate_nodes(
    nodes: list[FlatUnit],
    decision: list[Decision],
    segs: Mapping[int, list[tuple[int, int]]],
    shared_inputs: bool = False,
    rebuilds: list[tuple[tuple[int, tuple[int, int] | None], float]] | None = None,
    input_storages: Sequence[tuple[tuple[int, float], ...]] | None = None,
    kept_inputs: dict[int, float] | None = None,
) -> PlanCost:
    """The cost of a plan given per node index.

    Walks the tree in forward order with the bytes kept so far: backward rebuilds a piece
    when everything after it has been freed and everything before it is still kept.
    ``rebuilds``, when given, receives each piece's ``((unit, segment or None), rebuild)``
    in forward order. ``input_storages`` (with ``shared_inputs``), per node index, the
    memory blocks behind each unit's inputs (:attr:`UnitCost.input_storages`): a piece
    keeps no second copy of a block an earlier piece keeps as its input (held until
    backward rebuilds that earlier piece, after this one). ``kept_inputs``, when given
    with them, receives those blocks' bytes by id, of every piece.
    """
    # The blocks earlier pieces keep as their inputs, by id: held through this piece.
    held_inputs: dict[int, float] = {}

    def held_before(u: int, credit: float) -> float:
        """``credit`` raised to the bytes of piece ``u``'s input that earlier pieces keep
        already; ``u``'s input blocks are kept from here on."""
        own = input_storages[u] if input_storages is not None else ()
        if not own:
            return credit
        again = sum(n for key, n in own if key in held_inputs)
        held_inputs.update(own)
        return max(credit, min(again, nodes[u].input_bytes))

    def leaf_hold(node: FlatUnit, after_piece: bool) -> float:
        """A kept leaf's moment above what is kept through it (``after_piece``: right after
        a recomputed piece). Its forward moment was measured on the unplanned step with
        inputs alive that nothing saved there; those an earlier piece keeps as its input
        are counted with what is kept, so the forward moment leaves them out."""
        hold = node.after_piece_hold_bytes if after_piece else node.kept_hold_bytes
        kept = sum(n for key, n in node.forward_unsaved_inputs if key in held_inputs)
        if not kept or not node.forward_hold_bytes:
            return hold
        forward = node.after_piece_forward_bytes if after_piece else node.forward_hold_bytes
        return max(node.backward_hold_bytes, forward - kept)

    # untouched[u]: u and everything below it keep, and u is no segment's member.
    untouched = [True] * len(nodes)
    if shared_inputs:
        members = {
            nodes[u].children[p] for u, r in segs.items() for i, j in r for p in range(i, j + 1)
        }
        for node in reversed(nodes):
            u = node.index
            untouched[u] = (
                decision[u] == KEEP
                and u not in members
                and not segs.get(u)
                and all(untouched[c] for c in node.children)
            )

    def visit(u: int, k: float, credit: float) -> tuple[float, float, float, float, bool]:
        """(kept after u, highest rebuild, seconds, flops, whether u ends with a piece)."""
        node = nodes[u]
        inherited = credit
        d = decision[u]
        if d != KEEP:  # a piece of its own: it keeps its input (selective: and matmul outputs)
            credit = held_before(u, credit)
            high = k - credit + node.rebuild_hold_bytes
            k += node.input_bytes - credit
            if rebuilds is not None:
                rebuilds.append(((u, None), high))
            if d == SELECTIVE:
                return (
                    k + node.matmul_saved_bytes,
                    high,
                    node.selective_seconds,
                    node.selective_flops,
                    True,
                )
            return k, high, node.rebuild_seconds, node.rebuild_flops, True
        # Its own saved bytes from its start, but for those saved after its last child:
        # backward frees them before it reaches any child (added after the children).
        k += node.own_saved_bytes - node.own_saved_after_children_bytes
        high, secs, flops = 0.0, 0.0, 0.0
        kids = node.children
        if not kids:  # a leaf (most units): no segments, no children to walk
            k += node.own_saved_after_children_bytes
            # A kept unit without children runs backward while all it and the units before
            # it keep are held (those after it are freed by then), with what that backward
            # makes; and its forward ran with those held, and what it made (the larger).
            if node.kept_hold_bytes:
                high = max(high, k + leaf_hold(node, False))
            return k, high, secs, flops, False
        ranges = segs.get(u)
        ends = dict(ranges) if ranges else {}
        pos = 0
        after_piece = False  # the sibling before ended a recomputed piece
        while pos < len(kids):
            c = kids[pos]
            child = nodes[c]
            if not child.children and decision[c] == KEEP and pos not in ends:
                # A kept leaf, the most common unit, without a call: what visit() does for
                # it (it has nothing saved after children, and recomputes nothing: adding
                # those zeros would change no sum).
                hold = child.kept_hold_bytes
                if held_inputs and child.forward_unsaved_inputs and hold:
                    hold = leaf_hold(child, after_piece)
                elif after_piece:
                    hold = child.after_piece_hold_bytes
                if after_piece:  # see below; its forward holds its input besides
                    k += child.input_saved_by_both_bytes
                    after_piece = False
                k += child.own_saved_bytes
                if hold:
                    high = max(high, k + hold)
                pos += 1
                continue
            # A piece whose input the wholly kept sibling before it saves keeps nothing new;
            # a first child receives its parent's input, and the parent's credit with it.
            if pos == 0:
                credit = min(inherited, child.input_bytes)
                if shared_inputs:  # or what the kept parent's own ops save of it
                    credit = max(credit, child.input_saved_by_previous_bytes)
            elif shared_inputs and untouched[kids[pos - 1]]:
                credit = child.input_saved_by_previous_bytes
            else:
                credit = 0.0
            if pos in ends:
                end = ends[pos]
                credit = held_before(c, credit)
                piece = k - credit + node.segment_hold_bytes(pos, end)
                k += child.input_bytes - credit
                if rebuilds is not None:
                    rebuilds.append(((u, (pos, end)), piece))
                high = max(high, piece)
                secs += node.segment_seconds(pos, end)
                flops += node.segment_flops(pos, end)
                pos = end + 1
                after_piece = True
                continue
            if after_piece and decision[c] == KEEP:
                # The piece before is freed after forward, but its output, which this
                # unit receives and saves, stays: the piece's saved bytes counted it.
                k += child.input_saved_by_both_bytes
            k, h, s, f, after_piece = visit(c, k, credit)
            high, secs, flops = max(high, h), secs + s, flops + f
            pos += 1
        k += node.own_saved_after_children_bytes
        return k, high, secs, flops, after_piece

    cost = PlanCost(*visit(0, 0.0, 0.0)[:4])
    if kept_inputs is not None:
        kept_inputs.update(held_inputs)
    return cost


def check_plan(
    nodes: list[FlatUnit],
    decisions: Mapping[str, str],
    segments: Mapping[str, list[tuple[int, int]]],
) -> tuple[list[Decision], Segments]:
    """A plan given by unit names, checked against the tree, per unit index."""
    by_name = {n.name: n for n in nodes}
    for name in decisions:
        if name not in by_name:
            raise PlanError(f"the plan names unit {name!r}, which is not in the cost tree")
    for name in segments:
        if name not in by_name:
            raise PlanError(f"the plan has segments for {name!r}, which is not in the cost tree")
    decision: list[Decision] = [KEEP] * len(nodes)
    for node in nodes:
        d = decisions.get(node.name, KEEP)
        if d not in DECISIONS:
            raise PlanError(
                f"unit {node.name!r}: decision {d!r} is not 'keep', 'recompute' or 'selective'"
            )
        if d != KEEP and not node.can_recompute:
            what = "the root" if node.index == 0 else "a unit marked can_recompute=False"
            raise PlanError(f"unit {node.name!r} cannot be recomputed: it is {what}")
        if d == SELECTIVE and not node.can_select:
            raise PlanError(
                f"unit {node.name!r} cannot be selective: it is marked can_select=False (a "
                "matmul output made in it is changed in place); use 'recompute'"
            )
        decision[node.index] = d  # type: ignore[assignment]
    segs: Segments = {}
    for name, ranges in segments.items():
        node = by_name[name]
        if not node.sequential:
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
            segs[node.index] = [(int(i), int(j)) for i, j in ranges]
    return decision, segs


def plan_cost(
    root: UnitCost,
    decisions: Mapping[str, str],
    segments: Mapping[str, list[tuple[int, int]]] | None = None,
    static_bytes: float = 0.0,
    loss_bytes: float | Callable[[Mapping[int, float]], float] = 0.0,
    shared_inputs: bool = False,
) -> Evaluation:
    """Predict memory and recompute cost of given decisions under the cost model.

    Units missing from ``decisions`` keep. Decisions below a recomputed unit, or on a
    segment's members, are ignored: nothing is nested inside a recomputed piece.
    ``loss_bytes`` is held at the end of forward only (the model's output and what the
    loss saves); a function is given the memory blocks the plan's checkpoints keep as
    their inputs (bytes by id, :attr:`UnitCost.input_storages`; with ``shared_inputs``)
    and returns it (what the loss holds of those is kept already). With
    ``shared_inputs``, a recomputed piece whose input the wholly kept sibling before it
    already saves, or whose input blocks an earlier piece keeps as its own input, keeps no
    second copy of them (the solvers plan without these credits, a bound; predictions use
    them).

    >>> from memfit.checkpoint.costs import UnitCost
    >>> block = UnitCost("b", own_saved_bytes=100.0, input_bytes=10.0, input_storages=((7, 10.0),))
    >>> root = UnitCost("", children=[block])
    >>> plan_cost(root, {"b": "recompute"}).peak_bytes
    120.0
    >>> def loss(kept_inputs):  # 500 bytes, of which the checkpoint's input kept already
    ...     return 500.0 - sum(kept_inputs.values())
    >>> plan_cost(root, {"b": "recompute"}, loss_bytes=loss, shared_inputs=True).peak_bytes
    500.0
    """
    nodes = flatten(root)
    decision, segs = check_plan(nodes, decisions, segments or {})
    storages = None
    if shared_inputs:
        by_name = {u.name: u.input_storages for u in root.walk()}
        storages = [by_name[n.name] for n in nodes]
    kept_inputs: dict[int, float] = {}
    cost = evaluate_nodes(
        nodes, decision, segs, shared_inputs, input_storages=storages, kept_inputs=kept_inputs
    )
    peak = cost.peak(loss_bytes(kept_inputs) if callable(loss_bytes) else loss_bytes)
    kept = cost.kept_bytes
    return Evaluation(
        kept, peak - kept, static_bytes + peak, cost.seconds, cost.flops, cost.rebuild_bytes
    )


def kept_cast_bytes(
    root: UnitCost,
    decisions: Mapping[str, str],
    segments: Mapping[str, list[tuple[int, int]]] | None = None,
) -> float:
    """Bytes of autocast's weight copies that the units a plan keeps save
    (:attr:`UnitCost.saved_cast_bytes`, each unit's own: its subtree's less its
    children's): held at the end of forward as saved tensors, they are the autocast cache's
    copies, not others (see :meth:`memfit.checkpoint.step_memory.StepMemory.loss_beside`).

    >>> from memfit.checkpoint.costs import UnitCost
    >>> block = UnitCost("b", own_saved_bytes=100.0, saved_cast_bytes=40.0)
    >>> root = UnitCost("", children=[block], saved_cast_bytes=40.0)
    >>> kept_cast_bytes(root, {}), kept_cast_bytes(root, {"b": "recompute"})
    (40.0, 0.0)
    """
    nodes = flatten(root)
    decision, segs = check_plan(nodes, decisions, segments or {})
    cast = {u.name: float(u.saved_cast_bytes) for u in root.walk()}
    total = 0.0
    stack = [0]
    while stack:
        u = stack.pop()
        if decision[u] != KEEP:
            continue  # a piece: what it saves is dropped after forward
        node = nodes[u]
        total += max(0.0, cast[node.name] - sum(cast[nodes[c].name] for c in node.children))
        members = {p for i, j in segs.get(u, []) for p in range(i, j + 1)}
        stack.extend(c for p, c in enumerate(node.children) if p not in members)
    return total
