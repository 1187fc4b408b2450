"""The planner's public calls: :func:`make_plan` and :func:`plan` (``memfit.plan``).

Each runs the stages (:mod:`memfit.checkpoint.planner`: profile, step memory, solve) and
then verifies the plan on a measured step (:func:`memfit.checkpoint.closed_loop.verify_plan`)
unless told not to. ``plan`` also takes the call forms of earlier releases
(:mod:`memfit.checkpoint.old_calls`), each with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

from memfit.checkpoint.closed_loop import verify_plan
from memfit.checkpoint.costs import counted_times
from memfit.checkpoint.old_calls import PLAN_ORDER, PLAN_STEP_ORDER, by_position, takes_output
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.planner import Budget, PlanResult, resolve_policy, solve_profile
from memfit.checkpoint.profile_stage import profile_model, profile_step
from memfit.checkpoint.profiler.runner import backward_writes, default_loss, grads_set_aside
from memfit.checkpoint.step_memory import RankLayout, ZeroGrad, check_zero_grad
from memfit.checkpoint.storage_stage import DEFAULT_TOLERANCE
from memfit.deprecations import warn_renamed
from memfit.errors import ConfigError
from memfit.nested import call_model
from memfit.precision.policy import PrecisionPolicy

Costs = Literal["measured", "counted"]
"""What the solver weighs a recompute by: the profiled step's timings, or FLOPs and bytes."""


def check_costs(costs: str) -> None:
    """Raise a ConfigError for a ``costs`` that is not ``"measured"`` or ``"counted"``.

    >>> check_costs("counted")
    """
    if costs not in get_args(Costs):
        raise ConfigError(
            f"costs={costs!r}: use 'counted' (FLOPs and bytes: the same plan in every run) "
            "or 'measured' (the profiled step's timings)"
        )


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
    verify: bool = True,
    zero_grad: ZeroGrad = "before_forward",
    costs: Costs = "measured",
    activation_storage: Sequence[str] = ("keep", "recompute"),
    storage_tolerance: float = DEFAULT_TOLERANCE,
) -> PlanResult:
    """Plan a training step ``loss_fn(model, batch)``: profile -> step memory -> solve ->
    verify.

    ``batch`` is one micro-batch as training feeds it; ``accumulation_steps`` the
    micro-batches per optimizer step (above 1, the gradients of the earlier ones are held
    while the last one runs). ``budget`` is the peak of the whole step; None plans without
    a limit. Raises :class:`~memfit.errors.BudgetError` when no plan fits.
    ``world_size`` and ``data_parallel`` (``"ddp"``, ``"fsdp"``): plan one rank's step
    under a per-device ``budget`` (``batch`` is then that rank's micro-batch).
    ``verify``: measure the plan's step on ``batch`` and make it again from the
    measurement when it missed (:func:`verify_plan`); False returns the prediction alone.
    ``zero_grad``: where the training loop frees the last step's gradients:
    ``"before_forward"`` (after the optimizer step or before the forward), or
    ``"before_backward"`` (between forward and backward, as Lightning's automatic
    optimization does: they are alive through the forward), or ``"in_backward"`` (each
    freed as its update is applied in backward, ``Engine(release_gradients=True)``; the
    prediction is not verified by a measured step, which would hold them all).
    ``costs``: what the solver
    weighs recompute by, ``"measured"`` (the profiled step's timings) or ``"counted"``
    (FLOPs and bytes, :func:`~memfit.checkpoint.costs.counted_times`): the same plan for
    the same model, batch and budget in every run, where timings a few percent apart
    would pick between near-equal plans by noise. ``activation_storage``: what a kept
    unit may do with its saved tensors beside keeping them as they are: ``"bf16"``,
    ``"fp8"``, ``"offload"`` (CUDA), chosen per unit where the budget needs it and each
    only where its gradient error on ``batch`` is within ``storage_tolerance``
    (:mod:`memfit.checkpoint.storage_stage`; ``strategy="optimal"`` only).

    Example::

        result = make_plan(model, batch, loss_fn, optimizer=opt, precision="bf16-mixed",
                           budget="2GiB", accumulation_steps=4)
        memfit.apply_plan(model, result.plan)
    """
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    check_zero_grad(zero_grad)
    check_costs(costs)
    # The user's gradients (a micro-batch's, or a step's not applied yet; the masters' in an
    # Engine's model) are as they were after planning, whatever the measuring runs summed.
    with grads_set_aside(_backward_writes(model, optimizer)):
        policy, chosen = resolve_policy(precision, model, batch, loss_fn)
        profiled = profile_step(model, batch, loss_fn, policy, units)
        profiled = dataclasses.replace(profiled, notes=(*profiled.notes, *chosen))
        if costs == "counted":
            profiled = dataclasses.replace(
                profiled, root=counted_times(profiled.root), counted=True
            )
        layout = RankLayout.of(world_size, data_parallel)
        result = solve_profile(
            model,
            profiled,
            policy,
            optimizer,
            strategy,
            budget,
            int(accumulation_steps),
            frontier,
            layout=layout,
            zero_grad=zero_grad,
            activation_storage=activation_storage,
            storage_tolerance=storage_tolerance,
        )
        # The measured step is a usual one: it cannot stand for a loop that releases each
        # gradient in backward (the Engine measures its own first step instead).
        released = zero_grad == "in_backward"
        return verify_plan(result, model, optimizer) if verify and not released else result


