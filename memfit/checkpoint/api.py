"""Make a checkpoint plan for a model: profile, add what planning cannot change, solve.

The budget is the peak of a whole training step (what ``memfit.measure`` reports). The part
checkpointing cannot change, the *static* bytes, is counted from the model and optimizer:

* parameters and buffers, as they are held (low-precision in the ``*-master`` modes);
* gradients of everything the optimizer updates (fp32 masters' gradients in the master
  modes, since the low-precision ones are freed as they arrive);
* optimizer state: measured if the optimizer already has state, else its known size
  (Adam/AdamW two fp32 buffers per parameter element and a step count per parameter,
  SGD with momentum and Adagrad one buffer);
* fp32 master weights in the master modes;
* the step's inputs, and the activation gradient passed between units in backward;
* at the end of forward only: the model's output, what the loss saves, and the larger of
  autocast's 16-bit copies of fp32 weights (mixed modes) and the gradients the head of
  backward makes (the loss's, an LM head's, a loss computed inside the model).

Example::

    plan = memfit.plan(model, batch, budget="2GiB", strategy="optimal",
                       precision="bf16-mixed", optimizer=optimizer)
    print(plan.summary())
    memfit.apply_plan(model, plan)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memfit.checkpoint.apply import apply_plan
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.profile import Profile, profile
from memfit.checkpoint.solvers import evaluate, solve
from memfit.checkpoint.tree import find_units, structure_fingerprint
from memfit.errors import BudgetError, ConfigError, PlanError
from memfit.precision.policy import PrecisionPolicy
from memfit.units import device_memory_bytes, format_bytes, parse_bytes

if TYPE_CHECKING:
    from memfit.engine import Engine

#: Optimizer state per parameter element, in fp32 elements, when it has no state yet.
_STATE_ELEMENTS = {
    torch.optim.Adam: 2,
    torch.optim.AdamW: 2,
    torch.optim.Adamax: 2,
    torch.optim.NAdam: 2,
    torch.optim.RAdam: 2,
    torch.optim.Adagrad: 1,
    torch.optim.RMSprop: 1,
    torch.optim.Adadelta: 2,
}
#: Scalar tensors of state per parameter (the step count; NAdam's running momentum product).
_STATE_SCALARS = {cls: 2 if cls is torch.optim.NAdam else 1 for cls in _STATE_ELEMENTS}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's state, measured if it exists, else predicted by type."""
    if optimizer is None:
        return 0
    if optimizer.state:
        seen: set[int] = set()
        total = 0
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                    seen.add(value.data_ptr())
                    total += value.numel() * value.element_size()
        return total
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    elements = sum(p.numel() for p in params)
    per = _STATE_ELEMENTS.get(type(optimizer), 0)
    if isinstance(optimizer, torch.optim.SGD):
        per = 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        per += 1
    # The scalars are float32 unless the default dtype is float64, as torch.optim makes them.
    scalar = 8 if torch.get_default_dtype() == torch.float64 else 4
    return per * elements * 4 + _STATE_SCALARS.get(type(optimizer), 0) * len(params) * scalar


@dataclass(frozen=True)
class StepMemory:
    """The parts of a step's peak that a checkpoint plan cannot change."""

    base_bytes: float
    """Held all step: parameters, buffers, optimizer state, fp32 masters, the inputs."""
    loss_bytes: float
    """Held from the end of forward until the loss's backward: the model's output, what the
    loss saves, and the larger of autocast's 16-bit weight copies (held until the autocast
    region ends) and the gradients the head of backward makes (the loss's, the model
    output's, and those of ops the model runs after its blocks: an LM head, or a loss it
    computes itself). Freed before the first recomputed piece is rebuilt."""
    grad_bytes: float
    """Gradients of what the optimizer updates, all present at the optimizer step."""
    in_flight_bytes: float
    """The activation gradient passed between units in backward (the largest output of a
    unit inside the model; the model's own output's gradient is in ``loss_bytes``)."""


