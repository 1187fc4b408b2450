"""A budget the prediction cannot decide, decided by a measurement.

The planner keeps a reserve (:data:`memfit.checkpoint.planner.RESERVE`) between a plan's
predicted peak and the budget, for what the cost model leaves out; and the cost model is
an upper bound that on some models predicts the least peak any plan reaches a few percent
above what that plan measures. A budget at that edge would be refused on the prediction
although a plan meets it. So when the prediction with the reserve refuses a budget and the
predicted least peak lies within :data:`MEASURE_MARGIN` above it, :func:`measured_plan`
measures instead: the plan predicted within the budget itself first, then the least plan,
each by running its forward and backward once on the example batch under the allocator
(:mod:`memfit.allocator`). A plan is accepted when its measured step fits; a budget is
refused only when the least plan's measured step does not, and the error gives that
number. No reserve is kept above a measurement: it is the allocator's count of the step
itself (a training loop's own scalars, a few bytes such as the Engine's loss sum, come on
top).

Every judgement of a measured step is :func:`judge_fit`'s, returning a
:class:`FitVerdict`: the planner's here (before training),
:func:`memfit.checkpoint.closed_loop.check_plan` (a planned step against its prediction), the
Engine's first planned step (:mod:`memfit.engine.plan_stage`) and the training-loop
callbacks' measurement at train begin (:mod:`memfit.integrations.common`). Where they judge
differently they say so through its parameters, never with a rule of their own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from memfit.allocator import allocator_peak, release_kernel_workspaces, storage_bytes
from memfit.checkpoint.apply import apply_plan, remove_plan
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.profiler.runner import backward_writes, grads_set_aside, preserved
from memfit.checkpoint.solvers import Solution, parse_strategy, solve
from memfit.checkpoint.step_memory import StepMemory
from memfit.nested import tensors
from memfit.precision.apply import precision_applied
from memfit.precision.policy import PrecisionPolicy

#: How far above the budget a predicted least peak may lie for the planner to measure the
#: least plan instead of refusing: the largest over-prediction of a least peak the zoo
#: benchmark has shown (about 15%).
MEASURE_MARGIN = 0.15

#: What a measured step is kept below the budget by when it is accepted in place of a plan
#: that recomputes more (the edge, within the planner's reserve): the allocator's peak of
#: the same step on the same batch differs between runs by a few KiB (2.5 KiB seen on a
#: 12 MiB step; a plan accepted 48 bytes inside its budget then ran 2 KiB over it), and a
#: training loop adds its own scalars. The larger of a share of the budget and a few KiB.
#: The least plan is accepted without it: no other plan would fit.
EDGE_SLACK = 0.001
EDGE_SLACK_BYTES = 4096


def edge_slack(budget_bytes: float) -> float:
    """The share of ``budget_bytes`` an edge plan's measured step is kept below.

    >>> edge_slack(100 * 2**20), round(edge_slack(2**20), 4)
    (0.001, 0.0039)
    """
    return max(EDGE_SLACK, EDGE_SLACK_BYTES / budget_bytes) if budget_bytes > 0 else 0.0


FitAction = Literal["keep", "replan", "refuse"]
"""What a :class:`FitVerdict` says to do with the plan: ``"keep"`` it; ``"replan"`` from
the same profile with the step memory corrected by the miss (tighter when the step measured
more than predicted, looser when less); ``"refuse"`` the budget, since the measured plan is
the least any plan reaches and its step is over it."""


@dataclass(frozen=True)
class FitVerdict:
    """A measured step judged against its prediction and its budget (:func:`judge_fit`).

    >>> verdict = judge_fit(100.0, 103.0, 200.0, tolerance=0.02)
    >>> verdict.fits, verdict.action, round(verdict.error_fraction, 3)
    (True, 'replan', 0.03)
    """

    predicted_bytes: float
    """The peak the plan predicted for the step."""
    measured_bytes: float
    """The peak the step reached."""
    budget_bytes: float | None
    """The budget the step was judged against, or None (no limit)."""
    reserve: float
    """Share of the budget kept free above the measurement."""
    fits: bool
    """The measured step is within the budget less the reserve (True without a budget)."""
    action: FitAction
    """What to do with the plan."""

    @property
    def miss_bytes(self) -> float:
        """measured - predicted: what the prediction missed by (negative: it was high)."""
        return self.measured_bytes - self.predicted_bytes

    @property
    def error_fraction(self) -> float:
        """(measured - predicted) / predicted (0 when nothing was predicted or measured)."""
        if self.predicted_bytes == 0:
            return 0.0 if self.measured_bytes == 0 else float("inf")
        return self.miss_bytes / self.predicted_bytes


def judge_fit(
    predicted_bytes: float,
    measured_bytes: float,
    budget_bytes: float | None,
    *,
    tolerance: float | None = None,
    reserve: float = 0.0,
    least_plan: bool = False,
) -> FitVerdict:
    """Judge a measured step against the plan's prediction and the budget.

    The step fits when it measured at most ``budget_bytes * (1 - reserve)`` (always without
    a budget). The verdict, in this order:

    * ``"refuse"``: ``least_plan`` (the measured plan is the least any plan reaches: the
      least plan the planner measured, the Engine's ``full`` fallback) and the step does
      not fit. Nothing else can fit the budget.
    * ``"replan"``: a budget and a ``tolerance`` are given and the step missed the
      prediction by more than ``tolerance`` of it, either way, or did not fit the budget.
      A plan made under the budget is made again with the miss counted.
    * ``"keep"``: otherwise.

    ``tolerance``: the share of the prediction a measurement may miss it by and still
    confirm it; None judges the budget alone (a plan that was not solved under the budget,
    or that its caller cannot re-plan). ``reserve``: the share of the budget kept free
    above the measurement (0: a measurement is the allocator's count of the step itself).

    Example::

        verdict = judge_fit(plan.predicted_peak_bytes, peak, plan.budget_bytes, tolerance=0.02)
        if verdict.action == "replan": ...
    """
    predicted, measured = float(predicted_bytes), float(measured_bytes)
    budget = None if budget_bytes is None else float(budget_bytes)
    fits = budget is None or measured <= budget * (1 - reserve)
    action: FitAction = "keep"
    if least_plan and not fits:
        action = "refuse"
    elif tolerance is not None and budget is not None:
        # Over the budget is a miss however small: the plan is made again with it counted.
        if not fits or abs(measured - predicted) > tolerance * predicted:
            action = "replan"
    return FitVerdict(predicted, measured, budget, reserve, fits, action)


@dataclass(frozen=True)
class MeasuredFit:
    """A plan whose step was measured because the prediction could not decide the budget."""

    solution: Solution
    """The solver's plan (its prediction is the cost model's)."""
    measured_peak_bytes: float
    """The step's peak as measured: what the step holds whatever the plan (its static
    bytes as counted) plus the highest rise the allocator saw in forward and backward,
    and never below the optimizer step's."""
    verdict: FitVerdict
    """The measurement judged against the budget (:func:`judge_fit`)."""
    least: bool
    """Whether the plan is the least any plan reaches (over the budget, nothing fits it),
    or the cheapest plan predicted within the budget itself (the edge, where the planner's
    reserve would have refused it)."""


