"""Plan activation checkpointing for a training step: one composer, stages in one order.

    profile  ->  step memory  ->  solve  ->  Plan

1. **profile** (:mod:`memfit.checkpoint.profile_stage`): one instrumented step and a
   few timed ones under the training precision give each unit's costs
   (:mod:`memfit.checkpoint.profiler`), cut down to the model's own units.
2. **step memory** (:func:`memfit.checkpoint.step_memory.step_memory`): what the step holds
   whatever the plan: weights, gradients, optimizer state, the loss's tensors.
3. **solve** (:func:`memfit.checkpoint.solvers.solve`): the plan with the least recompute
   whose predicted peak fits the budget, less :data:`RESERVE`.
4. **Plan**: decisions, segments and the predicted peak, ready for ``apply_plan``.

:func:`make_plan` runs them in that order from plain arguments and returns a
:class:`PlanResult`; :func:`plan` (``memfit.plan``) is the public front, taking the step as
the Engine, ``memfit.estimate`` and ``memfit.tune`` do: ``plan(model, batch, loss_fn,
budget=..., ...)`` with ``loss_fn(model, batch) -> loss``. Nothing here knows about the
Engine: it passes what it holds.

Example::

    result = make_plan(model, batch, loss_fn, optimizer=optimizer, precision="bf16-mixed",
                       strategy="optimal", budget="2GiB", accumulation_steps=4)
    print(result.plan.summary())
    memfit.apply_plan(model, result.plan)
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.checkpoint.measured_fit import (
    FitVerdict,
    MeasuredFit,
    StepRun,
    judge_fit,
    measured_plan,
    measured_within_reserve,
)
from memfit.checkpoint.old_calls import PLAN_ORDER, PLAN_STEP_ORDER, by_position, takes_output
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.profile_stage import ModelProfile, profile_model, profile_step
from memfit.checkpoint.profiler.runner import default_loss
from memfit.checkpoint.solvers import FrontierPoint, parse_strategy, plan_cost, solve
from memfit.checkpoint.solvers.frontier import pareto
from memfit.checkpoint.step_memory import (
    RankLayout,
    StepMemory,
    step_memory,
    with_backward_costs,
)
from memfit.deprecations import warn_renamed
from memfit.errors import BudgetError, ConfigError
from memfit.nested import call_model
from memfit.precision.kernels import module_device
from memfit.precision.mode_timing import auto_choice
from memfit.precision.policy import PrecisionPolicy, is_auto
from memfit.units import format_bytes, parse_bytes

#: Share of the budget kept free when planning: the allocator's slack and the temporaries
#: of backward the cost model leaves out.
RESERVE = 0.02

Budget = str | int | float | None
"""A step's peak memory: "2GiB", bytes, a fraction of device memory, or None (no limit)."""


@dataclass(frozen=True)
class PlanResult:
    """What :func:`make_plan` made: the plan and the stages' results it came from."""

    plan: Plan
    """The plan (decisions, segments, predicted peak), ready for ``apply_plan``."""
    profile: ModelProfile
    """Stage 1: the model's measured costs."""
    memory: StepMemory
    """Stage 2: what the step holds whatever the plan."""
    policy: PrecisionPolicy = dataclasses.field(default_factory=PrecisionPolicy)
    """The precision it was planned under."""
    strategy: str = "optimal"
    """The strategy it was planned with."""
    budget: Budget = None
    """The budget it was planned under (None: no limit)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step it was planned for."""
    measured_peak_bytes: float | None = None
    """Set when the budget was accepted on the plan's measured step rather than on the
    prediction (:mod:`memfit.checkpoint.measured_fit`): what that step measured."""
    measured_is_least: bool = False
    """The plan accepted on its measured step is the least any plan reaches: the Engine
    then judges its first training step against the budget itself (over it, nothing
    fits). A plan at the budget's edge is judged as any plan is, and made again when its
    step does not fit."""


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