def step_memory(
    model: nn.Module,
    prof: Profile,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    output_bytes: float | None = None,
    loss_saved_bytes: float | None = None,
    root: UnitCost | None = None,
) -> StepMemory:
    """What a training step holds whatever the plan (see the module docstring).

    ``output_bytes`` and ``loss_saved_bytes``: the model's output and what the loss saves,
    when they are not the profiled step's own (default: ``prof``'s). ``root``: the model's
    own unit tree, when ``prof`` profiled more than the model (default: ``prof.root``)."""
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    if optimizer is not None:
        updated = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    else:
        updated = [p for p in model.parameters() if p.requires_grad]
    model_params = {id(p) for p in model.parameters()}
    # fp32 master copies live in the optimizer, not in the model.
    master_bytes = sum(p.numel() * p.element_size() for p in updated if id(p) not in model_params)
    if policy.master_weights and optimizer is None:
        master_bytes = sum(p.numel() * 4 for p in model.parameters() if p.dtype != torch.float32)
    grad_bytes = sum(
        p.numel() * (4 if policy.master_weights else p.element_size()) for p in updated
    )
    # Under autocast with fp32 weights, torch keeps a 16-bit copy of each weight it casts
    # until the autocast region ends, after the loss: held at the end of forward, gone in
    # backward (a recompute casts only its own piece's weights again).
    cast_cache = _cast_bytes(model, policy)
    output = prof.output_bytes if output_bytes is None else output_bytes
    loss_saved = prof.loss_saved_bytes if loss_saved_bytes is None else loss_saved_bytes
    base = param_bytes + buffer_bytes + optimizer_state_bytes(optimizer) + master_bytes
    # The head of backward (the loss's ops, and the model's own ops after its blocks: an LM
    # head, or a loss computed inside the model) makes gradients while everything kept is
    # still held. For a loss outside the model: its own gradients, at most the size of what
    # it saves, and the model output's. Whatever the loss, the profiler measured the most
    # of what the head makes alive at once; the last of it is the gradient it hands to the
    # last block, which the in-flight term holds already. The larger of the two is taken.
    # It does not meet the cast copies: it runs after the autocast region has ended.
    in_flight = _in_flight_bytes(prof.root if root is None else root)
    end_of_forward = max(cast_cache, loss_saved + output, prof.head_backward_bytes - in_flight)
    return StepMemory(
        base_bytes=float(base + prof.input_bytes),
        loss_bytes=float(output + loss_saved + end_of_forward),
        grad_bytes=float(grad_bytes),
        in_flight_bytes=in_flight,
    )


def _in_flight_bytes(root: UnitCost) -> float:
    """The largest activation gradient passed from one unit's backward to another's: the
    gradient of a unit's output, over the units inside the model. The model's own output
    is left out: its gradient is the loss's, counted at the end of forward (``loss_bytes``)
    and freed before any unit inside is rebuilt. (An LM's logits are many times a block's
    output: counting them in every rebuild would over-predict such plans by up to ~10%.)"""
    return float(max((u.output_bytes for u in root.walk() if u is not root), default=0.0))


def _cast_bytes(module: nn.Module, policy: PrecisionPolicy) -> int:
    """Bytes of the 16-bit copies autocast makes of ``module``'s fp32 weights (0 outside
    the mixed modes): matrices and filters of modules that are not fp32 islands."""
    if not policy.mixed or policy.master_weights:
        return 0
    width = torch.finfo(policy.compute_dtype).bits // 8
    return sum(
        p.numel() * width
        for m in module.modules()
        if not policy.is_island(m)
        for p in m.parameters(recurse=False)
        if p.dtype == torch.float32 and p.dim() >= 2
    )


def _with_backward_costs(root: UnitCost, model: nn.Module, policy: PrecisionPolicy) -> UnitCost:
    """``root`` with what a rebuild in backward holds besides activations, per unit:

    * ``recompute_extra_bytes``: a rebuild runs under autocast again and casts the unit's
      weights again;
    * ``grads_from_bytes``: the parameter gradients backward has made by then, those of the
      unit and of every unit after it in forward order, and (not knowing where in their
      forward they are used) those of its ancestors' own parameters.
    """
    width = 4 if policy.master_weights else None

    def grad_bytes(params: list[nn.Parameter]) -> float:
        return float(sum(p.numel() * (width or p.element_size()) for p in params))

    order: list[UnitCost] = list(root.walk())  # forward order: parents before children
    own: dict[str, float] = {}
    for unit in order:
        module = model.get_submodule(unit.name)
        inner = {id(p) for c in unit.children for p in model.get_submodule(c.name).parameters()}
        own[unit.name] = grad_bytes(
            [p for p in module.parameters() if p.requires_grad and id(p) not in inner]
        )
    after: dict[str, float] = {}
    total = 0.0
    for unit in reversed(order):
        total += own[unit.name]
        after[unit.name] = total

    def fill(unit: UnitCost, above: float) -> UnitCost:
        children = [fill(c, above + own[unit.name]) for c in unit.children]
        return dataclasses.replace(
            unit,
            children=children,
            recompute_extra_bytes=float(_cast_bytes(model.get_submodule(unit.name), policy)),
            grads_from_bytes=after[unit.name] + above,
        )

    return fill(root, 0.0)


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: str | int | float | None = None,
    strategy: str = "optimal",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    precision: str | PrecisionPolicy | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    units: Sequence[str] | None = None,
) -> Plan:
    """Profile ``model`` on ``example_inputs`` under ``precision`` and plan under ``budget``.

    ``example_inputs``: a tensor (``model(x)``), a tuple (``model(*args)``) or a dict
    (``model(**kwargs)``) of the batch size training uses. ``loss_fn(output) -> scalar``;
    default: the sum of the first floating-point tensor in the output. ``budget`` is the
    peak of a whole training step ("2GiB", bytes, or a fraction of device memory); None
    plans without a limit (``optimal`` then recomputes nothing).

    Example::

        plan = memfit.plan(model, x, budget="1GiB", precision="bf16-mixed")
        memfit.apply_plan(model, plan)
    """
    policy = PrecisionPolicy.of(precision)
    prof = profile(model, example_inputs, loss_fn=loss_fn, precision=policy, units=units)
    return _solve(model, prof, prof.root, prof.structure, budget, strategy, policy, optimizer)


