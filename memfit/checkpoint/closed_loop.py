"""The closed loop: a planned step measured, judged against its prediction, and the plan
made again from the same profile when the measurement says so.

The Engine runs it on its first planned training step (:mod:`memfit.engine.plan_stage`);
:func:`verify_plan` runs the same judgement on the example batch
before a plan is returned. The judgement itself is
:func:`~memfit.checkpoint.measured_fit.judge_fit`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from memfit.checkpoint.measured_fit import FitVerdict, StepRun, measured_least_plan
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.planner import (
    Budget,
    PlanResult,
    cost_tree,
    planned_step_verdict,
    result_of_solution,
    solve_profile,
    step_run,
)
from memfit.checkpoint.solvers import parse_strategy
from memfit.errors import BudgetError
from memfit.units import format_bytes


@dataclass(frozen=True)
class PlanCheck:
    """A planned step measured against its prediction, and what was done about it."""

    predicted_peak_bytes: float
    """The peak the plan predicted for the step."""
    measured_peak_bytes: float
    """The peak the step reached."""
    correction_bytes: float
    """What the step memory was corrected by to re-plan (measured - predicted), or 0."""
    replanned: bool
    """True when the corrected model chose another plan."""
    plan: Plan
    """The plan to train with: the re-planned one, else the plan that was checked (with
    its prediction corrected when a budget was given)."""

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes


def check_plan(
    result: PlanResult,
    measured_peak_bytes: float,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> PlanCheck:
    """Closed-loop planning: compare a planned step's measured peak with the prediction.

    Within :data:`RESERVE` of it, or without a budget, the plan stands. Otherwise the step
    memory is corrected by the difference (held all step: what the model did not explain)
    and the plan is solved again from the same profile, once; the plan says so in its
    notes. A correction under which no plan fits the budget keeps the plan, with a note
    and a warning (training state is never touched here). The judgement is
    :func:`planned_step_verdict`'s, what follows it :func:`follow_verdict`'s.

    Example::

        check = check_plan(result, memfit.measure(step).peak_bytes, model, optimizer)
        if check.replanned:
            memfit.remove_plan(model); memfit.apply_plan(model, check.plan)
    """
    verdict = planned_step_verdict(result, measured_peak_bytes)
    return follow_verdict(result, verdict, model, optimizer, stacklevel=4)


def follow_verdict(
    result: PlanResult,
    verdict: FitVerdict,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    stacklevel: int = 3,
) -> PlanCheck:
    """Do what ``verdict`` (of a step under ``result``'s plan) says: keep the plan, or
    solve it again from the same profile with the step memory corrected by the miss
    (:func:`check_plan`). A ``"refuse"`` raises a BudgetError. ``stacklevel``: that of the
    warning given when no corrected plan fits, as :func:`warnings.warn` counts it from here.

    Example::

        check = follow_verdict(result, planned_step_verdict(result, peak), model, optimizer)
    """
    predicted, measured = verdict.predicted_bytes, verdict.measured_bytes
    if verdict.action == "refuse":
        raise BudgetError(
            f"budget {format_bytes(verdict.budget_bytes or 0)} is below the smallest peak any "
            f"plan reaches: the step under the plan with the least peak measured "
            f"{format_bytes(measured)}. Raise the budget, use a smaller micro-batch (more "
            "accumulation steps) or a '*-master' precision."
        )
    if verdict.action == "keep":
        return PlanCheck(predicted, measured, 0.0, False, result.plan)
    miss = verdict.miss_bytes
    said = (
        f"the first planned step peaked at {format_bytes(measured)} against the "
        f"{format_bytes(predicted)} predicted ({verdict.error_fraction:+.1%})"
    )
    try:
        again = _resolved(result, model, optimizer, correction=miss).plan
    except BudgetError as exc:
        note = f"{said}; corrected by that, no plan fits the budget, so this plan is kept: {exc}"
        result.plan.notes.append(note)
        warnings.warn(note, stacklevel=stacklevel)
        return PlanCheck(predicted, measured, 0.0, False, result.plan)
    replanned = not _same_plan(again, result.plan)
    outcome = "re-planned" if replanned else "the same plan still fits"
    again.notes.append(
        f"{said}; the step memory is corrected by "
        f"{'+' if miss > 0 else '-'}{format_bytes(abs(miss))}: {outcome}"
    )
    return PlanCheck(predicted, measured, miss, replanned, again)


#: How many times :func:`verify_plan` measures a plan and makes it again from the miss.
VERIFY_ROUNDS = 3


@dataclass(frozen=True)
class MeasuredPlan:
    """A plan :func:`verify_plan` made and the peak its step measured."""

    result: PlanResult
    peak_bytes: float


def verify_plan(
    result: PlanResult, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> PlanResult:
    """``result`` with its plan's step measured on the example batch, made again from the
    measurement when it missed the prediction, or refused with the numbers.

    The step is one forward and backward under the plan, counted by the allocator
    (:meth:`~memfit.checkpoint.measured_fit.StepRun.peak_bytes`). Within :data:`RESERVE`
    of the prediction, or without a budget, the plan stands with its measured peak. A
    miss either way re-solves from the same profile with the step memory corrected by it
    (an over-prediction gives the memory back to a plan that recomputes less), at most
    :data:`VERIFY_ROUNDS` times; of the plans measured within the budget, the one that
    recomputes least is returned. When none was, the plan without recompute and the least
    plan are measured before a :class:`~memfit.errors.BudgetError` gives the numbers: a
    plan the model bypasses, or whose checkpoints cost more than they free, is never
    returned as fitting. Parameters, gradients, buffers and the random state are left as
    they were.

    Example::

        result = verify_plan(solve_profile(model, profiled, policy, opt, "optimal", "2GiB"),
                             model, opt)
        result.plan.measured_peak_bytes
    """
    if result.measured_peak_bytes is not None:
        return result  # accepted on its measured step already
    run = step_run(model, result.profile, result.memory, result.policy, optimizer)
    if run is None:
        return result
    budget_bytes = result.plan.budget_bytes
    measured: list[MeasuredPlan] = []
    current, correction = result, 0.0
    for _ in range(VERIFY_ROUNDS):
        peak = run.peak_bytes(current.plan)
        measured.append(MeasuredPlan(current, peak))
        verdict = planned_step_verdict(current, peak)
        if verdict.action == "keep":
            break
        correction += verdict.miss_bytes
        try:
            again = _resolved(result, model, optimizer, correction=correction)
        except BudgetError:
            break
        if any(_same_plan(again.plan, done.result.plan) for done in measured):
            break
        current = again
    fitting = [m for m in measured if budget_bytes is None or m.peak_bytes <= budget_bytes]
    if fitting:
        chosen = min(fitting, key=lambda m: m.result.plan.recompute_seconds)
        return _with_measured(chosen.result, chosen.peak_bytes, result.plan)
    assert budget_bytes is not None  # without a budget every step fits
    return _measured_fallback(result, model, optimizer, run, measured)


def _same_plan(a: Plan, b: Plan) -> bool:
    return (a.decisions, a.segments, a.storage) == (b.decisions, b.segments, b.storage)


def _resolved(
    result: PlanResult,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    correction: float = 0.0,
    strategy: str | None = None,
    budget: Budget | str = "same",
) -> PlanResult:
    """``result``'s profile solved again: with the step memory corrected, or another
    strategy or budget."""
    return solve_profile(
        model,
        result.profile,
        result.policy,
        optimizer,
        strategy or result.strategy,
        result.budget if budget == "same" else budget,
        result.accumulation_steps,
        frontier=False,
        correction_bytes=correction,
        layout=result.layout,
        zero_grad=result.zero_grad,
        activation_storage=result.activation_storage,
        storage_tolerance=result.storage_tolerance,
    )


def _with_measured(chosen: PlanResult, peak: float, first: Plan) -> PlanResult:
    """``chosen`` with its measured peak in the result and in the plan (and the first
    plan's frontier, which a re-plan leaves out)."""
    plan_ = chosen.plan
    predicted = plan_.predicted_peak_bytes
    error = (peak - predicted) / predicted if predicted else 0.0
    plan_ = dataclasses.replace(
        plan_,
        measured_peak_bytes=peak,
        frontier=plan_.frontier if len(plan_.frontier) > 1 else first.frontier,
        notes=[
            *plan_.notes,
            f"verified: the step measured {format_bytes(peak)} on the example batch "
            f"(predicted {format_bytes(predicted)}, {error:+.1%})",
        ],
    )
    return dataclasses.replace(chosen, plan=plan_, measured_peak_bytes=peak)


def _measured_fallback(
    result: PlanResult,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    run: StepRun,
    measured: list[MeasuredPlan],
) -> PlanResult:
    """No plan made from the prediction measured within the budget: the plan without
    recompute (checkpoints can cost more than they free), then the least plan, each
    measured; the first within the budget is the plan, else a BudgetError with the
    numbers."""
    budget_bytes = float(result.plan.budget_bytes or 0.0)
    tried = [
        f"{format_bytes(m.result.plan.predicted_peak_bytes)} predicted, "
        f"{format_bytes(m.peak_bytes)} measured"
        for m in measured
    ]
    if parse_strategy(result.strategy)[0] != "optimal":
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} was not met by the '{result.strategy}' plan "
            f"measured on the example batch ({'; '.join(tried)}): use strategy 'optimal', "
            "raise the budget or use a smaller micro-batch"
        )
    unplanned = _resolved(result, model, optimizer, strategy="none", budget=None)
    peak = run.peak_bytes(unplanned.plan)
    if peak <= budget_bytes:
        unplanned.plan.notes.append(
            "the plans made for the budget measured over it; the step without recompute "
            "measured within it"
        )
        return _with_measured(unplanned, peak, result.plan)
    tried.append(f"{format_bytes(peak)} measured without recompute")
    root = cost_tree(
        model,
        result.profile,
        result.policy,
        result.accumulation_steps,
        result.layout,
        result.memory.released_by_param if result.zero_grad == "in_backward" else None,
        result.memory.forward_offset_bytes,
    )
    least = measured_least_plan(run, root, result.strategy, budget_bytes, frontier=False)
    if least is not None:
        if least.verdict.fits:
            return result_of_solution(
                least.solution,
                least,
                root=root,
                mem=result.memory,
                profiled=result.profile,
                policy=result.policy,
                strategy=result.strategy,
                budget=result.budget,
                budget_bytes=budget_bytes,
                accumulation_steps=result.accumulation_steps,
                layout=result.layout,
                zero_grad=result.zero_grad,
                activation_storage=result.activation_storage,
                storage_tolerance=result.storage_tolerance,
            )
        tried.append(f"{format_bytes(least.measured_peak_bytes)} measured under the least plan")
    raise BudgetError(
        f"budget {format_bytes(budget_bytes)} was not met by any plan measured on the example "
        f"batch (the allocator's count of one forward and backward): {'; '.join(tried)}. The "
        "plan does not lower the peak as predicted: raise the budget, use a smaller "
        "micro-batch (more accumulation steps) or a '*-master' precision; "
        "memfit.plan(..., verify=False) returns the predicted plan unmeasured."
    )