def _with_floor(points: list[FrontierPoint], floor: float) -> list[FrontierPoint]:
    """``points`` with each peak raised to at least ``floor``, the dominated ones dropped."""
    raised = [(max(p.peak_bytes, floor), p.recompute_seconds, p.recompute_flops) for p in points]
    return [FrontierPoint(peak, s, f) for peak, s, f in pareto(raised)]


def _unstable_notes(unstable: dict[str, str]) -> list[str]:
    """One note per reason, naming the units it holds for (a decoder's layers share one)."""
    by_reason: dict[str, list[str]] = {}
    for name, why in unstable.items():
        by_reason.setdefault(why, []).append(name)
    return [f"never recomputed: {', '.join(names)}; {why}" for why, names in by_reason.items()]


def solve_profile(
    model: nn.Module,
    profiled: ModelProfile,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    strategy: str,
    budget: Budget,
    accumulation_steps: int = 1,
    frontier: bool = True,
    correction_bytes: float = 0.0,
    layout: RankLayout | None = None,
) -> PlanResult:
    """Stages 2-4: the step's memory, the solve, the Plan with its predicted peak.

    ``frontier=False`` leaves out the plan's (peak, time) frontier, which takes most of
    the solve's time on trees of hundreds of units. ``correction_bytes``: memory the step
    was measured to hold beyond (or, negative, below) the model, counted as held all step
    (:func:`check_plan`). ``layout``: plan one rank of a data-parallel run (its share of
    the weights, gradients and optimizer state; :class:`RankLayout`)."""
    model = unwrap_compiled(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    budget_bytes = None if budget is None else parse_bytes(budget, device)
    mem = step_memory(
        model,
        profiled.profile,
        policy,
        optimizer,
        profiled.output_bytes,
        profiled.loss_saved_bytes,
        profiled.root,
        accumulation_steps=accumulation_steps,
        output_held=profiled.output_held,
        layout=layout,
    )
    if profiled.workspace_bytes:
        # Kernels' own workspace: where in the step is not known, so all of it counts.
        mem = dataclasses.replace(
            mem,
            base_bytes=mem.base_bytes + profiled.workspace_bytes,
            workspace_bytes=profiled.workspace_bytes,
        )
    if correction_bytes:
        mem = dataclasses.replace(
            mem,
            base_bytes=max(0.0, mem.base_bytes + correction_bytes),
            correction_bytes=float(correction_bytes),
        )
    optimizer_phase = mem.optimizer_phase_bytes
    if budget_bytes is not None and optimizer_phase > budget_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below what the optimizer step alone holds, "
            f"{format_bytes(optimizer_phase)} (parameters, gradients, optimizer state and the "
            "step's temporaries): no "
            "checkpoint plan can fit it. Raise the budget, use a '*-master' precision or a "
            "smaller optimizer state, or shard the model."
        )
    root = with_backward_costs(
        profiled.root, model, policy, accumulating=accumulation_steps > 1, layout=layout
    )
    held = mem.held_bytes
    # Plans fit within 1 - RESERVE of the budget; errors name the budget that would fit.
    measured_fit: MeasuredFit | None = None
    optimal = budget_bytes is not None and parse_strategy(strategy)[0] == "optimal"
    run = _step_run(model, profiled, mem, policy, optimizer) if optimal else None
    try:
        # With a step to measure, the solve also finds the plan within the budget itself
        # (its ``edge``), which a measurement may accept in place of the reserve.
        solution = solve(
            root,
            strategy,
            budget_bytes,
            held,
            mem.loss_bytes,
            reserve=RESERVE,
            frontier=frontier,
            edge=run is not None,
        )
    except BudgetError as exc:
        if run is None:
            raise
        # A budget the prediction with its reserve cannot decide is decided by measuring:
        # the plan predicted within the budget itself, then the least plan.
        fit = measured_plan(run, root, strategy, budget_bytes, frontier=frontier)
        if fit is None:
            raise exc from None
        if not fit.verdict.fits:
            raise BudgetError(
                f"{exc} Measured, the least plan's step peaked at "
                f"{format_bytes(fit.measured_peak_bytes)} ({fit.measured_peak_bytes:.0f} "
                "bytes; the allocator's count of one forward and backward on the example "
                "batch), over the budget too."
            ) from None
        solution, measured_fit = fit.solution, fit
    else:
        if run is not None:
            # Between the budget less the reserve and the budget may lie a plan that
            # recomputes less: its measured step decides, not the reserve.
            cheaper = measured_within_reserve(run, solution, budget_bytes)
            if cheaper is not None:
                solution, measured_fit = cheaper.solution, cheaper
    # The solver plans without crediting checkpoint inputs that the kept unit before them
    # already saves (a bound); the prediction counts them once.
    counted = plan_cost(
        root, solution.decisions, solution.segments, held, mem.loss_bytes, shared_inputs=True
    )
    predicted = max(counted.peak_bytes, optimizer_phase)
    note = solution.note
    if note and budget_bytes is not None and solution.recompute_flops == 0:
        # The solver's note speaks of activations only; say it with the whole step's peak.
        note = (
            f"budget {format_bytes(budget_bytes)} is at or above the step's predicted peak "
            f"without checkpointing, {format_bytes(predicted)} (memfit "
            f"plans within {1 - RESERVE:.0%} of the budget): nothing is recomputed"
        )
    # A new Solution: the solver's (and a MeasuredFit's) stays as the solver made it.
    solution = dataclasses.replace(
        solution,
        budget_bytes=budget_bytes,
        static_bytes=held,
        kept_bytes=counted.kept_bytes,
        transient_bytes=counted.transient_bytes,
        predicted_peak_bytes=predicted,
        # The solver's frontier is the activation phase's; the step's peak is never below
        # the optimizer step's, so the plan's frontier says that too (and agrees with its
        # peak).
        frontier=_with_floor(solution.frontier, optimizer_phase),
        note=note,
    )
    plan_ = Plan.from_solution(solution, precision=policy.mode, structure=profiled.structure)
    if measured_fit is not None:
        which = "the least plan's" if measured_fit.least else "the plan's"
        plan_.notes.append(
            f"budget {format_bytes(budget_bytes)} is below {which} predicted peak, "
            f"{format_bytes(solution.predicted_peak_bytes)}, with the {RESERVE:.0%} reserve; "
            f"its step measured {format_bytes(measured_fit.measured_peak_bytes)} (the "
            "allocator's count of one "
            "forward and backward on the example batch), within it: planned with it"
        )
    plan_.notes.extend(profiled.notes)
    plan_.notes.extend(_unstable_notes(profiled.unstable))
    return PlanResult(
        plan=plan_,
        profile=profiled,
        memory=mem,
        policy=policy,
        strategy=strategy,
        budget=budget,
        accumulation_steps=accumulation_steps,
        measured_peak_bytes=measured_fit.measured_peak_bytes if measured_fit else None,
        measured_is_least=bool(measured_fit and measured_fit.least),
    )


