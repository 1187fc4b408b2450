"""Plan activation checkpointing for a training step: one composer, stages in one order.

    profile  ->  step memory  ->  solve  ->  Plan

1. **profile** (:func:`profile_step`, :func:`profile_model`): one instrumented step and a
   few timed ones under the training precision give each unit's costs
   (:mod:`memfit.checkpoint.profiler`), cut down to the model's own units.
2. **step memory** (:func:`memfit.checkpoint.step_memory.step_memory`): what the step holds
   whatever the plan: weights, gradients, optimizer state, the loss's tensors.
3. **solve** (:func:`memfit.checkpoint.solvers.solve`): the plan with the least recompute
   whose predicted peak fits the budget, less :data:`RESERVE`.
4. **Plan**: decisions, segments and the predicted peak, ready for ``apply_plan``.

:func:`make_plan` runs them in that order from plain arguments and returns a
:class:`PlanResult`; ``memfit.plan`` (a model and a loss of its output) and
:func:`plan_step` (a step written ``loss_fn(model, batch)``, the Engine's form) are thin
fronts to it. Nothing here knows about the Engine: it passes what it holds.

Example::

    result = make_plan(model, batch, loss_fn, optimizer=optimizer, precision="bf16-mixed",
                       strategy="optimal", budget="2GiB", accumulation_steps=4)
    print(result.plan.summary())
    memfit.apply_plan(model, result.plan)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.apply import suspended
from memfit.checkpoint.compiled import unwrap_compiled
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.measured_fit import MeasuredFit, measured_least_plan
from memfit.checkpoint.native import prepare_for_plan
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.probe import probe_units
from memfit.checkpoint.profiler import Profile, profile
from memfit.checkpoint.profiler.runner import default_loss
from memfit.checkpoint.solvers import FrontierPoint, evaluate, parse_strategy, solve
from memfit.checkpoint.solvers.frontier import pareto
from memfit.checkpoint.step_memory import (
    RankLayout,
    StepMemory,
    step_memory,
    with_backward_costs,
)
from memfit.checkpoint.tree import find_units, structure_fingerprint
from memfit.checkpoint.workspace import kernel_workspace_bytes
from memfit.errors import BudgetError, ConfigError, PlanError
from memfit.nested import call_model
from memfit.precision.apply import precision_applied
from memfit.precision.kernels import module_device
from memfit.precision.policy import PrecisionPolicy, is_auto
from memfit.precision.timing import auto_choice
from memfit.units import format_bytes, parse_bytes

#: Share of the budget kept free when planning: the allocator's slack and the temporaries
#: of backward the cost model leaves out.
RESERVE = 0.02

Budget = str | int | float | None
"""A step's peak memory: "2GiB", bytes, a fraction of device memory, or None (no limit)."""


@dataclass(frozen=True)
class ModelProfile:
    """A profiled training step, cut down to the model's own units (stage 1)."""

    profile: Profile
    """The whole profiled step (for a step, the model and its loss as one module)."""
    root: UnitCost
    """The model's unit tree; names relative to the model (``""`` is the model)."""
    structure: list[tuple[str, str]]
    """``structure_fingerprint`` of the model's units, for the plan to recognize it."""
    output_bytes: float
    """Held from the end of forward until the loss's backward: the model's output (and,
    for a step, the loss module's)."""
    loss_saved_bytes: float
    """What the loss saves for backward outside the model."""
    output_held: bool = True
    """Whether the model's output is held through backward (``out = model(x)``), or freed
    once the loss is computed (a step written ``loss_fn(model, batch)``)."""
    workspace_bytes: float = 0.0
    """What kernels allocate for themselves at the step's peak, which no dispatch-level
    count sees (a CPU convolution's unfold buffers): the allocator's peak of one step less
    the storage tracker's (:func:`kernel_workspace_bytes`)."""
    unstable: dict[str, str] = dataclasses.field(default_factory=dict)
    """Units left out of every plan because their forward does other work when run again
    (:mod:`memfit.checkpoint.probe`), each with the reason; plans say so in their notes."""
    run_loss: Callable[[], torch.Tensor] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )
    """Computes the profiled step's loss again (the example batch it holds): the planner
    measures a plan with it when the prediction cannot decide a budget
    (:mod:`memfit.checkpoint.measured_fit`)."""
    notes: tuple[str, ...] = ()
    """What profiling changed that plans must say (the model's own gradient checkpointing
    turned off: :mod:`memfit.checkpoint.native`)."""


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
    """Set when the budget was accepted on the least plan's measured step rather than on
    the prediction (:mod:`memfit.checkpoint.measured_fit`): what that step measured. The
    Engine then judges its first training step against the budget itself."""


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


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    policy: PrecisionPolicy,
    units: Sequence[str] | None = None,
    keep_output: bool = True,
) -> ModelProfile:
    """Stage 1 for a model called on ``example_inputs``, with ``loss_fn(output)``;
    ``keep_output``: the training loop holds the output through backward."""
    model = unwrap_compiled(model)
    native = prepare_for_plan(model)
    with precision_applied(model, policy):
        prof = profile(model, example_inputs, loss_fn=loss_fn, precision=policy, units=units)
        profiled = ModelProfile(
            profile=prof,
            root=prof.root,
            structure=prof.structure,
            output_bytes=float(prof.output_bytes),
            loss_saved_bytes=float(prof.loss_saved_bytes),
            output_held=keep_output,
            notes=native,
        )
        loss_of = loss_fn or default_loss
        return _probed(
            model,
            profiled,
            policy,
            forward=lambda: call_model(model, example_inputs),
            loss=lambda: loss_of(call_model(model, example_inputs)),
            inputs=example_inputs,
        )


