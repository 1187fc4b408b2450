"""memfit's planner in a training loop written with Hugging Face accelerate:
:func:`plan_accelerated`.

A loop of your own has no callback to hook: call :func:`plan_accelerated` once, after
``accelerator.prepare`` and before the loop. It plans activation checkpointing under the
budget for the loop's step, under the accelerator's mixed precision and its
``gradient_accumulation_steps``, and applies the plan to the model.

Example::

    from memfit.integrations.accelerate import plan_accelerated

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    run = plan_accelerated(accelerator, model, example_batch, budget="200MiB",
                           optimizer=optimizer)
    run.result.plan.predicted_peak_bytes
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.integrations.common import require

require(["accelerate"], "memfit.integrations.accelerate")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memfit.checkpoint.api import Costs  # noqa: E402
from memfit.checkpoint.planner import Budget  # noqa: E402
from memfit.checkpoint.step_memory import ZeroGrad  # noqa: E402
from memfit.errors import BudgetError, ConfigError  # noqa: E402
from memfit.integrations.common import (  # noqa: E402
    LossFn,
    PlannedRun,
    announce,
    check_optimizer_state,
    check_settings,
    keep_optimizer_state,
    loss_from,
    plan_model,
    say_once,
)
from memfit.integrations.terms import ACCELERATE_TERMS  # noqa: E402
from memfit.nested import to_device  # noqa: E402
from memfit.precision.policy import PrecisionPolicy  # noqa: E402

__all__ = ["accelerate_precision", "model_loss", "plan_accelerated"]

#: memfit's mode for each of accelerate's ``mixed_precision`` settings it can plan.
_MODES = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}


def accelerate_precision(accelerator: Any) -> PrecisionPolicy:
    """memfit's precision for an ``Accelerator``: its ``mixed_precision`` ("no": fp32,
    "bf16": bf16-mixed, "fp16": fp16-mixed; others raise a ConfigError), with the weight
    cache its autocast keeps (an ``AutocastKwargs(cache_enabled=...)`` handler, else
    torch's default, which keeps it).

    Where accelerate runs no autocast for a 16-bit setting (fp16 on a CPU, or an
    ``AutocastKwargs(enabled=False)`` handler), the step computes in fp32 and is planned
    so, with a warning.

    Example::

        accelerate_precision(Accelerator(mixed_precision="bf16"))  # bf16-mixed, cache kept
    """
    setting = str(getattr(accelerator, "mixed_precision", None))
    mode = _MODES.get(setting)
    if mode is None:
        raise ConfigError(
            f"plan_accelerated cannot plan under accelerate's mixed_precision={setting!r}: "
            f"memfit plans {', '.join(repr(k) for k in _MODES)}; use one of those in "
            "Accelerator(mixed_precision=...)"
        )
    handler = getattr(accelerator, "autocast_handler", None)
    autocast_on = bool(getattr(accelerator, "native_amp", True))
    autocast_on = autocast_on and bool(getattr(handler, "enabled", True))
    if mode != "fp32" and not autocast_on:
        # accelerate wraps the model's forward in autocast only with native_amp on.
        say_once(
            f"accelerate runs mixed_precision={setting!r} without autocast here (fp16 on a "
            "CPU, or AutocastKwargs(enabled=False)): the step computes in fp32 and is "
            "planned as fp32"
        )
        mode = "fp32"
    # AutocastKwargs(cache_enabled=None), the default, passes nothing: torch's own setting.
    cache = getattr(handler, "cache_enabled", None)
    if cache is None:
        cache = torch.is_autocast_cache_enabled()
    return PrecisionPolicy(mode, autocast_cache=bool(cache))


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a model computes itself (a Hugging Face model's ``model(**batch).loss``
    when the batch holds labels); a ConfigError when its output holds none.

    Example::

        model_loss(model, {"input_ids": ids, "labels": ids})
    """
    output = model(**batch) if isinstance(batch, Mapping) else model(batch)
    where = f"{type(model).__name__}(**batch)"
    try:
        return loss_from(output, where)
    except ConfigError:
        raise ConfigError(
            f"{where} gave no loss tensor (got {type(output).__name__}); put labels in the "
            "batch so the model computes its loss, or pass loss_fn=(model, batch) -> loss "
            "to plan_accelerated"
        ) from None


def plan_accelerated(
    accelerator: Any,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    *,
    budget: Budget,
    strategy: str = "optimal",
    optimizer: Any = None,
    zero_grad: ZeroGrad = "before_forward",
    costs: Costs = "counted",
    optimizer_state: str = "fp32",
) -> PlannedRun:
    """Plan activation checkpointing for a loop written with accelerate and apply the plan
    to ``model``; call it after ``accelerator.prepare`` and before the loop.

    ``model``: the model as prepared (accelerate's wrappers are looked through with
    ``accelerator.unwrap_model``; its autocast forward is kept, since the loop runs it).
    ``batch``: one micro-batch as the loop feeds it (moved to the model's device).
    ``loss_fn(model, batch) -> loss``: default :func:`model_loss`, the model's own
    ``.loss``. ``budget``: the peak of a whole optimizer step ("200MiB", bytes, a fraction
    of device memory, or None for no limit). ``strategy``: "optimal" (default), "full",
    "sqrt", "uniform", "uniform:k" or "none". ``optimizer``: the loop's optimizer, as
    prepared or not, whose state is counted; None takes the one optimizer
    ``accelerator.prepare`` was given (none counted if it was given none). ``costs``: what
    recompute is weighed by, ``"counted"`` FLOPs and bytes (default: the same plan in every
    run) or ``"measured"`` timings.

    Planned for ``accelerator.mixed_precision`` (:func:`accelerate_precision`) and
    ``accelerator.gradient_accumulation_steps`` (the gradients of the earlier micro-batches
    are held while the last one runs). ``zero_grad``: where the loop frees the gradients.
    ``"before_forward"`` (default) is the usual loop, ``optimizer.step()`` then
    ``optimizer.zero_grad()`` after backward: each forward of a new step starts without
    gradients. A loop that calls ``zero_grad()`` between the forward and
    ``accelerator.backward(loss)`` holds the last step's gradients through the forward:
    pass ``zero_grad="before_backward"``. ``optimizer_state``: ``"8bit"`` or ``"bf16"``
    make the loop's Adam/AdamW or SGD keep its state in fewer bits
    (:mod:`memfit.precision.optimizer_state`), before planning.

    The step is measured once on ``batch`` by the allocator and the plan made again from
    the measurement when it missed (as the callbacks do: :func:`~memfit.integrations.
    common.plan_model`); parameters, gradients, buffers and the random state are put back.
    Raises memfit's ``BudgetError``, said in accelerate's settings, when no plan fits, and
    warns when the loop's 16-bit precision is slower than fp32 on this CPU. Returns the
    :class:`~memfit.integrations.common.PlannedRun` (``run.result.plan`` is the plan).

    Example::

        accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        run = plan_accelerated(accelerator, model, example_batch, budget="200MiB",
                               optimizer=optimizer)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    """
    policy = accelerate_precision(accelerator)
    check_settings(budget, strategy)
    check_optimizer_state(optimizer_state)
    module = accelerator.unwrap_model(model)
    if optimizer is None:
        prepared = list(getattr(accelerator, "_optimizers", []))
        optimizer = prepared[0] if len(prepared) == 1 else None
    # accelerate wraps the optimizer; the planner reads the optimizer's own class and state.
    optimizer = getattr(optimizer, "optimizer", optimizer)
    keep_optimizer_state(optimizer, optimizer_state)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    ACCELERATE_TERMS.warn_if_slow(policy, device)
    try:
        run = plan_model(
            module,
            to_device(batch, device),
            loss_fn or model_loss,
            budget=budget,
            strategy=strategy,
            precision=policy,
            accumulation_steps=int(accelerator.gradient_accumulation_steps),
            optimizer=optimizer,
            zero_grad=zero_grad,
            costs=costs,
        )
    except BudgetError as exc:
        raise BudgetError(ACCELERATE_TERMS.say(str(exc))) from None
    announce(run, verbose=False)
    return run