def _step_run(
    model: nn.Module,
    profiled: ModelProfile,
    mem: StepMemory,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
) -> StepRun | None:
    """What a measured plan (:mod:`memfit.checkpoint.measured_fit`) runs: the profiled
    step, its structure, the output a loop holds and what the optimizer steps; None
    without a step to run."""
    if profiled.run_loss is None:
        return None
    return StepRun(
        model,
        mem,
        policy,
        profiled.run_loss,
        profiled.structure,
        held_output_bytes=profiled.output_bytes if profiled.output_held else 0.0,
        optimizer_params=(
            [p for g in optimizer.param_groups for p in g["params"]] if optimizer else None
        ),
    )


def planned_step_verdict(
    result: PlanResult,
    measured_peak_bytes: float,
    least_plan_budget: float | None = None,
) -> FitVerdict:
    """:func:`~memfit.checkpoint.measured_fit.judge_fit` on a step under ``result``'s plan,
    in the planner's terms: the measurement confirms the prediction within
    :data:`RESERVE` of it, and a plan solved under a budget is made again when it does not
    (one solved without a budget has nothing to re-plan for: the budget alone is judged).

    ``least_plan_budget``: a budget the measured plan must meet although it was not solved
    under it, being the least any plan reaches (the Engine's ``full`` fallback, or a plan
    accepted on its measured step); a step over it gets ``"refuse"``.

    Example::

        verdict = planned_step_verdict(result, peak.peak_bytes)
        verdict.action   # "keep" or "replan"
    """
    plan_ = result.plan
    least_plan = least_plan_budget is not None
    return judge_fit(
        plan_.predicted_peak_bytes,
        measured_peak_bytes,
        least_plan_budget if least_plan else plan_.budget_bytes,
        tolerance=RESERVE if result.budget is not None else None,
        least_plan=least_plan,
    )


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
        again = solve_profile(
            model,
            result.profile,
            result.policy,
            optimizer,
            result.strategy,
            result.budget,
            result.accumulation_steps,
            frontier=False,
            correction_bytes=miss,
        ).plan
    except BudgetError as exc:
        note = f"{said}; corrected by that, no plan fits the budget, so this plan is kept: {exc}"
        result.plan.notes.append(note)
        warnings.warn(note, stacklevel=stacklevel)
        return PlanCheck(predicted, measured, 0.0, False, result.plan)
    replanned = (again.decisions, again.segments) != (result.plan.decisions, result.plan.segments)
    outcome = "re-planned" if replanned else "the same plan still fits"
    again.notes.append(
        f"{said}; the step memory is corrected by "
        f"{'+' if miss > 0 else '-'}{format_bytes(abs(miss))}: {outcome}"
    )
    return PlanCheck(predicted, measured, miss, replanned, again)