def _probed(
    model: nn.Module,
    profiled: ModelProfile,
    policy: PrecisionPolicy,
    forward: Callable[[], Any],
    loss: Callable[[], torch.Tensor],
    inputs: Any,
) -> ModelProfile:
    """``profiled`` with what the profile's own step cannot tell: the units that do other
    work when run again and each unit's forward workspace (:func:`_without_unstable`),
    and the kernels' workspace of a whole step (:func:`kernel_workspace_bytes`). Runs
    under the precision the profile ran under."""
    profiled = _without_unstable(model, profiled, forward, policy)
    workspace = kernel_workspace_bytes(model, loss, policy, inputs)
    return dataclasses.replace(profiled, workspace_bytes=float(workspace), run_loss=loss)


def _without_unstable(
    model: nn.Module,
    profiled: ModelProfile,
    run_forward: Callable[[], Any],
    policy: PrecisionPolicy,
) -> ModelProfile:
    """``profiled`` with the units whose forward does other work when run again (state
    kept between calls, e.g. a key/value cache) marked as not recomputable, with the
    reason in ``profile.reasons``, and each other unit's forward workspace (what a kernel
    of its rebuild holds for itself; :mod:`memfit.checkpoint.probe`)."""
    names = [u.name for u in profiled.root.walk() if u.name and u.can_recompute]
    device = next((p.device.type for p in model.parameters()), "cpu")
    with suspended(model):
        probed = probe_units(
            model,
            run_forward,
            names,
            autocast=(device, policy.compute_dtype, policy.mixed),
            workspace=True,
        )
    found = probed.unstable
    for name, why in found.items():
        profiled.profile.reasons.setdefault(name, []).append(why)

    def mark(unit: UnitCost) -> UnitCost:
        children = [mark(c) for c in unit.children]
        stable = unit.can_recompute and unit.name not in found
        return dataclasses.replace(
            unit,
            children=children,
            can_recompute=stable,
            forward_workspace_bytes=float(probed.forward_workspace.get(unit.name, 0)),
        )

    return dataclasses.replace(profiled, root=mark(profiled.root), unstable=found)


