"""The cost tree flattened for the solvers: units in pre-order, with the sums they use."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from operator import attrgetter

from memfit.checkpoint.costs import UnitCost
from memfit.errors import PlanError

# The UnitCost fields a unit must give as finite numbers >= 0.
_NUMBERS = (
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
    "input_saved_bytes",
    "recompute_extra_bytes",
    "grads_from_bytes",
    "backward_hold_bytes",
    "forward_hold_bytes",
    "own_saved_after_children_bytes",
    "forward_workspace_bytes",
    "rebuild_forward_bytes",
    "backward_workspace_bytes",
    "tail_seconds",
    "tail_flops",
    "piece_seconds",
)


Chains = list[tuple[int, list[int]]]
"""(chain unit, positions of its block children), as :func:`find_chains` gives them."""


class FlatUnit:
    """A unit with the numbers the solvers use, indexed in pre-order."""

    __slots__ = (
        "index",
        "name",
        "children",
        "saved_bytes",
        "own_saved_bytes",
        "input_bytes",
        "rebuild_seconds",
        "rebuild_flops",
        "selective_seconds",
        "selective_flops",
        "matmul_saved_bytes",
        "can_recompute",
        "offers_selective",
        "can_select",
        "sequential",
        "rebuild_hold_bytes",
        "forward_seconds",
        "forward_flops",
        "saved_before",
        "rebuilt_before",
        "rebuilt_bytes",
        "grads_from_bytes",
        "child_grads_from_bytes",
        "forward_seconds_before",
        "forward_flops_before",
        "rebuild_seconds_through",
        "rebuild_flops_through",
        "run_start",
        "child_input_bytes",
        "input_saved_by_previous_bytes",
        "input_saved_by_both_bytes",
        "input_saved_bytes",
        "child_input_saved_bytes",
        "backward_hold_bytes",
        "forward_hold_bytes",
        "forward_unsaved_inputs",
        "kept_hold_bytes",
        "after_piece_forward_bytes",
        "after_piece_hold_bytes",
        "child_backward_hold_table",
        "own_saved_after_children_bytes",
        "forward_workspace_bytes",
        "child_forward_workspace_table",
        "rebuild_forward_bytes",
        "child_rebuild_forward_table",
        "backward_workspace_bytes",
        "child_backward_workspace_table",
    )

    def __init__(self, index: int, unit: UnitCost, is_root: bool) -> None:
        self.index = index
        self.name = unit.name
        self.children: list[int] = []  # their indices, in forward order
        self.own_saved_bytes = float(unit.own_saved_bytes)
        # Of those, what it saved after its last child (freed before backward reaches one).
        self.own_saved_after_children_bytes = (
            min(float(unit.own_saved_after_children_bytes), self.own_saved_bytes)
            if unit.children
            else 0.0
        )
        self.saved_bytes = 0.0  # what the whole subtree saves (set in flatten)
        self.input_bytes = float(unit.input_bytes)
        # What a piece ending with this unit costs to rebuild: its forward less its tail,
        # the trailing ops a rebuild that stops early skips, plus the checkpoint machinery.
        self.rebuild_seconds = tick(unit.rebuild_seconds())
        self.rebuild_flops = float(unit.rebuild_flops())
        # Its whole forward, what it costs inside a segment that does not end with it.
        self.forward_seconds = tick(unit.fwd_seconds)
        self.forward_flops = float(unit.fwd_flops)
        self.selective_seconds = tick(unit.selective_seconds())
        self.selective_flops = float(unit.non_matmul_fwd_flops)
        self.matmul_saved_bytes = float(unit.matmul_saved_bytes)
        # Input bytes the sibling before this unit already saves (see evaluate's shared_inputs).
        self.input_saved_by_previous_bytes = min(
            float(unit.input_saved_by_previous_bytes), self.input_bytes
        )
        # Of those, what this unit saves too (held after a recomputed sibling before it).
        self.input_saved_by_both_bytes = min(
            float(unit.input_saved_by_both_bytes), self.input_saved_by_previous_bytes
        )
        # Of its input, what its own subtree saves: a rebuild saves that without allocating.
        self.input_saved_bytes = min(float(unit.input_saved_bytes), self.input_bytes)
        # The root is the whole model: there is nothing outside it to hold its inputs.
        self.can_recompute = bool(unit.can_recompute) and not is_root
        # Selective recompute fails where a matmul output it caches is changed in place.
        self.can_select = bool(unit.can_select)
        # It only differs from recompute when matmul outputs are saved.
        self.offers_selective = (
            self.can_recompute and self.can_select and self.matmul_saved_bytes > 0
        )
        self.sequential = bool(unit.sequential)
        # What a rebuild of this unit as a piece holds above what is kept before it: its
        # input, the input's gradient, ``rebuilt_bytes`` and ``grads_from_bytes`` (set in
        # flatten).
        self.rebuild_hold_bytes = 0.0
        # What a rebuild holds besides the input and its gradient: everything the subtree
        # saves, and what recomputing it allocates besides (cast weights).
        self.rebuilt_bytes = float(unit.recompute_extra_bytes)
        # Parameter gradients that exist when backward reaches this unit.
        self.grads_from_bytes = float(unit.grads_from_bytes)
        # What the subtree's backward holds beyond all it saves, above static (measured).
        self.backward_hold_bytes = float(unit.backward_hold_bytes)
        # A kept leaf's highest moment above what is kept through it: its backward's, or
        # its forward's (measured on the unplanned step, where what the units before it
        # save was held).
        self.forward_hold_bytes = float(unit.forward_hold_bytes)
        self.kept_hold_bytes = max(self.backward_hold_bytes, self.forward_hold_bytes)
        # Inputs its forward moment counts as alive and unsaved: a plan that keeps one as a
        # checkpoint's input before it counts it there (see ``plan_cost.evaluate_nodes``).
        self.forward_unsaved_inputs = unit.forward_unsaved_inputs
        # Its forward moment right after a recomputed piece, where it holds more: the part
        # of its input the sibling before saves, and it does not, is alive but not kept.
        self.after_piece_forward_bytes = (
            self.forward_hold_bytes
            + self.input_saved_by_previous_bytes
            - self.input_saved_by_both_bytes
            if unit.forward_hold_bytes
            else 0.0
        )
        self.after_piece_hold_bytes = max(self.kept_hold_bytes, self.after_piece_forward_bytes)
        # For a chain: range maxima of the children's backward holds (a sparse table:
        # row r holds the maxima of 2**r children from each position).
        self.child_backward_hold_table: Sequence[Sequence[float]] = ()
        # What a kernel of its forward holds for itself (a rebuild holds it too), and the
        # children's, for segments.
        self.forward_workspace_bytes = float(unit.forward_workspace_bytes)
        self.child_forward_workspace_table: Sequence[Sequence[float]] = ()
        # What a rebuild's forward holds above all it saves until its last save (measured),
        # and the children's, for segments.
        self.rebuild_forward_bytes = float(unit.rebuild_forward_bytes)
        self.child_rebuild_forward_table: Sequence[Sequence[float]] = ()
        # What a kernel of its backward holds for itself, and the children's, for segments.
        self.backward_workspace_bytes = float(unit.backward_workspace_bytes)
        self.child_backward_workspace_table: Sequence[Sequence[float]] = ()
        # For a chain (a sequential unit with two or more children), per child position:
        # sums over the children before it (``*_before``, one entry more than children),
        # and what it and they cost as a rebuild ending with it (``*_through``). Segment
        # i..j costs rebuild_seconds_through[j] - forward_seconds_before[i]: the children's
        # whole forwards, but the last one's tail is skipped. Other units leave them empty
        # (shared empty tuples: a tree has thousands of units, and a list apiece would make
        # work for the garbage collector).
        self.saved_before: Sequence[float] = ()
        self.rebuilt_before: Sequence[float] = ()
        self.forward_seconds_before: Sequence[float] = ()
        self.forward_flops_before: Sequence[float] = ()
        self.rebuild_seconds_through: Sequence[float] = ()
        self.rebuild_flops_through: Sequence[float] = ()
        self.child_grads_from_bytes: Sequence[float] = ()
        self.child_input_bytes: Sequence[float] = ()
        self.child_input_saved_bytes: Sequence[float] = ()
        # run_start[j]: the first child of the run of recomputable children ending at j.
        self.run_start: Sequence[int] = ()

    def shape(self, offset: int) -> tuple:
        """Every field but the index and the name, units numbered from ``offset``: equal
        for units alike (children included) at the same place in subtrees alike."""
        return (
            _numbers_of(self),
            tuple(c - offset for c in self.children),
            *map(tuple, _lists_of(self)),
            *(tuple(map(tuple, table)) for table in _tables_of(self)),
        )

    def segment_hold_bytes(self, i: int, j: int) -> float:
        """What a rebuild of children ``i..j`` as one segment holds above what is kept
        before it: child ``i``'s input (held by the checkpoint, so what child ``i`` saves of
        it is not allocated again), what they all rebuild, and the larger of what the
        rebuild's forward and what their backward hold besides: the gradients made when
        backward reaches the segment (at child ``j``, its last) with the most a kernel of
        theirs holds for itself, child ``i``'s input or the most one of their forwards holds
        above what it saves (``rebuild_forward_bytes``); or the most one of them was
        measured to hold in backward (see :func:`rebuild_hold`)."""
        inp = self.child_input_bytes[i]
        row = (j - i + 1).bit_length() - 1
        last = j + 1 - (1 << row)
        holds, spaces = self.child_backward_hold_table, self.child_forward_workspace_table
        back_spaces = self.child_backward_workspace_table
        forwards = self.child_rebuild_forward_table
        return rebuild_hold(
            inp,
            self.rebuilt_before[j + 1] - self.rebuilt_before[i],
            self.child_input_saved_bytes[i],
            max(spaces[row][i], spaces[row][last]),
            self.child_grads_from_bytes[j],
            max(holds[row][i], holds[row][last]),
            max(back_spaces[row][i], back_spaces[row][last]),
            max(forwards[row][i], forwards[row][last]),
        )

    def segment_seconds(self, i: int, j: int) -> float:
        """Recompute time of children ``i..j`` as one segment."""
        return self.rebuild_seconds_through[j] - self.forward_seconds_before[i]

    def segment_flops(self, i: int, j: int) -> float:
        """Recompute FLOPs of children ``i..j`` as one segment."""
        return self.rebuild_flops_through[j] - self.forward_flops_before[i]

    def is_chain(self) -> bool:
        """Sequential with two or more children: segments of them are allowed."""
        return self.sequential and len(self.children) >= 2


# FlatUnit's fields by kind, for its shape (the index and the name left out).
_LIST_SLOTS = (
    "saved_before",
    "rebuilt_before",
    "child_grads_from_bytes",
    "forward_seconds_before",
    "forward_flops_before",
    "rebuild_seconds_through",
    "rebuild_flops_through",
    "run_start",
    "child_input_bytes",
    "child_input_saved_bytes",
)
_TABLE_SLOTS = (
    "child_backward_hold_table",
    "child_forward_workspace_table",
    "child_backward_workspace_table",
    "child_rebuild_forward_table",
)
_NUMBER_SLOTS = tuple(
    name
    for name in FlatUnit.__slots__
    if name not in ("index", "name", "children", *_LIST_SLOTS, *_TABLE_SLOTS)
)
_numbers_of = attrgetter(*_NUMBER_SLOTS)
_lists_of = attrgetter(*_LIST_SLOTS)
_tables_of = attrgetter(*_TABLE_SLOTS)


def rebuild_hold(
    input_bytes: float,
    rebuilt_bytes: float,
    input_saved_bytes: float,
    workspace_bytes: float,
    grads_from_bytes: float,
    backward_hold_bytes: float,
    backward_workspace_bytes: float,
    rebuild_forward_bytes: float = 0.0,
) -> float:
    """What a rebuild holds above what is kept before it, the cost model's one formula for
    a unit and a segment: the input (the checkpoint keeps it, so the part the rebuild
    saves of it is not new), all it rebuilds, then the larger of two moments. During the
    rebuild's forward, the parameter gradients made by then and the larger of the most
    one kernel of the forward holds for itself and the input's gradient; during its
    backward, what the backward was measured to hold beyond what it saves (which counts
    the gradients made by then) and a kernel's workspace, which that dispatch-level
    measurement does not see: the smaller of the forward's and the backward's, both
    measured by the allocator on the unit alone (:mod:`memfit.checkpoint.probe`). A
    forward scratch with no counterpart in backward (an attention kernel's) is not
    charged to the backward; a backward kernel's larger one, measured on the unit alone,
    did not show in the steps measured (a ResNet stage's 2 MiB: +12% with it, +4% without).

    >>> rebuild_hold(10.0, 100.0, 10.0, 5.0, 2.0, 30.0, 4.0)
    134.0
    >>> rebuild_hold(10.0, 100.0, 10.0, 5.0, 2.0, 30.0, 4.0, rebuild_forward_bytes=40.0)
    142.0
    """
    held = max(
        grads_from_bytes + max(workspace_bytes, input_bytes, rebuild_forward_bytes),
        backward_hold_bytes + min(workspace_bytes, backward_workspace_bytes),
    )
    return input_bytes + max(0.0, rebuilt_bytes - input_saved_bytes) + held


def tick(seconds: float) -> float:
    """``seconds`` rounded to a multiple of 2**-40 s (about a picosecond). Sums of such
    numbers (below 2**13 s) are exact in any order, so plans that cost the same tie
    exactly and the tie-breaks decide, not rounding."""
    return round(float(seconds) * 2**40) / 2**40


def flatten(root: UnitCost) -> list[FlatUnit]:
    """The tree's units in pre-order (children in forward order), checked and summed."""
    if not isinstance(root, UnitCost):
        raise PlanError(f"solve() needs the UnitCost tree's root, got {type(root).__name__}")
    nodes: list[FlatUnit] = []
    seen: set[str] = set()
    stack: list[tuple[UnitCost, int]] = [(root, -1)]
    while stack:
        unit, parent = stack.pop()
        if unit.name in seen:
            raise PlanError(f"unit name {unit.name!r} appears twice in the cost tree")
        seen.add(unit.name)
        if not _plain_numbers(_numbers_given(unit)):  # then find the one at fault
            for attr in _NUMBERS:
                value = getattr(unit, attr)
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise PlanError(
                        f"unit {unit.name!r}: {attr} must be a finite number >= 0, got {value!r}"
                    )
        node = FlatUnit(len(nodes), unit, is_root=parent < 0)
        nodes.append(node)
        if parent >= 0:
            nodes[parent].children.append(node.index)
        # Reversed so that children pop, and are numbered, in forward order.
        for child in reversed(unit.children):
            stack.append((child, node.index))
    for node in reversed(nodes):
        node.saved_bytes = node.own_saved_bytes + sum(nodes[c].saved_bytes for c in node.children)
        node.rebuilt_bytes += node.saved_bytes
        node.rebuild_hold_bytes = rebuild_hold(
            node.input_bytes,
            node.rebuilt_bytes,
            node.input_saved_bytes,
            node.forward_workspace_bytes,
            node.grads_from_bytes,
            node.backward_hold_bytes,
            node.backward_workspace_bytes,
            node.rebuild_forward_bytes,
        )
        if node.is_chain():
            kids = [nodes[c] for c in node.children]
            node.saved_before = _prefix(k.saved_bytes for k in kids)
            node.rebuilt_before = _prefix(k.rebuilt_bytes for k in kids)
            node.child_grads_from_bytes = [k.grads_from_bytes for k in kids]
            node.forward_seconds_before = _prefix(k.forward_seconds for k in kids)
            node.forward_flops_before = _prefix(k.forward_flops for k in kids)
            node.rebuild_seconds_through = [
                node.forward_seconds_before[j] + k.rebuild_seconds for j, k in enumerate(kids)
            ]
            node.rebuild_flops_through = [
                node.forward_flops_before[j] + k.rebuild_flops for j, k in enumerate(kids)
            ]
            node.child_input_bytes = [k.input_bytes for k in kids]
            node.child_input_saved_bytes = [k.input_saved_bytes for k in kids]
            node.child_backward_hold_table = _range_max_table([k.backward_hold_bytes for k in kids])
            node.child_forward_workspace_table = _range_max_table(
                [k.forward_workspace_bytes for k in kids]
            )
            node.child_backward_workspace_table = _range_max_table(
                [k.backward_workspace_bytes for k in kids]
            )
            node.child_rebuild_forward_table = _range_max_table(
                [k.rebuild_forward_bytes for k in kids]
            )
            start = 0
            run_start = []
            for j, kid in enumerate(kids):
                if not kid.can_recompute:
                    start = j + 1
                run_start.append(min(start, j))
            node.run_start = run_start
    return nodes


_numbers_given = attrgetter(*_NUMBERS)
_PLAIN_TYPES = {float, int}


def _plain_numbers(values: tuple) -> bool:
    """Whether ``values`` are all plain floats or ints, finite and >= 0: a check made in
    a few calls rather than one per number (a tree has tens of thousands of units). False
    says only that the number-by-number check must look (a subclass, a sum past the
    largest float): it finds the fault, or passes them all."""
    try:
        return (
            set(map(type, values)) <= _PLAIN_TYPES
            and min(values) >= 0
            and math.isfinite(sum(values))  # an inf or a nan makes the sum one
        )
    except OverflowError:  # an int too large for a float
        return False


def _range_max_table(values: list[float]) -> list[list[float]]:
    """Rows of maxima over 2**r consecutive values from each position (a sparse table):
    the maximum of values[i..j] is that of two overlapping rows, in constant time."""
    table = [list(values)]
    width = 1
    while 2 * width <= len(values):
        last = table[-1]
        table.append([max(last[i], last[i + width]) for i in range(len(values) - 2 * width + 1)])
        width *= 2
    return table


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def find_chains(nodes: list[FlatUnit]) -> Chains:
    """(chain unit, positions of its block children), chains in pre-order (the blocks are
    defined in the package's docstring)."""
    chains: Chains = []
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
            if child.is_chain():
                inner.append(c)  # a container that only iterates: its children are the blocks
            elif child.can_recompute:
                blocks.append(pos)
            else:
                inner.append(c)
        if blocks:
            chains.append((u, blocks))
        stack.extend(reversed(inner))
    chains.sort()
    return chains