def resolve_policy(
    precision: str | PrecisionPolicy | None,
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
) -> tuple[PrecisionPolicy, tuple[str, ...]]:
    """The policy to plan under and a note on how it was chosen: ``"auto"`` is measured
    as the Engine measures it on its first micro-batch
    (:func:`~memfit.precision.mode_timing.auto_choice`), so a plan made alone is made for the
    mode training will choose; a mode or a policy is taken as given (None is fp32).

    Example::

        policy, notes = resolve_policy("auto", model, batch, loss_fn)   # fp32 on AVX2 only
    """
    if not is_auto(precision):
        return PrecisionPolicy.of(precision), ()
    choice = auto_choice(unwrap_compiled(model), batch, loss_fn, module_device(model))
    return PrecisionPolicy(choice.mode), (choice.describe(),)


def make_plan(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str | PrecisionPolicy | None = "auto",
    strategy: str = "optimal",
    budget: Budget = None,
    accumulation_steps: int = 1,
    units: Sequence[str] | None = None,
    frontier: bool = True,
    world_size: int = 1,
    data_parallel: str | None = None,
) -> PlanResult:
    """Plan a training step ``loss_fn(model, batch)``: profile -> step memory -> solve.

    ``batch`` is one micro-batch as training feeds it; ``accumulation_steps`` the
    micro-batches per optimizer step (above 1, the gradients of the earlier ones are held
    while the last one runs). ``budget`` is the peak of the whole step; None plans without
    a limit. Raises :class:`~memfit.errors.BudgetError` when no plan fits.
    ``world_size`` and ``data_parallel`` (``"ddp"``, ``"fsdp"``): plan one rank's step
    under a per-device ``budget`` (``batch`` is then that rank's micro-batch).

    Example::

        result = make_plan(model, batch, loss_fn, optimizer=opt, precision="bf16-mixed",
                           budget="2GiB", accumulation_steps=4)
        memfit.apply_plan(model, result.plan)
    """
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    policy, chosen = resolve_policy(precision, model, batch, loss_fn)
    profiled = profile_step(model, batch, loss_fn, policy, units)
    profiled = dataclasses.replace(profiled, notes=(*profiled.notes, *chosen))
    layout = RankLayout.of(world_size, data_parallel)
    return solve_profile(
        model,
        profiled,
        policy,
        optimizer,
        strategy,
        budget,
        int(accumulation_steps),
        frontier,
        layout=layout,
    )


