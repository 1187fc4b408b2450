"""The Engine's planning, stage two of its order: the plan under the budget, and the
closed loop that measures the first planned step against the plan's prediction.

Nothing here takes the Engine: it is given the model, the optimizer, the precision and a
function that runs one measured step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.step_memory import ZeroGrad
from memfit.engine.settings import EngineSettings, default_memory_budget
from memfit.errors import BudgetError
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes


class EnginePlan(NamedTuple):
    """A plan the Engine made, and what its first step must be checked against."""

    result: Any
    """The planner's PlanResult (plan, profile, step memory)."""
    budget_to_verify: int | None
    """A budget only the measured first step can judge, the plan being the least any plan
    reaches (the ``full`` fallback, or a plan accepted on a measured forward and backward),
    or None."""


def make_engine_plan(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer,
    strategy: str,
    budget: int | None,
    accumulation_steps: int,
    units: list[str] | None = None,
    zero_grad: ZeroGrad = "before_forward",
    activation_storage: tuple[str, ...] = ("keep", "recompute"),
) -> EnginePlan:
    """The plan under ``budget``; where the model predicts none fits, the ``full`` plan,
    whose first step the closed loop then measures against the budget: a budget the
    measured ``full`` plan meets is not refused on a prediction. ``units``: the candidate
    units (qualified module names) instead of those ``find_units`` finds.

    Example::

        planned = make_engine_plan(model, micro, loss_fn, policy, opt, "optimal", 2**28, 1)
        apply_plan(model, planned.result.plan)
    """
    from memfit.checkpoint.profile_stage import profile_step

    profiled = profile_step(model, batch, loss_fn, policy, units)
    return plan_from_profile(
        model,
        profiled,
        policy,
        optimizer,
        strategy,
        budget,
        accumulation_steps,
        zero_grad,
        activation_storage,
    )


def strategy_plan(
    strategy: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: PrecisionPolicy,
    settings: EngineSettings,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    units: list[str] | None,
    device: torch.device,
    ready: EnginePlan | None = None,
) -> EnginePlan:
    """The plan a ``checkpoint=`` strategy name asks for on micro-batches like ``batch``
    (:func:`make_engine_plan`): ``"auto"`` is ``"optimal"``, under the settings' memory
    budget or, for ``"optimal"`` without one, 90% of ``device``'s memory. ``ready``: the
    plan made for it already (the timed splits'), taken as is. The gradients the planning's
    backward passes left (in the ``*-master`` modes, in the fp32 masters' buffers) are
    cleared: the first step must not add to them.

    Example::

        planned = strategy_plan("auto", model, opt, policy, settings, micro, loss_fn, None, dev)
        apply_plan(model, planned.result.plan)
    """
    strategy = "optimal" if strategy == "auto" else strategy
    budget = settings.memory_budget
    if budget is None and strategy == "optimal":
        budget = default_memory_budget(device)
    planned = ready or make_engine_plan(
        model,
        batch,
        loss_fn,
        policy,
        optimizer,
        strategy,
        budget,
        settings.accumulation_steps,
        units,
        # With gradients released in backward no moment holds them all.
        "in_backward" if settings.release_gradients else "before_forward",
        settings.activation_storage,
    )
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    return planned


def plan_from_profile(
    model: nn.Module,
    profiled: Any,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer,
    strategy: str,
    budget: int | None,
    accumulation_steps: int,
    zero_grad: ZeroGrad = "before_forward",
    activation_storage: tuple[str, ...] = ("keep", "recompute"),
) -> EnginePlan:
    """:func:`make_engine_plan` from a profile already made (``profile_step`` of the
    micro-batch under ``policy``): the timed splits plan several strategies on one.

    Example::

        planned = plan_from_profile(model, profiled, policy, opt, "full", None, 1)
    """
    from memfit.checkpoint.planner import solve_profile

    def solve(strategy: str, budget: int | None) -> Any:
        # Training needs the plan, not the frontier `memfit plan` shows (start-up time).
        return solve_profile(
            model,
            profiled,
            policy,
            optimizer,
            strategy,
            budget,
            accumulation_steps,
            frontier=False,
            zero_grad=zero_grad,
            activation_storage=activation_storage,
        )

    try:
        result = solve(strategy, budget)
        # The least plan accepted on a measured forward and backward is judged again on
        # the first whole training step, as the ``full`` fallback is.
        verify = int(budget) if budget is not None and result.measured_is_least else None
        return EnginePlan(result, verify)
    except BudgetError as exc:
        if strategy != "optimal" or budget is None:
            raise
        full = solve("full", None)
        if full.memory.floor_bytes > budget:
            raise  # the optimizer step or the step's edges alone hold more: no plan can help
        full.plan.notes.append(
            f"the planner predicts no plan fits ({exc}); training with 'full', whose "
            "first step is measured against the budget"
        )
        return EnginePlan(full, int(budget))


