"""What the solvers say: the notes on a plan and the texts of their budget errors."""

from __future__ import annotations

import math

from memfit.checkpoint.solvers.plan_cost import PlanCost
from memfit.units import format_bytes

NO_BUDGET = "no budget given: the cheapest plan is chosen, and it recomputes nothing"


def at_least(n: float) -> str:
    """``n`` bytes written as a budget that fits: rounded up, and exactly in bytes."""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    shown = f"{math.ceil(value)} B" if unit == "B" else f"{math.ceil(value * 100) / 100:.2f} {unit}"
    return f"{shown} ({math.ceil(n)} bytes)"


def budget_words(planned: float, reserve: float) -> str:
    """The caller's budget, and what of it is planned when part is kept free."""
    if not reserve:
        return format_bytes(planned)
    return (
        f"{format_bytes(planned / (1 - reserve))} ({format_bytes(planned)} of it planned, "
        f"{reserve:.0%} kept free for allocator slack)"
    )


def nothing_recomputed(budget: float, reserve: float, none_peak: float) -> str:
    """The note on a budget that needs no checkpointing."""
    return (
        f"budget {budget_words(budget, reserve)} is at or above the no-checkpoint peak "
        f"{format_bytes(none_peak)}: nothing is recomputed"
    )


def breakdown(cost: PlanCost, static: float, loss: float) -> str:
    """Where a plan's peak comes from."""
    kept, high = cost.kept_bytes, cost.rebuild_bytes
    if high > kept + loss:
        where = f"the highest rebuild in backward {format_bytes(high - kept)} above the kept"
    else:
        where = (
            f"the loss {format_bytes(loss)} at the end of forward"
            if loss > 0
            else "the end of forward"
        )
    return f"static {format_bytes(static)}, kept activations {format_bytes(kept)}, then {where}"


def strategy_cannot_fit(
    label: str, budget: float, smallest: PlanCost, static: float, loss: float, reserve: float
) -> str:
    """A fixed strategy's error, given its plan with the smallest peak."""
    peak = static + smallest.peak(loss)
    return (
        f"strategy {label!r} cannot fit the budget {budget_words(budget, reserve)}: "
        f"its smallest peak is {format_bytes(peak)} ({peak:.0f} bytes; "
        f"{breakdown(smallest, static, loss)}). Use strategy 'optimal', which finds "
        f"the smallest peak any plan reaches, or a budget of at least "
        f"{at_least(peak / (1 - reserve))}"
    )


def too_small(budget: float, smallest: PlanCost, static: float, loss: float, reserve: float) -> str:
    """The optimal strategy's error, given a plan with the smallest peak any plan reaches."""
    peak = static + smallest.peak(loss)
    needed = at_least(peak / (1 - reserve))
    head = (
        f"budget {budget_words(budget, reserve)} is below the smallest peak any checkpoint plan "
        f"reaches, {format_bytes(peak)} ({peak:.0f} bytes): "
        f"{breakdown(smallest, static, loss)}. "
    )
    if static >= budget:
        return head + (
            f"Static memory alone ({format_bytes(static)}: parameters, gradients, optimizer "
            "state) exceeds the budget and checkpointing cannot lower it; shrink it (lower "
            "precision master weights, a sharded or smaller optimizer state, a smaller model) "
            f"or raise the budget to at least {needed}"
        )
    if static >= peak - static:
        return head + (
            "Static memory dominates and checkpointing cannot lower it; shrink it or raise "
            f"the budget to at least {needed}"
        )
    return head + (
        "Activations dominate even with everything possible recomputed; use a smaller "
        f"micro-batch or sequence, or raise the budget to at least {needed}"
    )