#: Share of the budget kept free when planning: the allocator's slack and the temporaries
#: of backward the cost model leaves out.
RESERVE = 0.02


def _solve(
    model: nn.Module,
    prof: Profile,
    root: UnitCost,
    structure: list[tuple[str, str]],
    budget: str | int | float | None,
    strategy: str,
    policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None,
    output_bytes: float | None = None,
    loss_saved_bytes: float | None = None,
    frontier: bool = True,
) -> Plan:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    budget_bytes = None if budget is None else parse_bytes(budget, device)
    mem = step_memory(model, prof, policy, optimizer, output_bytes, loss_saved_bytes, root)
    optimizer_phase = mem.base_bytes + mem.grad_bytes
    if budget_bytes is not None and optimizer_phase > budget_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below what the optimizer step alone holds, "
            f"{format_bytes(optimizer_phase)} (parameters, gradients and optimizer state): no "
            "checkpoint plan can fit it. Raise the budget, use a '*-master' precision or a "
            "smaller optimizer state, or shard the model."
        )
    root = _with_backward_costs(root, model, policy)
    held = mem.base_bytes + mem.in_flight_bytes
    # Plans fit within 1 - RESERVE of the budget; errors name the budget that would fit.
    solution = solve(
        root, strategy, budget_bytes, held, mem.loss_bytes, reserve=RESERVE, frontier=frontier
    )
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
    if solution.note and budget_bytes is not None and solution.recompute_flops == 0:
        # The solver's note speaks of activations only; say it with the whole step's peak.
        solution.note = (
            f"budget {format_bytes(budget_bytes)} is at or above the step's predicted peak "
            f"without checkpointing, {format_bytes(solution.predicted_peak_bytes)} (memfit "
            f"plans within {1 - RESERVE:.0%} of the budget): nothing is recomputed"
        )
    return Plan.from_solution(solution, precision=policy.mode, structure=structure)


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


def plan_step(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    budget: str | int | float | None = None,
    strategy: str = "optimal",
    precision: str | PrecisionPolicy | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    frontier: bool = True,
) -> Plan:
    """Plan for a step written as ``loss_fn(model, batch)`` (the Engine's form of a step).
    ``frontier=False`` leaves out the plan's (peak, time) frontier, which takes most of
    the solve's time on trees of hundreds of units.

    Example::

        plan = plan_step(model, batch, gpt_loss, budget="1GiB", precision="bf16-mixed")
    """
    policy = PrecisionPolicy.of(precision)
    names = find_units(model).names()
    step_module = _StepModule(model, loss_fn)
    prefixed = ["model" if not n else f"model.{n}" for n in names]
    prof = profile(
        step_module, (batch,), loss_fn=lambda loss: loss, precision=policy, units=["", *prefixed]
    )
    model_root = next((c for c in prof.root.children if c.name == "model"), None)
    if model_root is None:
        raise PlanError("profiling did not see the model run; loss_fn must call the model")
    root = _strip_prefix(model_root, "model.")
    structure = structure_fingerprint(model, names)
    # The loss outside the model saves its own tensors (e.g. fp32 logits), and the model's
    # output lives until the loss's backward: neither can be recomputed by a plan.
    return _solve(
        model,
        prof,
        root,
        structure,
        budget,
        strategy,
        policy,
        optimizer,
        output_bytes=prof.output_bytes + model_root.output_bytes,
        loss_saved_bytes=prof.loss_saved_bytes + prof.root.own_saved_bytes,
        frontier=frontier,
    )


def plan_for_engine(engine: Engine, request: Any, micro_batch: Any, loss_fn: Any) -> Plan:
    """Resolve the Engine's ``checkpoint=`` request on its first micro-batch and apply it.

    A :class:`Plan` is applied as given. ``"auto"`` and ``"optimal"`` plan optimally under
    ``memory_budget`` (default: 90% of the device's memory); ``"full"``, ``"uniform:k"`` and
    ``"sqrt"`` use that strategy (under the budget when one is given).
    """
    if isinstance(request, Plan):
        apply_plan(engine.model, request)
        return request
    if not isinstance(request, str):
        raise ConfigError(
            f"checkpoint= takes a Plan or one of 'none', 'auto', 'optimal', 'full', "
            f"'uniform:k', 'sqrt'; got {type(request).__name__}"
        )
    strategy = "optimal" if request == "auto" else request
    budget = engine.settings.memory_budget
    if budget is None and strategy == "optimal":
        budget = int(0.9 * device_memory_bytes(engine.device))
    # Training needs the plan, not the frontier that `memfit plan` shows (start-up time).
    result = plan_step(
        engine.model,
        micro_batch,
        loss_fn,
        budget,
        strategy,
        engine.policy,
        engine.optimizer,
        frontier=False,
    )
    apply_plan(engine.model, result)
    return result
