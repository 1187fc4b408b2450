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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.checkpoint.costs import KEEP, UnitCost
from memfit.checkpoint.measured_fit import (
    FitVerdict,
    MeasuredFit,
    StepRun,
    judge_fit,
    measured_plan,
    measured_within_reserve,
)
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.profile_stage import ModelProfile
from memfit.checkpoint.solvers import FrontierPoint, Solution, parse_strategy, plan_cost, solve
from memfit.checkpoint.solvers.frontier import pareto
from memfit.checkpoint.solvers.plan_cost import kept_cast_bytes
from memfit.checkpoint.step_memory import (
    RankLayout,
    StepMemory,
    ZeroGrad,
    sparse_grad_sizes,
    step_memory,
)
from memfit.checkpoint.storage_stage import (
    CODED,
    DEFAULT_TOLERANCE,
    StorageChoice,
    step_storage_choice,
)
from memfit.checkpoint.unit_holds import with_backward_costs
from memfit.errors import BudgetError, ConfigError
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
    zero_grad: ZeroGrad = "before_forward"
    """Where the training loop it was planned for frees the last step's gradients."""
    measured_peak_bytes: float | None = None
    """The plan's step as measured on the example batch (the allocator's count of one
    forward and backward over the step's static bytes): by :func:`verify_plan`, or where
    the budget was accepted on the measurement rather than on the prediction
    (:mod:`memfit.checkpoint.measured_fit`). None when not measured."""
    layout: RankLayout | None = None
    """The data-parallel layout it was planned for (one rank's share), or None (one
    process); a re-plan keeps it."""
    activation_storage: tuple[str, ...] = ("keep", "recompute")
    """What the planner may do with a unit's saved tensors (beside keep and recompute:
    ``"bf16"``, ``"fp8"``, ``"offload"``); a re-plan keeps it."""
    storage_tolerance: float = DEFAULT_TOLERANCE
    """The largest relative gradient error a storage may add (a re-plan keeps it)."""
    storage_errors: dict[str, float | None] = dataclasses.field(default_factory=dict)
    """Each coded storage tried, its measured relative gradient error on the example
    batch (empty: none tried; None: not measured, on the meta device)."""
    measured_is_least: bool = False
    """The plan accepted on its measured step is the least any plan reaches: the Engine
    then judges its first training step against the budget itself (over it, nothing
    fits). A plan at the budget's edge is judged as any plan is, and made again when its
    step does not fit."""


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
    zero_grad: ZeroGrad = "before_forward",
    activation_storage: Sequence[str] = ("keep", "recompute"),
    storage_tolerance: float = DEFAULT_TOLERANCE,
) -> PlanResult:
    """Stages 2-4: the step's memory, the solve, the Plan with its predicted peak.

    ``frontier=False`` leaves out the plan's (peak, time) frontier, which takes most of
    the solve's time on trees of hundreds of units. ``correction_bytes``: memory the step
    was measured to hold beyond (or, negative, below) the model, counted as held all step
    (:func:`check_plan`). ``layout``: plan one rank of a data-parallel run (its share of
    the weights, gradients and optimizer state; :class:`RankLayout`). ``zero_grad``: where
    the training loop frees the last step's gradients
    (:mod:`memfit.checkpoint.step_memory`). ``activation_storage``: beside ``"keep"`` and
    ``"recompute"``, ``"bf16"``, ``"fp8"`` or ``"offload"`` (CUDA) let the ``optimal``
    strategy store kept units' saved tensors coded where the budget needs it, each
    storage offered only where its gradient error on the example batch is within
    ``storage_tolerance`` (:mod:`memfit.checkpoint.storage_stage`)."""
    model = unwrap_compiled(model)
    activation_storage = check_activation_storage(activation_storage)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    budget_bytes = None if budget is None else parse_bytes(budget, device)
    # The edges were measured on the whole model in one process: a rank's share differs.
    edges = profiled.edges if layout is None or layout.kind is None else None
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
        loss_spike_bytes=None if edges is None else edges.loss_spike_bytes,
        head_backward_bytes=None if edges is None else edges.head_backward_bytes,
        zero_grad=zero_grad,
        loss_spike_later_bytes=0.0 if edges is None else edges.loss_spike_later_bytes,
        end_unsaved_inputs=profiled.forward_end_unsaved_inputs,
    )
    if edges is not None:
        # Before the first unit, the last step's gradients are held where the loop frees
        # them only before backward (the head's backward, after zero_grad, counts them too).
        held_grads = mem.accumulated_grad_bytes + mem.forward_grad_bytes
        edge = max(edges.head_bytes + held_grads, edges.tail_bytes + mem.grad_bytes)
        mem = dataclasses.replace(mem, edge_bytes=mem.base_bytes + edge)
    if profiled.workspace_bytes:
        # Kernels' own workspace: where among the units is not known, so all of it counts,
        # but at the loss's moments, where the allocator was read: there only what was
        # held beyond every tensor at the end of forward (a SegFormer's 1.1 MB of a
        # unit's backward scratch over-predicted its least peak, at the loss, by 4.4%;
        # an LSTM's buffer kept for its backward is held there).
        workspace = profiled.workspace_bytes
        at_loss = edges.forward_end_untracked_bytes if edges is not None else None
        # The excess lowers those moments at most to what is kept with the held bytes: an
        # LSTM's step, whose oneDNN buffers the units' backward moments do not place, was
        # under-predicted by 15% where it lowered them below.
        excess = 0.0 if at_loss is None else max(0.0, workspace - at_loss)

        def less_excess(loss: float) -> float:
            return max(min(loss, 0.0), loss - excess)

        mem = dataclasses.replace(
            mem,
            base_bytes=mem.base_bytes + workspace,
            workspace_bytes=workspace,
            loss_bytes=less_excess(mem.loss_bytes),
            loss_uncast_bytes=less_excess(mem.loss_uncast_bytes),
            loss_quiet_bytes=None
            if mem.loss_quiet_bytes is None
            else less_excess(mem.loss_quiet_bytes),
            spike_bytes=less_excess(mem.spike_bytes),
            spike_later_bytes=less_excess(mem.spike_later_bytes),
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
    if budget_bytes is not None and mem.edge_bytes > budget_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below what the step holds while none of "
            f"its units runs, {format_bytes(mem.edge_bytes)} (measured on the example batch: "
            "the layers before the first unit and after the last one, in forward or backward, "
            "with every gradient made by then and the kernels' own buffers): no checkpoint "
            "plan can fit it. Raise the budget, use a smaller micro-batch (more accumulation "
            "steps), or name units that include those layers (units=[...])."
        )
    released = mem.released_by_param if zero_grad == "in_backward" else None
    root = cost_tree(
        model, profiled, policy, accumulation_steps, layout, released, mem.forward_offset_bytes
    )
    held = mem.held_bytes
    # Plans fit within 1 - RESERVE of the budget; errors name the budget that would fit.
    measured_fit: MeasuredFit | None = None
    edge_refused: MeasuredFit | None = None  # a cheaper plan measured over, for the notes
    optimal = parse_strategy(strategy)[0] == "optimal"
    # With a budget, a step to measure decides what the prediction cannot: for any
    # strategy the plan at the budget's edge, for ``optimal`` also a cheaper one within it.
    # A measured step is a usual one, which holds every gradient: it cannot judge a plan
    # for a loop that releases them in backward (the prediction decides there).
    # On the meta device (the estimator's fake steps) nothing can be measured: no
    # measured plan, and a storage's codes are counted on a meta forward, its gradient
    # error assumed within the tolerance (the plan made on the real model measures it).
    meta = device.type == "meta"
    # Nor is there an allocator to keep slack for: an estimate judges every plan, the
    # fixed strategies' and the optimal one alike, against the whole budget (optimal
    # never fits less than a fixed strategy does).
    reserve = 0.0 if meta else RESERVE
    measurable = budget_bytes is not None and zero_grad != "in_backward" and not meta
    run = step_run(model, profiled, mem, policy, optimizer) if measurable else None
    choice: StorageChoice | None = None
    coded = [
        k for k in activation_storage if k in CODED and (k != "offload" or device.type == "cuda")
    ]
    storing = (
        bool(coded)
        and optimal
        and budget_bytes is not None
        and profiled.run_loss is not None
        and (run is not None or meta)
    )

    def stored(plain: Solution | None) -> StorageChoice | None:
        return step_storage_choice(
            model,
            profiled,
            mem,
            policy,
            optimizer,
            root,
            strategy,
            budget_bytes,
            coded,
            storage_tolerance,
            plain,
            reserve,
        )

    try:
        # With a step to measure, the solve also finds the plan within the budget itself
        # (its ``edge``), which a measurement may accept in place of the reserve.
        solution = solve(
            root,
            strategy,
            budget_bytes,
            held,
            mem.loss_bytes,
            reserve=reserve,
            frontier=frontier,
            edge=optimal and run is not None,
            settle_ties=not profiled.counted,
        )
    except BudgetError as exc:
        choice = stored(None) if storing else None
        if choice is not None:
            solution = choice.solution
        elif run is None:
            raise
        else:
            solution, measured_fit = _measured_or_refused(
                run, root, strategy, budget_bytes, exc, frontier, coded if storing else []
            )
    else:
        choice = stored(solution) if storing and solution.recompute_seconds > 0 else None
        if choice is not None:
            solution = choice.solution
        elif run is not None and optimal:
            # Between the budget less the reserve and the budget may lie a plan that
            # recomputes less: its measured step decides, not the reserve.
            cheaper = measured_within_reserve(run, solution, budget_bytes)
            if cheaper is not None and cheaper.verdict.fits:
                solution, measured_fit = cheaper.solution, cheaper
            else:
                edge_refused = cheaper
    if choice is not None:
        root = choice.tree
    return result_of_solution(
        solution,
        measured_fit,
        root=root,
        mem=mem,
        profiled=profiled,
        policy=policy,
        strategy=strategy,
        budget=budget,
        budget_bytes=budget_bytes,
        accumulation_steps=accumulation_steps,
        layout=layout,
        zero_grad=zero_grad,
        storage=None if choice is None else choice.storage,
        activation_storage=activation_storage,
        storage_tolerance=storage_tolerance,
        storage_errors=None if choice is None else choice.errors,
        storage_seconds=0.0 if choice is None else choice.coding_seconds,
        reserve=reserve,
        edge_refused=edge_refused,
    )