@dataclass(frozen=True)
class StepRun:
    """What measuring a plan's step runs: the profiled step on its model, under its
    precision, with what the step holds besides (:meth:`peak_bytes`).

    ``run_loss()`` computes the profiled step's loss; it runs under the precision's
    autocast, with the plan applied, and is differentiated. ``held_output_bytes``: the
    model's output when the training loop holds it through backward (``run_loss`` lets it
    go once the loss is made), counted on top. ``optimizer_params``: what the optimizer
    steps (the fp32 masters in the ``*-master`` modes, which the model's gradients are
    routed into): their gradients are cleared for the measurement and given back after it.

    Example::

        run = StepRun(model, mem, policy, profiled.run_loss, profiled.structure)
        fit = measured_plan(run, root, "optimal", budget)
    """

    model: nn.Module
    memory: StepMemory
    policy: PrecisionPolicy
    run_loss: Callable[[], torch.Tensor]
    structure: list[tuple[str, str]]
    held_output_bytes: float = 0.0
    optimizer_params: list[torch.Tensor] | None = None

    def peak_bytes(self, solution: Solution | Plan) -> float:
        """The peak of one step under the plan (or a solution's): the allocator's count of its
        forward and backward on the example batch over the step's static bytes as counted.
        Gradients, buffers, modes, the random state and the model's own plan are left as
        they were."""
        return _measured_step(self, solution)


