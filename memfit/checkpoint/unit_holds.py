"""What a rebuild in backward holds besides activations, per unit of the cost tree: the
terms the step's memory (:mod:`memfit.checkpoint.step_memory`) gives each unit before the
solvers walk it (``recompute_extra_bytes``, ``backward_hold_bytes``,
``forward_hold_bytes``, ``grads_from_bytes``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch import nn

from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.released import released_backward_peak
from memfit.checkpoint.step_memory import (
    RankLayout,
    autocast_copy_bytes,
    largest_in_flight_bytes,
    own_param_ids,
    sizes_by_param,
)
from memfit.precision.policy import PrecisionPolicy

__all__ = ["with_backward_costs"]


def with_backward_costs(
    root: UnitCost,
    model: nn.Module,
    policy: PrecisionPolicy,
    accumulating: bool = False,
    layout: RankLayout | None = None,
    sparse_grads: Mapping[str, float] | None = None,
    released: Mapping[str, float] | None = None,
    forward_offset_bytes: float = 0.0,
    grad_order: Sequence[str] = (),
) -> UnitCost:
    """``root`` with what a rebuild in backward holds besides activations, per unit:

    * ``recompute_extra_bytes``: a rebuild runs under autocast again and casts the unit's
      weights again, beside what it saves (the copies it saves are counted there:
      ``saved_cast_bytes``);
    * ``backward_hold_bytes``: what the unit's backward was measured to hold beyond what it
      saves, above the static bytes (``backward_peak_bytes`` less those);
    * ``forward_hold_bytes``: what its forward was measured to hold beyond what the step had
      saved by its end, less the gradient in flight the held bytes count
      (``forward_peak_bytes`` less that);
    * ``grads_from_bytes``: the parameter gradients backward has made by then: the first
      ``unit.grads_before_backward`` of ``grad_order`` (the order in which the profiled
      step's backward began each one: a rebuild runs before the unit's own backward, so
      its own gradients are not begun yet, but for a weight used again later, a tied
      one), and what else backward held when it first reached the unit beyond the
      gradient in flight the static bytes count (``unit.backward_held_at_reach`` less
      those gradients as the profiled step held them: a T5 decoder block's rebuild holds
      the gradients of the position bias it passes on); where that was not measured,
      those of the unit and of every unit after it in
      forward order, and (not knowing where in their forward they are used) those of its
      ancestors' own parameters. With ``accumulating`` they are 0: every gradient is
      held already (``StepMemory.accumulated_grad_bytes``); with ``released`` (gradients
      freed in backward as their updates are applied) too: none is held by then, and each
      unit's backward holds instead the one being released with its update's
      temporaries: the most of its own tensors', from ``released`` (by parameter name:
      ``StepMemory.released_by_param``).

    ``layout``: under FSDP2 a rank keeps its fp32 shard of each gradient made (``1/N``);
    under DDP every gradient is held already, in the buckets, as with accumulation.
    ``sparse_grads``: sparse gradients' measured bytes by parameter name
    (:func:`~memfit.checkpoint.step_memory.sparse_grad_sizes`). ``forward_offset_bytes``: what a forward moment holds
    beyond the held bytes and its measured level (:attr:`~memfit.checkpoint.step_memory.StepMemory.forward_offset_bytes`).
    """
    layout = layout or RankLayout()
    accumulating = accumulating or layout.kind == "ddp"
    sharded = layout.kind == "fsdp"
    width = 4 if policy.master_weights or sharded else None
    shards = layout.world_size if sharded else 1

    sparse = sizes_by_param(model, sparse_grads)
    releasing = sizes_by_param(model, released)

    def grad_bytes(params: list[nn.Parameter]) -> float:
        sizes = (sparse.get(id(p), p.numel() * (width or p.element_size())) for p in params)
        return float(sum(sizes)) / shards

    order: list[UnitCost] = list(root.walk())  # forward order: parents before children
    own: dict[str, float] = {}
    for unit in order:
        mine = own_param_ids(model, unit)
        own[unit.name] = grad_bytes(
            [
                p
                for p in model.get_submodule(unit.name).parameters()
                if p.requires_grad and id(p) in mine
            ]
        )
    after: dict[str, float] = {}
    total = 0.0
    for unit in reversed(order):
        total += own[unit.name]
        after[unit.name] = total

    # The gradients made before each point of the profiled step's backward, by how many:
    # as this step holds them (``made_before``: sharded, fp32 for master weights) and as the
    # profiled step held them (``profiled_before``: what its measured bytes count).
    params = dict(model.named_parameters())
    made_before, profiled_before = [0.0], [0.0]
    for name in grad_order:
        p = params.get(name)
        this_step = grad_bytes([p]) if p is not None else 0.0
        held = sparse.get(id(p), p.numel() * p.element_size()) if p is not None else 0.0
        made_before.append(made_before[-1] + this_step)
        profiled_before.append(profiled_before[-1] + held)

    in_flight = largest_in_flight_bytes(root)
    subtree_grads = {u.name: sum(own[v.name] for v in u.walk()) for u in order}

    def fill(unit: UnitCost, above: float) -> UnitCost:
        children = [fill(c, above + own[unit.name]) for c in unit.children]
        grads = after[unit.name] + above
        begun = unit.grads_before_backward  # how many, in grad_order
        # Measured: made_before[begun]; else the bound (the unit's own and all after it).
        made_by_then = grads
        if 0 <= begun < len(made_before) and grad_order:
            # Measured, and the activation gradients in flight then beyond the one the
            # static bytes count (a decoder block's: the position bias it passes on).
            flying = unit.backward_held_at_reach - profiled_before[begun] - in_flight
            made_by_then = made_before[begun] + max(0.0, flying)
        # What the unit's own backward held, less what the static bytes count already: the
        # gradient passed in, and with accumulation the parameter gradients (held all step).
        # With accumulation the gradients of the units after it are held already; its own
        # new gradients are made beside the accumulated ones before they are added in.
        # Released in backward: the peak of a loop that holds no gradient but the one it
        # updates (:func:`_released_backward_peak`).
        peak = unit.backward_peak_bytes
        held_grads = 0.0
        if accumulating:
            held_grads = grads - subtree_grads[unit.name]
        elif released is not None:
            module = model.get_submodule(unit.name)
            most = max((releasing.get(id(p), 0.0) for p in module.parameters()), default=0.0)
            peak = released_backward_peak(unit, released, grads, most)
        hold = peak - unit.total_saved_bytes() - in_flight - held_grads
        return dataclasses.replace(
            unit,
            children=children,
            # The copies its rebuild casts again, but for those it saves (counted there).
            recompute_extra_bytes=max(
                0.0,
                float(autocast_copy_bytes(model.get_submodule(unit.name), policy))
                - unit.saved_cast_bytes,
            ),
            grads_from_bytes=0.0 if accumulating or released is not None else made_by_then,
            backward_hold_bytes=max(0.0, hold),
            # Forward has no gradient in flight yet, which the held bytes count (see
            # StepMemory.forward_offset_bytes for the rest). Not measured (0): no moment.
            forward_hold_bytes=max(0.0, unit.forward_peak_bytes - in_flight + forward_offset_bytes)
            if unit.forward_peak_bytes
            else 0.0,
        )

    return fill(root, 0.0)