def _measured_or_refused(
    run: StepRun,
    root: UnitCost,
    strategy: str,
    budget_bytes: float,
    exc: BudgetError,
    frontier: bool,
    stored: Sequence[str] = (),
) -> tuple[Solution, MeasuredFit]:
    """A budget the prediction with its reserve cannot decide, decided by measuring: the
    plan predicted within the budget itself, then the least plan (a fixed strategy has one
    plan: it is measured). Raises ``exc`` where nothing could be measured, and a
    BudgetError with the measured number where the least plan's step does not fit.
    ``stored``: the coded storages the planner tried (the error then says none fitted)."""
    optimal = parse_strategy(strategy)[0] == "optimal"
    fit = measured_plan(run, root, strategy, budget_bytes, frontier=frontier)
    if fit is None:
        raise exc from None
    if not fit.verdict.fits:
        measured = fit.measured_peak_bytes
        which = (
            "the smallest peak any checkpoint plan reaches, measured: the least plan's"
            if optimal
            else f"what strategy {strategy!r} reaches, measured: its"
        )
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below {which} step peaked at "
            f"{format_bytes(measured)} ({measured:.0f} bytes; the allocator's count of "
            "one forward and backward on the example batch). Raise the budget to at "
            "least that, use a smaller micro-batch (more accumulation steps) or a "
            f"'*-master' precision"
            + ("" if optimal else ", or let strategy='optimal' choose")
            + (
                f"; no plan fitted with activations stored {' or '.join(stored)} either"
                if stored
                else ", or let the planner store activations coded "
                "(activation_storage=('keep', 'recompute', 'bf16', 'fp8'))"
            )
            + f". The prediction: {exc}"
        ) from None
    return fit.solution, fit