def measured_plan(
    run: StepRun,
    root: UnitCost,
    strategy: str,
    budget_bytes: float,
    *,
    frontier: bool = True,
    reserve: float = 0.0,
) -> MeasuredFit | None:
    """The plan a measurement decides, for a budget the prediction with its reserve refused.

    First the edge: the plan with the least recompute predicted within ``budget_bytes``
    itself (no reserve: the measurement is what the reserve stood for). Its step is
    measured; when it fits, it is the plan. Otherwise (or when no plan is predicted within
    the budget) the least plan's step is measured, and returned whether it fits or not:
    ``verdict.fits`` False is the measured refusal, with the number the error gives.
    None when the predicted least peak lies more than :data:`MEASURE_MARGIN` above the
    budget: no measurement is spent on a budget the prediction is far from.

    ``root``: the profiled cost tree with backward costs; ``reserve``: the share of the
    budget kept free above a measurement (what a training loop's own tensors may add; 0
    from the planner).

    Example::

        fit = measured_plan(StepRun(model, mem, policy, loss, structure), root, "optimal", budget)
        if fit is not None and fit.verdict.fits: ...
    """
    mem = run.memory
    least = _least_peak(root, mem, strategy)
    if max(least, mem.floor_bytes) > budget_bytes * (1 + MEASURE_MARGIN):
        return None
    if max(least, mem.floor_bytes) <= budget_bytes:
        edge = solve(
            root,
            strategy,
            budget_bytes,
            mem.held_bytes,
            mem.loss_bytes,
            reserve=0.0,
            frontier=frontier,
        )
        predicted = max(edge.predicted_peak_bytes, mem.floor_bytes)
        if edge.predicted_peak_bytes > least * (1 + 1e-9):  # not the least plan: measured below
            peak = run.peak_bytes(edge)
            slack = max(reserve, edge_slack(budget_bytes))
            verdict = judge_fit(predicted, peak, budget_bytes, reserve=slack)
            if verdict.fits:
                return MeasuredFit(edge, peak, verdict, least=False)
    return measured_least_plan(
        run, root, strategy, budget_bytes, frontier=frontier, reserve=reserve, least_bytes=least
    )


def _least_peak(root: UnitCost, mem: StepMemory, strategy: str) -> float:
    """The least peak of a forward and backward any plan is predicted to reach (the
    optimizer step's may be higher): the low end of the unbudgeted frontier."""
    walked = solve(root, strategy, None, mem.held_bytes, mem.loss_bytes, frontier=True)
    return min(p.peak_bytes for p in walked.frontier)


def measured_least_plan(
    run: StepRun,
    root: UnitCost,
    strategy: str,
    budget_bytes: float,
    *,
    frontier: bool = True,
    reserve: float = 0.0,
    least_bytes: float | None = None,
) -> MeasuredFit | None:
    """The least plan with its step measured, judged against ``budget_bytes``
    (``verdict.action`` ``"refuse"`` when it does not fit: no plan does); None when its
    predicted peak lies more than :data:`MEASURE_MARGIN` above the budget. The arguments
    are :func:`measured_plan`'s; ``least_bytes``, the least predicted peak of forward and
    backward when the caller has walked the frontier already.

    Example::

        fit = measured_least_plan(StepRun(model, mem, policy, loss, structure), root,
                                  "optimal", budget)
        if fit is not None and fit.verdict.fits: ...
    """
    mem = run.memory
    held, loss = mem.held_bytes, mem.loss_bytes
    least = _least_peak(root, mem, strategy) if least_bytes is None else least_bytes
    predicted = max(least, mem.floor_bytes)
    if predicted > budget_bytes * (1 + MEASURE_MARGIN):
        return None
    # The least point's plan: the cheapest under a budget just at its peak.
    chosen = solve(
        root, strategy, least * (1 + 1e-9) + 1, held, loss, reserve=0.0, frontier=frontier
    )
    peak = run.peak_bytes(chosen)
    # The least plan is measured: over the budget, no plan fits it.
    verdict = judge_fit(predicted, peak, budget_bytes, reserve=reserve, least_plan=True)
    if verdict.fits:
        return MeasuredFit(chosen, peak, verdict, least=True)
    # Plans tied at the least predicted peak can measure differently (a selective unit the
    # model under-predicts), and the tie is broken by measured time: every unit recomputed,
    # per-block checkpointing as users write it, is measured too before refusing. (A
    # fixed strategy the user named is its own plan: no other is put in its place.)
    if parse_strategy(strategy)[0] != "optimal":
        return MeasuredFit(chosen, peak, verdict, least=True)
    full = solve(root, "full", None, held, loss, reserve=0.0, frontier=False)
    if full.decisions == chosen.decisions:
        return MeasuredFit(chosen, peak, verdict, least=True)
    full_peak = run.peak_bytes(full)
    full_predicted = max(full.predicted_peak_bytes, mem.floor_bytes)
    full_verdict = judge_fit(
        full_predicted, full_peak, budget_bytes, reserve=reserve, least_plan=True
    )
    if full_verdict.fits or full_peak < peak:
        return MeasuredFit(full, full_peak, full_verdict, least=True)
    return MeasuredFit(chosen, peak, verdict, least=True)


