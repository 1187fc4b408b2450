"""Turning a profiled step's per-unit records into the planner's :class:`UnitCost` tree
(:func:`build_costs`), then evening out the times of identical units (:func:`pool_times`),
leaving out the inputs an earlier unit holds already (:func:`drop_held_inputs`) and
marking the inputs siblings share (:func:`mark_shared_inputs`)."""

from __future__ import annotations

import statistics
from typing import Any

from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.profiler.recorder import ChainState, Stats
from memfit.checkpoint.recompute import has_own_forward, stock_sequential
from memfit.checkpoint.tree import Unit

__all__ = ["build_costs", "drop_held_inputs", "mark_shared_inputs", "pool_times"]


def pool_times(unit: Unit, cost: UnitCost) -> None:
    """Give units that do the same work the median of their measured times.

    Units of one class with the same FLOPs, saved, input and output bytes and tail, and
    children alike (the blocks of a transformer, the residual blocks of a ResNet stage), run
    the same kernels on the same shapes; one step's timings of them differ only by noise
    (a millisecond in ten on a busy CPU), which would make the planner prefer one block over
    its twin for nothing."""
    classes = {u.name: u.class_name for u in unit.walk()}
    groups: dict[tuple, list[UnitCost]] = {}

    def signature(c: UnitCost) -> tuple:
        key = (
            classes[c.name],
            c.fwd_flops,
            c.own_saved_bytes,
            c.input_bytes,
            c.output_bytes,
            c.tail_flops,
            c.matmul_saved_bytes,
            c.can_recompute,
            tuple(signature(k) for k in c.children),
        )
        groups.setdefault(key, []).append(c)
        return key

    signature(cost)
    for members in groups.values():
        if len(members) < 2:
            continue
        fwd = statistics.median(m.fwd_seconds for m in members)
        bwd = statistics.median(m.bwd_seconds for m in members)

        # The parts of the forward (tail, selective) get the median of their shares of it.
        tail, selective = (
            statistics.median(
                getattr(m, part) / m.fwd_seconds if m.fwd_seconds > 0 else 0.0 for m in members
            )
            for part in ("tail_seconds", "non_matmul_fwd_seconds")
        )
        for m in members:
            m.fwd_seconds, m.bwd_seconds = fwd, bwd
            m.tail_seconds, m.non_matmul_fwd_seconds = fwd * tail, fwd * selective


def drop_held_inputs(
    cost: UnitCost, stats: dict[str, Stats], saved_owner: dict[Any, str | None]
) -> dict[str, set[Any]]:
    """Leave out of each unit's ``input_bytes`` the inputs an earlier unit holds whatever
    the plan; return them per unit name.

    Many units may receive one tensor: a decoder's every cross-attention layer the
    encoder's output, every layer the rotary position tables. A checkpoint holds its
    inputs, but one storage is held once, whoever holds it. An earlier unit *holds* an
    input when it receives it and the input's first saver for backward lies inside it,
    reached through units that all receive it: kept, it saves the input; recomputed,
    its checkpoint holds it; and either way the input is counted there (in the saved
    bytes of its first saver, or in the input bytes of the recomputed unit around it).
    It holds it until backward reaches it, after every later unit. So a later unit's
    checkpoint adds nothing for that input. "Earlier" means before the unit at its own
    level or at an ancestor's: an earlier sibling of the unit or of one of its ancestors
    (a unit inside a recomputed earlier piece holds nothing on its own).

    An input that no unit saves (an attention bias added to the scores) is held by the
    checkpoints alone, by as many as receive it when they are recomputed: it stays
    counted in each (an upper bound). Only units called once hold inputs here (a storage
    freed between two calls could return at the same address as another tensor).
    """
    holds: dict[str, set[Any]] = {}

    def find_holds(unit: UnitCost) -> set[Any]:
        # The keys this unit's subtree holds, for a unit called once that receives them;
        # for a container never called itself (a ModuleList), its children's.
        st = stats[unit.name]
        inner: set[Any] = set()
        for child in unit.children:
            inner |= find_holds(child)
        if st.call_count == 0:
            found = inner
        elif st.call_count == 1:
            own = {k for k in st.input_storage_bytes if saved_owner.get(k) == unit.name}
            found = (own | inner) & st.input_storage_bytes.keys()
        else:
            found = set()
        holds[unit.name] = found
        return found

    find_holds(cost)
    dropped: dict[str, set[Any]] = {}

    def visit(unit: UnitCost, held_before: set[Any]) -> None:
        before = set(held_before)
        first_input = unit.children[0].input_bytes if unit.children else None
        for child in unit.children:
            st = stats[child.name]
            dropped[child.name] = set(st.input_storage_bytes.keys() & before)
            gone = sum(st.input_storage_bytes[k] for k in dropped[child.name])
            child.input_bytes = max(0.0, child.input_bytes - gone)
            visit(child, before)
            before |= holds[child.name]
        if stats[unit.name].call_count == 0 and unit.input_bytes == first_input:
            # A chain never called itself receives what its first child does.
            unit.input_bytes = unit.children[0].input_bytes

    visit(cost, set())
    return dropped