class _StepModule(nn.Module):
    """The model and the engine's loss as one module, so a whole micro-step can be profiled."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self._loss_fn(self.model, batch)


def _strip_prefix(unit: UnitCost, prefix: str) -> UnitCost:
    name = unit.name[len(prefix) :] if unit.name.startswith(prefix) else ""
    children = [_strip_prefix(c, prefix) for c in unit.children]
    return dataclasses.replace(unit, name=name, children=children)


def profile_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    policy: PrecisionPolicy,
    units: Sequence[str] | None = None,
) -> ModelProfile:
    """Stage 1 for a step written ``loss_fn(model, batch)``: the model and the loss are
    profiled as one module, then the model's units are cut out of it. ``units``: the
    candidate units (qualified names) instead of those ``find_units`` finds. A compiled
    model is profiled uncompiled: ``loss_fn`` is given the module inside
    ``torch.compile``'s wrapper."""
    model = unwrap_compiled(model)
    native = prepare_for_plan(model)
    if units is not None:
        names = ["", *dict.fromkeys(n for n in units if n)]  # the model is always one
    else:
        names = find_units(model).names()
    step_module = _StepModule(model, loss_fn)
    prefixed = ["model" if not n else f"model.{n}" for n in names]
    with precision_applied(model, policy):
        prof = profile(
            step_module,
            (batch,),
            loss_fn=lambda loss: loss,
            precision=policy,
            units=["", *prefixed],
        )
        model_root = next((c for c in prof.root.children if c.name == "model"), None)
        if model_root is None:
            raise PlanError("profiling did not see the model run; loss_fn must call the model")
        # The loss outside the model saves its own tensors (e.g. fp32 logits), and the
        # model's output lives until the loss's backward: neither can be recomputed.
        profiled = ModelProfile(
            profile=prof,
            root=_strip_prefix(model_root, "model."),
            structure=structure_fingerprint(model, names),
            output_bytes=float(prof.output_bytes + model_root.output_bytes),
            loss_saved_bytes=float(prof.loss_saved_bytes + prof.root.own_saved_bytes),
            output_held=False,  # loss_fn returns the loss: the output it made is its own
            notes=native,
        )

        def step() -> torch.Tensor:  # the probe runs its forward, the workspace all of it
            return loss_fn(model, batch)

        return _probed(model, profiled, policy, forward=step, loss=step, inputs=batch)


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
    try:
        solution = solve(
            root, strategy, budget_bytes, held, mem.loss_bytes, reserve=RESERVE, frontier=frontier
        )
    except BudgetError as exc:
        if budget_bytes is None or parse_strategy(strategy)[0] != "optimal":
            raise
        # The prediction is an upper bound only within the reserve (it has run 3% low on a
        # ResNet): a budget it cannot decide is decided by measuring the least plan's step.
        fit = _measured_fit(
            model, profiled, root, mem, policy, strategy, budget_bytes, frontier, optimizer
        )
        if fit is None:
            raise exc from None
        solution, measured_fit = fit.solution, fit
    solution.budget_bytes = budget_bytes
    # The solver plans without crediting checkpoint inputs that the kept unit before them
    # already saves (a bound); the prediction counts them once.
    result = evaluate(
        root, solution.decisions, solution.segments, held, mem.loss_bytes, shared_inputs=True
    )
    solution.static_bytes = held
    solution.kept_bytes = result.kept_bytes
    solution.transient_bytes = result.transient_bytes
    solution.predicted_peak_bytes = max(result.peak_bytes, optimizer_phase)
    # The solver's frontier is the activation phase's; the step's peak is never below the
    # optimizer step's, so the plan's frontier says that too (and agrees with its peak).
    solution.frontier = _with_floor(solution.frontier, optimizer_phase)
    if solution.note and budget_bytes is not None and solution.recompute_flops == 0:
        # The solver's note speaks of activations only; say it with the whole step's peak.
        solution.note = (
            f"budget {format_bytes(budget_bytes)} is at or above the step's predicted peak "
            f"without checkpointing, {format_bytes(solution.predicted_peak_bytes)} (memfit "
            f"plans within {1 - RESERVE:.0%} of the budget): nothing is recomputed"
        )
    plan_ = Plan.from_solution(solution, precision=policy.mode, structure=profiled.structure)
    if measured_fit is not None:
        plan_.notes.append(
            f"budget {format_bytes(budget_bytes)} is below the least plan's predicted peak, "
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
    )