def check_activation_storage(choices: Sequence[str]) -> tuple[str, ...]:
    """``choices`` checked: a tuple of ``"keep"``, ``"recompute"``, ``"bf16"``, ``"int8"``,
    ``"fp8"``, ``"offload"`` holding ``"keep"``.

    Example::

        check_activation_storage(["keep", "recompute", "fp8"])
    """
    allowed = ("keep", "recompute", *CODED)
    if isinstance(choices, str):
        choices = (choices,)
    found = tuple(choices)
    bad = [c for c in found if c not in allowed]
    if bad or "keep" not in found:
        raise ConfigError(
            f"activation_storage={found!r}: each choice is one of "
            f"{', '.join(map(repr, allowed))}, and 'keep' is among them (e.g. "
            "('keep', 'recompute', 'bf16', 'fp8'))"
        )
    return found


def storage_choices(coded: Iterable[str] = ()) -> tuple[str, ...]:
    """The ``activation_storage=`` that lets a plan keep, recompute, or store a unit's
    saved tensors as each of ``coded`` (checked, repeats dropped).

    Example::

        storage_choices(["fp8"])   # ("keep", "recompute", "fp8")
    """
    return check_activation_storage(("keep", "recompute", *dict.fromkeys(coded)))


def result_of_solution(
    solution: Solution,
    measured_fit: MeasuredFit | None,
    *,
    root: UnitCost,
    mem: StepMemory,
    profiled: ModelProfile,
    policy: PrecisionPolicy,
    strategy: str,
    budget: Budget,
    budget_bytes: float | None,
    accumulation_steps: int,
    layout: RankLayout | None,
    zero_grad: ZeroGrad = "before_forward",
    storage: dict[str, str] | None = None,
    activation_storage: tuple[str, ...] = ("keep", "recompute"),
    storage_tolerance: float = DEFAULT_TOLERANCE,
    storage_errors: dict[str, float | None] | None = None,
    storage_seconds: float = 0.0,
    reserve: float = RESERVE,
    edge_refused: MeasuredFit | None = None,
) -> PlanResult:
    """Stage 4: the solver's ``solution`` as a :class:`PlanResult`, its peak counted for
    the whole step (``measured_fit``: the measurement that accepted it, if one did;
    ``reserve``: the share of the budget the solve kept free; ``edge_refused``: a plan that
    recomputes less, predicted within the budget itself, whose measured step did not fit)."""
    held, floor = mem.held_bytes, mem.floor_bytes
    # The solver plans without crediting checkpoint inputs that the kept unit before them
    # already saves (a bound); the prediction counts them once.
    # Nor do they credit autocast's weight copies that kept units save, which the end of
    # forward holds once (as saved tensors and in the autocast cache alike).
    # Nor what the loss's spike holds of the blocks checkpoints keep as their inputs.
    kept_cast = kept_cast_bytes(root, solution.decisions, solution.segments)
    counted = plan_cost(
        root,
        solution.decisions,
        solution.segments,
        held,
        lambda kept_inputs: mem.loss_for(kept_cast, kept_inputs),
        shared_inputs=True,
    )
    predicted = max(counted.peak_bytes, floor)
    note = solution.note
    if storage and solution.recompute_flops == 0:
        # The solver's note spoke of the tree with the stored units coded: the plain step
        # did not fit, which is why they are.
        note = (
            f"nothing is recomputed: with {len(storage)} units' activations stored coded "
            f"the step's predicted peak is {format_bytes(predicted)}"
        )
    elif note and budget_bytes is not None and solution.recompute_flops == 0:
        # The solver's note speaks of activations only; say it with the whole step's peak.
        note = (
            f"budget {format_bytes(budget_bytes)} is at or above the step's predicted peak "
            f"without checkpointing, {format_bytes(predicted)} (memfit "
            f"plans within {1 - reserve:.0%} of the budget): nothing is recomputed"
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
        frontier=_with_floor(solution.frontier, floor),
        note=note,
    )
    plan_ = Plan.from_solution(solution, precision=policy.mode, structure=profiled.structure)
    if measured_fit is not None:
        plan_.measured_peak_bytes = measured_fit.measured_peak_bytes
        least = measured_fit.least and parse_strategy(strategy)[0] == "optimal"
        which = "the least plan's" if least else "the plan's"
        plan_.notes.append(
            f"budget {format_bytes(budget_bytes)} is below {which} predicted peak, "
            f"{format_bytes(solution.predicted_peak_bytes)}, with the {RESERVE:.0%} reserve; "
            f"its step measured {format_bytes(measured_fit.measured_peak_bytes)} (the "
            "allocator's count of one "
            "forward and backward on the example batch), within it: planned with it"
        )
    if edge_refused is not None:
        # Why a plan that recomputes less was not taken: a user comparing with a peer at
        # this memory sees the measurement that decided.
        edge = edge_refused.solution
        plan_.notes.append(
            f"a plan recomputing {edge.recompute_flops / 1e9:.3g} GFLOP "
            f"({edge.recompute_seconds * 1e3:.3g} ms), predicted within the budget itself at "
            f"{format_bytes(edge_refused.verdict.predicted_bytes)}, measured "
            f"{format_bytes(edge_refused.measured_peak_bytes)}: over the budget less "
            f"{edge_refused.verdict.reserve:.2%} kept for a measurement's noise; this plan "
            f"({solution.recompute_flops / 1e9:.3g} GFLOP) is predicted within the "
            f"{reserve:.0%} reserve"
        )
    if storage:
        # Every unit listed, as in any plan: those a stored unit's leaf hid keep.
        plan_.decisions = {u.name: plan_.decisions.get(u.name, KEEP) for u in profiled.root.walk()}
        plan_.storage = dict(storage)
        plan_.storage_seconds = float(storage_seconds)
        errors = ", ".join(
            f"{k} {'not measured' if v is None else f'{v:.2%}'}"
            for k, v in (storage_errors or {}).items()
        )
        kind = "counted" if profiled.counted else "measured"
        plan_.notes.append(
            f"{len(storage)} kept units store their saved tensors coded (gradient error on "
            f"the example batch, every candidate stored: {errors}; coding time {kind}, "
            "weighed with the recompute)"
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
        layout=layout,
        zero_grad=zero_grad,
        measured_peak_bytes=measured_fit.measured_peak_bytes if measured_fit else None,
        measured_is_least=bool(measured_fit and measured_fit.least),
        activation_storage=activation_storage,
        storage_tolerance=storage_tolerance,
        storage_errors=dict(storage_errors or {}),
    )


def cost_tree(
    model: nn.Module,
    profiled: ModelProfile,
    policy: PrecisionPolicy,
    accumulation_steps: int,
    layout: RankLayout | None,
    released: Mapping[str, float] | None = None,
    forward_offset_bytes: float = 0.0,
) -> UnitCost:
    """The profiled cost tree with each unit's backward costs for this step (what its
    rebuild casts again, the gradients made by then; where the loop releases each in
    backward, none, and each unit's own update instead: ``StepMemory.released_by_param``; the last
    step's gradients alive through forward and the like, ``forward_offset_bytes``: see
    StepMemory.forward_offset_bytes), as the solver sees it.

    Example::

        root = cost_tree(model, result.profile, result.policy, 1, None)
    """
    return with_backward_costs(
        profiled.root,
        model,
        policy,
        accumulating=accumulation_steps > 1,
        layout=layout,
        sparse_grads=sparse_grad_sizes(profiled.profile, accumulation_steps),
        released=released,
        forward_offset_bytes=forward_offset_bytes,
        grad_order=profiled.profile.grad_order,
    )


def step_run(
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