def mark_shared_inputs(
    unit: Unit,
    cost: UnitCost,
    stats: dict[str, Stats],
    saved_owner: dict[Any, str | None],
    saved_by: dict[Any, set[str | None]],
    held: dict[str, set[Any]] | None = None,
) -> None:
    """Set each unit's ``input_saved_by_previous_bytes``: bytes of its inputs that the
    sibling before it already saves for backward (e.g. a block whose last ReLU saves the
    output the next block receives; for a first child, its parent's own ops),
    ``input_saved_by_both_bytes``: those it saves too (a convolution saves its input;
    under autocast it saves a 16-bit copy instead), and ``input_saved_bytes``: the bytes
    of its inputs its own subtree is the first to save. ``held``: per unit, the inputs left
    out of its ``input_bytes`` (:func:`drop_held_inputs`), left out here too."""
    held = held or {}

    def inside(owner: str | None, name: str) -> bool:
        return owner is not None and (owner == name or owner.startswith(name + "."))

    def inputs(name: str) -> dict[Any, int]:
        gone = held.get(name, set())
        return {k: n for k, n in stats[name].input_storage_bytes.items() if k not in gone}

    by_name = {c.name: c for c in cost.children}
    units = {u.name: u for u in unit.children}
    if cost.children:
        # The first child's input is often saved by its parent's own ops before it (a
        # stem's last ReLU, before the first stage): kept whenever the parent is kept.
        first = cost.children[0]
        first.input_saved_by_previous_bytes = float(
            sum(n for key, n in inputs(first.name).items() if saved_owner.get(key) == cost.name)
        )
    for prev, cur in zip(cost.children, cost.children[1:]):
        shared = {
            key: n for key, n in inputs(cur.name).items() if inside(saved_owner.get(key), prev.name)
        }
        both = sum(
            n for key, n in shared.items() if any(inside(o, cur.name) for o in saved_by[key])
        )
        cur.input_saved_by_previous_bytes = float(sum(shared.values()))
        cur.input_saved_by_both_bytes = float(both)
    for child in cost.children:
        child.input_saved_bytes = float(
            sum(
                n
                for key, n in inputs(child.name).items()
                if inside(saved_owner.get(key), child.name)
            )
        )
    for name, child in by_name.items():
        mark_shared_inputs(units[name], child, stats, saved_owner, saved_by, held)


def build_costs(
    unit: Unit,
    stats: dict[str, Stats],
    chains: dict[str, ChainState],
    iterated: dict[str, bool],
    measured: bool,
    timed_tails: bool,
) -> UnitCost:
    """The UnitCost subtree of ``unit`` from the recorded per-unit stats."""
    children = [
        build_costs(c, stats, chains, iterated, measured, timed_tails) for c in unit.children
    ]
    if not unit.is_chain:
        # Forward order; units never called go last, in registration order.
        never = float("inf")
        children.sort(
            key=lambda c: stats[c.name].first_call_order if stats[c.name].call_count else never
        )
    names = [u.name for u in unit.walk()]

    def total(attr: str) -> float:
        return float(sum(getattr(stats[n], attr) for n in names))

    st = stats[unit.name]
    module = unit.module
    if not has_own_forward(module):
        st.rule_out_recompute(
            f"{type(module).__name__} has no forward of its own; checkpoint its children "
            "or segments of them"
        )
    elif st.call_count == 0:
        st.rule_out_recompute("was not called in the profiled step")
    fwd_seconds = st.forward_seconds if measured else total("estimated_forward_own_seconds")
    input_bytes, output_bytes = float(st.input_bytes), float(st.output_bytes)
    if st.call_count == 0 and children:
        # A container its parent iterates is never called itself: its forward is its
        # children's, and (when they form a chain) its input is the first one's.
        fwd_seconds = sum(c.fwd_seconds for c in children) if measured else fwd_seconds
        if unit.is_chain:
            input_bytes, output_bytes = children[0].input_bytes, children[-1].output_bytes
    bwd_seconds = (
        total("backward_own_seconds") if measured else total("estimated_backward_own_seconds")
    )
    mm_time, nm_time = total("matmul_op_own_seconds"), total("non_matmul_op_own_seconds")
    share = nm_time / (mm_time + nm_time) if mm_time + nm_time > 0 else 0.0
    # Without a timed tail: its ops' share of the unit's op time, as for selective recompute.
    tail_share = (
        min(1.0, st.tail_op_seconds / (mm_time + nm_time)) if mm_time + nm_time > 0 else 0.0
    )
    chain = chains.get(unit.name)
    sequential = (
        unit.is_chain
        and chain is not None
        and chain.ok
        and chain.passes >= 1
        and chain.expected == 0
        and (stock_sequential(module) or iterated.get(unit.name, False))
    )
    return UnitCost(
        name=unit.name,
        children=children,
        fwd_flops=total("forward_flops_own"),
        fwd_seconds=fwd_seconds,
        bwd_seconds=bwd_seconds,
        own_saved_bytes=float(st.saved_bytes_own),
        # Only a unit with child units has a tail of its own after them (an LM's head and
        # loss after its blocks); a leaf's saved bytes are all its own either way.
        own_saved_after_children_bytes=float(
            min(st.saved_bytes_after_children, st.saved_bytes_own) if children else 0
        ),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        matmul_saved_bytes=total("matmul_output_bytes_own"),
        non_matmul_fwd_flops=total("non_matmul_flops_own"),
        # The rebuild runs the same ops under the same kind of mode: it pays the overhead too.
        non_matmul_fwd_seconds=fwd_seconds * share + 2 * st.selective_overhead_seconds,
        tail_flops=min(st.tail_flops, total("forward_flops_own")),
        tail_seconds=min(st.tail_measured_seconds, fwd_seconds)
        if timed_tails
        else fwd_seconds * tail_share,
        backward_peak_bytes=float(st.backward_peak_bytes),
        can_recompute=not st.not_recomputable_reasons,
        can_select=not st.not_selective_reason,
        sequential=bool(sequential),
    )