def measured_within_reserve(
    run: StepRun, reserved: Solution, budget_bytes: float
) -> MeasuredFit | None:
    """``reserved.edge`` (the plan that recomputes less than ``reserved``, predicted within
    the budget itself: :func:`~memfit.checkpoint.solvers.solve` with ``edge=True``) with its
    step measured and judged: ``verdict.fits`` when the step fits the budget with
    :func:`edge_slack` to spare (the edge is then the plan), else the measurement that kept
    ``reserved`` (the plan's notes say so); None when there is no such plan. The reserve is
    what the measurement replaces: at a peer's memory the plan recomputes no more than the
    prediction allows, not 2% less than that.

    Example::

        solution = solve(root, "optimal", budget, held, loss, reserve=RESERVE, edge=True)
        fit = measured_within_reserve(run, solution, budget)
        solution = fit.solution if fit is not None and fit.verdict.fits else solution
    """
    edge = reserved.edge
    if edge is None:
        return None
    peak = run.peak_bytes(edge)
    predicted = max(edge.predicted_peak_bytes, run.memory.floor_bytes)
    verdict = judge_fit(predicted, peak, budget_bytes, reserve=edge_slack(budget_bytes))
    return MeasuredFit(edge, peak, verdict, least=False)


def module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Tensors the model's modules keep as plain attributes, in plain containers or alone
    (not parameters or buffers, and sharing no storage with one): a stashed activation, a
    cache. One tensor per storage.

    >>> layer = nn.Linear(2, 2)
    >>> layer.stash = [torch.zeros(4)]
    >>> [t.shape for t in module_tensors(layer)]
    [torch.Size([4])]
    """
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            if not isinstance(value, (torch.Tensor, list, tuple, dict)):
                continue
            for t in tensors(value):
                ptr = t.untyped_storage().data_ptr()
                if isinstance(t, nn.Parameter) or ptr == 0 or ptr in owned:
                    continue
                found.setdefault(ptr, t)
    return list(found.values())


def _measured_step(run: StepRun, solution: Solution | Plan) -> float:
    """:meth:`StepRun.peak_bytes`."""
    model, mem, policy = run.model, run.memory, run.policy
    plan = solution
    if isinstance(solution, Solution):
        plan = Plan.from_solution(solution, precision=policy.mode, structure=run.structure)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    graded = backward_writes(model, run.optimizer_params or [])
    accumulating = mem.accumulated_grad_bytes > 0

    def step() -> None:
        # The last step's gradients, where the loop frees them only before backward: their
        # bytes are held through the forward, as a block the measurement sees allocated.
        last_grads = None
        if mem.forward_grad_bytes:
            last_grads = torch.empty(int(mem.forward_grad_bytes), dtype=torch.uint8, device=device)
        with policy.autocast(device.type):
            value = run.run_loss()
        del last_grads  # the loop's zero_grad
        value.backward()

    python_rng = random.getstate()
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with (
            grads_set_aside(graded),
            precision_applied(model, policy),
            preserved(model, None, rng_devices),
        ):
            apply_plan(model, plan)

            try:
                # A first run allocates what later runs reuse (caches, lazy state). It runs
                # under the allocator's profiler too, so that what it leaves for the next
                # run (tensors a module keeps on itself between calls) is known to the
                # allocator's reporter with its size: otherwise their frees inside the
                # measured run go unreported, or are reported with the size of an earlier
                # tensor at the same address, at random.
                allocator_peak(step, device=device)
                if not accumulating:
                    for t in graded:
                        t.grad = None
                # Accumulating, the measured run adds into the gradients the first made, as a
                # later micro-batch does; they are counted below as held all along. What the
                # modules keep on themselves is held when the measured run starts, and its
                # rise is measured past their frees as the run replaces them: counted on top.
                # Everything the run frees without having made it is named (the list is not
                # held past the call, which would keep them alive), so a free the profiler
                # sizes wrongly (memfit.allocator) moves no level.
                kept_bytes = storage_bytes(module_tensors(model))
                # On CUDA the rise holds cuBLAS's workspaces only if made in it; the
                # prediction counts them in the measured workspace (step_workspace).
                release_kernel_workspaces(device)
                peak = allocator_peak(
                    step,
                    live=[*params, *model.buffers(), *module_tensors(model)],
                    device=device,
                    live_complete=True,
                )
            finally:
                remove_plan(model)
    finally:
        random.setstate(python_rng)
    # The measured step started from the live tensors; the step's static bytes as counted
    # (the optimizer state may not exist yet) stand for them, less the kernels' workspace,
    # which the measured rise holds itself (a closed loop's correction stays: the rise of
    # forward and backward cannot have seen what the whole step held beyond them).
    rise = peak.peak_bytes - peak.start_bytes
    static = mem.base_bytes - mem.workspace_bytes
    activations = static + mem.accumulated_grad_bytes + run.held_output_bytes + kept_bytes + rise
    return max(activations, mem.optimizer_phase_bytes)
