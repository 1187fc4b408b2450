"""Turning a profiled step's per-unit records into the planner's :class:`UnitCost` tree
(:func:`build_costs`), then evening out the times of identical units (:func:`pool_times`)
and marking the inputs siblings share (:func:`mark_shared_inputs`)."""

from __future__ import annotations

import statistics
from typing import Any

from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.profiler.chains import ChainState
from memfit.checkpoint.profiler.stats import Stats
from memfit.checkpoint.profiler.storage import storage_of
from memfit.checkpoint.recompute import has_own_forward, stock_sequential
from memfit.checkpoint.tree import Unit

__all__ = ["build_costs", "mark_shared_inputs", "pool_times"]


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


def mark_shared_inputs(
    unit: Unit,
    cost: UnitCost,
    stats: dict[str, Stats],
    saved_owner: dict[Any, str | None],
    saved_by: dict[Any, set[str | None]],
) -> None:
    """Set each unit's ``input_saved_by_previous_bytes``: bytes of its inputs that the
    sibling before it already saves for backward (e.g. a block whose last ReLU saves the
    output the next block receives; for a first child, its parent's own ops),
    ``input_saved_by_both_bytes``: those it saves too (a convolution saves its input;
    under autocast it saves a 16-bit copy instead), and ``input_saved_bytes``: the bytes
    of its inputs its own subtree is the first to save."""

    def inside(owner: str | None, name: str) -> bool:
        return owner is not None and (owner == name or owner.startswith(name + "."))

    by_name = {c.name: c for c in cost.children}
    units = {u.name: u for u in unit.children}
    if cost.children:
        # The first child's input is often saved by its parent's own ops before it (a
        # stem's last ReLU, before the first stage): kept whenever the parent is kept.
        first = cost.children[0]
        first.input_saved_by_previous_bytes = float(
            sum(
                n
                for key, n in stats[first.name].input_storage_bytes.items()
                if saved_owner.get(key) == cost.name
            )
        )
    for prev, cur in zip(cost.children, cost.children[1:]):
        shared = {
            key: n
            for key, n in stats[cur.name].input_storage_bytes.items()
            if inside(saved_owner.get(key), prev.name)
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
                for key, n in stats[child.name].input_storage_bytes.items()
                if inside(saved_owner.get(key), child.name)
            )
        )
    for name, child in by_name.items():
        mark_shared_inputs(units[name], child, stats, saved_owner, saved_by)


def _first_call(cost: UnitCost, stats: dict[str, Stats]) -> float:
    """The first call in ``cost``'s subtree: its own, or, never called itself, its
    descendants' earliest; infinity when nothing in it was called."""
    st = stats[cost.name]
    if st.call_count:
        return float(st.first_call_order)
    return min((_first_call(c, stats) for c in cost.children), default=float("inf"))


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
        # Forward order, each child by the first call in its subtree: a list of layers the
        # model loops over is never called itself, and its place is its layers' (a
        # recommender's embedding tables before its top MLP; one tower of two before the
        # other). Units never called at all go last, in registration order.
        children.sort(key=lambda c: _first_call(c, stats))
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
    input_storages = tuple((i, float(n)) for i, n in st.input_storage_ids.items())
    # Autocast's copies of the subtree's own matrices and filters that the subtree saves
    # (the weights a rebuild casts again, as step_memory.autocast_copy_bytes counts them).
    own_weights = {storage_of(p)[0] for p in module.parameters() if p.dim() >= 2}
    saved_casts = float(
        sum(
            nbytes
            for n in names
            for source, nbytes in stats[n].saved_casts_own.items()
            if source in own_weights
        )
    )
    if st.call_count == 0 and children:
        # A container its parent iterates is never called itself: its forward is its
        # children's, and (when they form a chain) its input is the first one's.
        fwd_seconds = sum(c.fwd_seconds for c in children) if measured else fwd_seconds
        if unit.is_chain:
            input_bytes, output_bytes = children[0].input_bytes, children[-1].output_bytes
            input_storages = children[0].input_storages
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
        input_storages=input_storages,
        saved_cast_bytes=saved_casts,
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
        backward_peak_released_bytes=float(st.backward_peak_released_bytes),
        release_levels={n: float(v) for n, v in st.release_levels.items()},
        forward_peak_bytes=float(st.forward_peak_bytes),
        forward_unsaved_inputs=tuple((i, float(n)) for i, n in st.forward_unsaved_inputs.items()),
        grads_before_backward=st.grads_before_backward if st.call_count == 1 else -1,
        backward_held_at_reach=float(st.backward_held_at_reach) if st.call_count == 1 else 0.0,
        can_recompute=not st.not_recomputable_reasons,
        can_select=not st.not_selective_reason,
        sequential=bool(sequential),
    )