def _measured_fit(
    model: nn.Module,
    profiled: ModelProfile,
    root: UnitCost,
    mem: StepMemory,
    policy: PrecisionPolicy,
    strategy: str,
    budget_bytes: float,
    frontier: bool,
    optimizer: torch.optim.Optimizer | None,
) -> MeasuredFit | None:
    """The least plan, when the prediction refuses the budget but its measured step fits."""
    if profiled.run_loss is None:
        return None
    return measured_least_plan(
        model,
        root,
        mem,
        policy,
        strategy,
        budget_bytes,
        profiled.run_loss,
        profiled.structure,
        held_output_bytes=profiled.output_bytes if profiled.output_held else 0.0,
        frontier=frontier,
        optimizer_params=(
            [p for g in optimizer.param_groups for p in g["params"]] if optimizer else None
        ),
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
    and a warning (training state is never touched here).

    Example::

        check = check_plan(result, memfit.measure(step).peak_bytes, model, optimizer)
        if check.replanned:
            memfit.remove_plan(model); memfit.apply_plan(model, check.plan)
    """
    predicted = float(result.plan.predicted_peak_bytes)
    measured = float(measured_peak_bytes)
    miss = measured - predicted
    if abs(miss) <= RESERVE * predicted or result.budget is None:
        return PlanCheck(predicted, measured, 0.0, False, result.plan)
    said = (
        f"the first planned step peaked at {format_bytes(measured)} against the "
        f"{format_bytes(predicted)} predicted ({miss / predicted:+.1%})"
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
        warnings.warn(note, stacklevel=3)
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
    (:func:`~memfit.precision.timing.auto_choice`), so a plan made alone is made for the
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
    layout = RankLayout(data_parallel, world_size)
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


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: Budget = None,
    strategy: str = "optimal",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    precision: str | PrecisionPolicy | None = "auto",
    optimizer: torch.optim.Optimizer | None = None,
    units: Sequence[str] | None = None,
    accumulation_steps: int = 1,
    keep_output: bool = True,
    world_size: int = 1,
    data_parallel: str | None = None,
) -> Plan:
    """Profile ``model`` on ``example_inputs`` under ``precision`` and plan under ``budget``.

    ``example_inputs``: a tensor (``model(x)``), a tuple (``model(*args)``) or a dict
    (``model(**kwargs)``) of the batch size training uses (one micro-batch).
    ``loss_fn(output) -> scalar``; default: the sum of the first floating-point tensor in
    the output. ``budget`` is the peak of a whole training step ("2GiB", bytes, or a
    fraction of device memory); None plans without a limit (``optimal`` then recomputes
    nothing). ``accumulation_steps``: micro-batches per optimizer step. ``keep_output``:
    the training loop holds the model's output through backward (``out = model(x);
    loss_fn(out).backward()``, the default); False for a loop that keeps only the loss
    (``loss = model(**batch).loss``), whose output is freed before backward.
    ``world_size`` and ``data_parallel`` (``"ddp"``, ``"fsdp"``): plan one rank of a
    data-parallel run under a per-device budget (docs/distributed.md).

    Example::

        plan = memfit.plan(model, x, budget="1GiB", precision="bf16-mixed")
        memfit.apply_plan(model, plan)
    """
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    loss_of = loss_fn or default_loss
    policy, chosen = resolve_policy(
        precision, model, example_inputs, lambda m, x: loss_of(call_model(m, x))
    )
    profiled = profile_model(model, example_inputs, loss_fn, policy, units, keep_output)
    profiled = dataclasses.replace(profiled, notes=(*profiled.notes, *chosen))
    layout = RankLayout(data_parallel, world_size)
    return solve_profile(
        model, profiled, policy, optimizer, strategy, budget, int(accumulation_steps), layout=layout
    ).plan


def plan_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget: Budget = None,
    strategy: str = "optimal",
    precision: str | PrecisionPolicy | None = "auto",
    optimizer: torch.optim.Optimizer | None = None,
    frontier: bool = True,
    accumulation_steps: int = 1,
    units: Sequence[str] | None = None,
    world_size: int = 1,
    data_parallel: str | None = None,
) -> Plan:
    """The plan of :func:`make_plan` for a step written ``loss_fn(model, batch)``;
    ``units``: the candidate units instead of those ``find_units`` finds; ``world_size``
    and ``data_parallel``: one rank's step (:func:`make_plan`).

    Example::

        plan = plan_step(model, batch, gpt_loss, budget="1GiB", precision="bf16-mixed")
    """
    return make_plan(
        model,
        batch,
        loss_fn,
        optimizer=optimizer,
        precision=precision,
        strategy=strategy,
        budget=budget,
        accumulation_steps=accumulation_steps,
        units=units,
        frontier=frontier,
        world_size=world_size,
        data_parallel=data_parallel,
    ).plan