def _backward_writes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Any]:
    stepped = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []
    return backward_writes(model, stepped)


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
    verify: bool = True,
    zero_grad: ZeroGrad = "before_forward",
    activation_storage: Sequence[str] = ("keep", "recompute"),
    storage_tolerance: float = DEFAULT_TOLERANCE,
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
    budget (docs/distributed.md). ``verify``: the plan's step is measured once on
    ``batch`` by the allocator (``plan.measured_peak_bytes``), and made again from the
    measurement when it missed the prediction (:func:`verify_plan`); False skips the
    measurement. ``zero_grad``: where the training loop frees the last step's gradients,
    ``"before_forward"`` (default), ``"before_backward"`` (Lightning's order: alive
    through the forward) or ``"in_backward"`` (released as their updates are applied:
    ``Engine(release_gradients=True)``; :func:`make_plan`). ``activation_storage`` and
    ``storage_tolerance``: kept units may store their saved tensors in bf16, int8, fp8 or (CUDA)
    host memory where the budget needs it (:func:`make_plan`; ``plan.storage``). Raises :class:`~memfit.errors.BudgetError` when no plan fits, predicted or
    measured.

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
        verify=verify,
        zero_grad=zero_grad,
        activation_storage=activation_storage,
        storage_tolerance=storage_tolerance,
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
    verify: bool,
    zero_grad: ZeroGrad,
    **solve_settings: Any,
) -> Plan:
    """:func:`plan` of ``output_loss(model(batch))`` (default: the sum of the output), the
    model profiled alone with its output held through backward unless ``keep_output`` is
    False."""
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    check_zero_grad(zero_grad)
    optimizer = solve_settings["optimizer"]
    with grads_set_aside(_backward_writes(model, optimizer)):  # as make_plan
        loss_of = output_loss or default_loss
        policy, chosen = resolve_policy(
            precision, model, batch, lambda m, x: loss_of(call_model(m, x))
        )
        held = True if keep_output is None else keep_output
        profiled = profile_model(model, batch, output_loss, policy, units, held)
        profiled = dataclasses.replace(profiled, notes=(*profiled.notes, *chosen))
        result = solve_profile(
            model,
            profiled,
            policy,
            optimizer,
            solve_settings["strategy"],
            solve_settings["budget"],
            int(accumulation_steps),
            solve_settings["frontier"],
            layout=RankLayout.of(world_size, data_parallel),
            zero_grad=zero_grad,
            activation_storage=solve_settings["activation_storage"],
            storage_tolerance=solve_settings["storage_tolerance"],
        )
        return (verify_plan(result, model, optimizer) if verify else result).plan


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