def default_step_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of a step when none is given: the sum of the first floating-point tensor
    of the model's output, the model called on ``batch`` as
    :func:`~memfit.nested.call_model` calls it (``model(x)``, ``model(*x)``,
    ``model(**x)``).

    Example::

        loss = default_step_loss(model, {"input_ids": ids, "labels": ids})  # out.loss
    """
    return default_loss(call_model(model, batch))


def plan(
    model: nn.Module,
    batch: Any = None,
    *positional: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    budget: Budget = None,
    strategy: str = "optimal",
    precision: str | PrecisionPolicy | None = "auto",
    optimizer: torch.optim.Optimizer | None = None,
    units: Sequence[str] | None = None,
    accumulation_steps: int = 1,
    frontier: bool = True,
    keep_output: bool | None = None,
    world_size: int = 1,
    data_parallel: str | None = None,
    example_inputs: Any = None,
) -> Plan:
    """Profile a training step ``loss_fn(model, batch)`` under ``precision`` and plan its
    activation checkpointing under ``budget``.

    Called ``plan(model, batch, loss_fn, budget=..., ...)``: ``loss_fn`` by position (the
    third argument) or keyword, every setting by keyword. ``batch``: one micro-batch as training feeds it (the Engine's ``train_step(batch,
    loss_fn)`` form). ``loss_fn(model, batch) -> scalar``, as the Engine,
    ``memfit.estimate`` and ``memfit.tune`` take it; None: the sum of the first
    floating-point tensor of ``model(batch)`` (a dict is passed as keywords, a tuple as
    positional arguments). ``budget`` is the peak of a whole training step ("2GiB",
    bytes, or a fraction of device memory); None plans without a limit (``optimal`` then
    recomputes nothing). ``strategy``: ``optimal``, ``none``, ``full``, ``uniform:K`` or
    ``sqrt``. ``optimizer``: its state is counted (none without it).
    ``accumulation_steps``: micro-batches per optimizer step. ``units``: the candidate
    units (qualified names) instead of those ``find_units`` finds. ``frontier=False``
    leaves out the (peak, time) frontier, most of the solve's time on large trees.
    ``keep_output`` (with ``loss_fn=None`` only): the training loop holds the model's
    output through backward (``out = model(x); loss(out).backward()``, the default);
    False for a loop that keeps only the loss. ``world_size`` and ``data_parallel``
    (``"ddp"``, ``"fsdp"``): plan one rank of a data-parallel run under a per-device
    budget (docs/distributed.md). Raises :class:`~memfit.errors.BudgetError` when no plan
    fits.

    Kept for one release, each with a DeprecationWarning: a ``loss_fn(output)`` (a
    function of one required positional parameter,
    :func:`~memfit.checkpoint.old_calls.takes_output`), the settings
    by position in the old orders (``plan(model, x, budget, strategy, loss_fn, ...)``,
    ``plan_step(model, batch, loss_fn, budget, strategy, ...)``) and ``example_inputs=``
    (now ``batch``).

    Example::

        plan = memfit.plan(model, batch, gpt_loss, budget="1GiB", precision="bf16-mixed")
        memfit.apply_plan(model, plan)
    """
    settings: dict[str, Any] = dict(
        loss_fn=loss_fn,
        budget=budget,
        strategy=strategy,
        precision=precision,
        optimizer=optimizer,
        units=units,
        accumulation_steps=accumulation_steps,
        frontier=frontier,
        keep_output=keep_output,
        world_size=world_size,
        data_parallel=data_parallel,
    )
    if example_inputs is not None:
        if batch is not None:
            raise TypeError("memfit.plan() got batch and example_inputs (its old name): pass batch")
        warn_renamed("memfit.plan(example_inputs=...)", "memfit.plan(model, batch, ...)")
        batch = example_inputs
    if batch is None:
        raise TypeError("memfit.plan() needs a batch: memfit.plan(model, batch, loss_fn, ...)")
    if positional:
        first, rest = positional[0], positional[1:]
        if callable(first) or (first is None and not rest):  # loss_fn, as it now is
            if loss_fn is not None:
                raise TypeError("memfit.plan() got multiple values for argument 'loss_fn'")
            settings["loss_fn"] = first
            order, values = PLAN_STEP_ORDER, rest  # any more: plan_step's old order
        else:  # memfit.plan's old order: budget, strategy, loss_fn, ...
            order, values = PLAN_ORDER, positional
        if values:
            defaults = {n: p.default for n, p in inspect.signature(plan).parameters.items()}
            settings = by_position(order, values, settings, defaults, "memfit.plan()")
            warn_renamed(
                f"passing memfit.plan's settings by position ({', '.join(order[: len(values)])})",
                f"keywords: memfit.plan(model, batch, loss_fn, {order[0]}=..., ...)",
            )
    loss_fn = settings.pop("loss_fn")
    if loss_fn is not None and takes_output(loss_fn):
        warn_renamed(
            "memfit.plan with loss_fn(output)",
            "loss_fn(model, batch) -> loss, the form the Engine, memfit.estimate and "
            "memfit.tune take (e.g. lambda model, batch: model(**batch).loss), or no loss_fn "
            "for the sum of the output",
        )
        return _plan_on_output(model, batch, loss_fn, **settings)
    if loss_fn is None:
        return _plan_on_output(model, batch, None, **settings)
    return _plan_step(model, batch, loss_fn, **settings)


def _plan_on_output(
    model: nn.Module,
    batch: Any,
    output_loss: Callable[[Any], torch.Tensor] | None,
    *,
    keep_output: bool | None,
    precision: str | PrecisionPolicy | None,
    units: Sequence[str] | None,
    accumulation_steps: int,
    world_size: int,
    data_parallel: str | None,
    **solve_settings: Any,
) -> Plan:
    """:func:`plan` of ``output_loss(model(batch))`` (default: the sum of the output), the
    model profiled alone with its output held through backward unless ``keep_output`` is
    False."""
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    loss_of = output_loss or default_loss
    policy, chosen = resolve_policy(precision, model, batch, lambda m, x: loss_of(call_model(m, x)))
    held = True if keep_output is None else keep_output
    profiled = profile_model(model, batch, output_loss, policy, units, held)
    profiled = dataclasses.replace(profiled, notes=(*profiled.notes, *chosen))
    return solve_profile(
        model,
        profiled,
        policy,
        solve_settings["optimizer"],
        solve_settings["strategy"],
        solve_settings["budget"],
        int(accumulation_steps),
        solve_settings["frontier"],
        layout=RankLayout.of(world_size, data_parallel),
    ).plan


def _plan_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    keep_output: bool | None,
    **settings: Any,
) -> Plan:
    """:func:`plan` of a step ``loss_fn(model, batch)``: :func:`make_plan`'s plan."""
    if keep_output is not None:
        raise ConfigError(
            "keep_output applies to memfit.plan without a loss_fn (the output's sum): a "
            "loss_fn(model, batch) is profiled with the model, so what it holds of the "
            "output is measured; drop keep_output"
        )
    return make_plan(model, batch, loss_fn, **settings).plan


def plan_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *positional_settings: Any,
    **settings: Any,
) -> Plan:
    """Deprecated: ``memfit.plan(model, batch, loss_fn, budget=..., ...)`` is the same plan.

    Example::

        plan = memfit.plan(model, batch, gpt_loss, budget="1GiB", precision="bf16-mixed")
    """
    warn_renamed(
        "memfit.checkpoint.plan_step", "memfit.plan(model, batch, loss_fn, budget=..., ...)"
    )
    named = by_position(PLAN_STEP_ORDER, positional_settings, settings, {}, "plan_step()")
    named.setdefault("keep_output", None)
    return _plan_step(model, batch, loss_fn, **named)