def check_first_step(
    planned: EnginePlan,
    measured_peak_bytes: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> Any:
    """Judge the first step under a plan memfit made by its peak as the allocator measured
    it (:func:`~memfit.checkpoint.planner.planned_step_verdict`), and make the plan again
    once from the same profile when its prediction was off by more than the reserve
    (:func:`~memfit.checkpoint.closed_loop.follow_verdict`). Returns the PlanCheck; a re-made
    plan is applied in place of the old one. The step itself trained as any other.

    Raises BudgetError when the plan is the least any plan reaches (the ``full`` fallback,
    or a plan accepted on a measured forward and backward) and its measured step is over
    the budget it had to verify (the step was applied; nothing is lost).

    Example::

        check = check_first_step(planned, peak.peak_bytes, model, optimizer)
        engine_plan = check.plan
    """
    from memfit.checkpoint.apply import apply_plan, remove_plan
    from memfit.checkpoint.closed_loop import follow_verdict
    from memfit.checkpoint.planner import planned_step_verdict

    budget = planned.budget_to_verify
    verdict = planned_step_verdict(planned.result, measured_peak_bytes, budget)
    if verdict.action == "refuse":
        raise BudgetError(
            f"memory_budget={format_bytes(budget or 0)} is below the smallest peak any plan "
            f"reaches: the first step under the plan with the least peak peaked at "
            f"{format_bytes(measured_peak_bytes)}. The step was applied and nothing is "
            "lost; raise the budget, use a smaller micro-batch (more accumulation steps) "
            "or a '*-master' precision."
        )
    check = follow_verdict(planned.result, verdict, model, optimizer)
    check = _measured_before_use(planned, check, measured_peak_bytes, model, optimizer)
    if check.replanned:
        remove_plan(model)
        apply_plan(model, check.plan)
    return check


def _measured_before_use(
    planned: EnginePlan,
    check: Any,
    measured_peak_bytes: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> Any:
    """A plan re-made to recompute less than one whose step was measured within the
    budget, itself measured (a forward and backward on the profiled batch, the allocator
    counting) before it replaces that plan: a miss measured on one plan is not the same on
    another, and the re-made plan's first step could go over the budget the measured one
    met. Over it, the measured plan is kept, with a note."""
    from memfit.checkpoint.closed_loop import PlanCheck
    from memfit.checkpoint.planner import step_run

    result, budget = planned.result, planned.result.budget
    if not check.replanned or budget is None or measured_peak_bytes > int(budget):
        return check
    if check.plan.recompute_flops >= result.plan.recompute_flops:
        return check  # recomputes as much or more: it frees at least as much
    run = step_run(model, result.profile, result.memory, result.policy, optimizer)
    if run is None:
        return check
    peak = run.peak_bytes(check.plan)
    if peak <= int(budget):
        check.plan.measured_peak_bytes = peak
        return check
    result.plan.notes.append(
        f"the plan re-made from the first step's measurement (to recompute less) measured "
        f"{format_bytes(peak)}, over the budget {format_bytes(int(budget))}: the plan whose "
        f"step measured {format_bytes(measured_peak_bytes)} is kept"
    )
    return PlanCheck(check.predicted_peak_bytes, check.measured_peak_bytes, 0.0, False, result.plan)
