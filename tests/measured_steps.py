"""The allocator's peak of one training step under a plan, for the tests that compare a
plan's predicted peak with what its step measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memfit
from memfit.allocator import AllocatorPeak, allocator_peak, optimizer_tensors


def planned_step_peak(
    model: nn.Module,
    plan: memfit.Plan,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> int:
    """The allocator's peak of one step (zero the gradients, forward and backward, the
    optimizer's step) with ``plan`` applied, from the parameters and the batch; the
    plan is taken off afterwards."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        optimizer.step()

    memfit.apply_plan(model, plan)
    try:
        return allocator_peak(step, live=[*model.parameters(), batch]).peak_bytes
    finally:
        memfit.remove_plan(model)


def training_state_peak(
    work: Callable[[], Any], model: nn.Module, optimizer: torch.optim.Optimizer, *extra: Any
) -> AllocatorPeak:
    """The allocator's peak of ``work`` from the training state alive when it starts: the
    parameters, buffers, gradients, optimizer state and ``extra`` (a batch), named inline
    and complete (``live_complete``), so that what the work frees (the gradients
    ``zero_grad`` sets to None) can go and is counted as freed.

    Example::

        training_state_peak(lambda: optimizer.step(closure), model, optimizer).peak_bytes
    """
    return allocator_peak(
        work,
        live=[
            *model.parameters(),
            *model.buffers(),
            *[p.grad for p in model.parameters() if p.grad is not None],
            *optimizer_tensors(optimizer),
            *extra,
        ],
        live_complete=True,
    )


class StepMeter:
    """The allocator's peak of each call of ``optimizer.step`` (wrapped in place), from
    the parameters, buffers, gradients and optimizer state alive when it starts: under a
    closure (Lightning's automatic optimization runs ``training_step``, ``zero_grad`` and
    backward inside it) it is the whole training step.

    Example::

        meter = StepMeter(model, optimizer)
        trainer.fit(...)
        max(meter.peaks[1:])   # the steps after the first, whose gradients were alive
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.peaks: list[int] = []
        step = optimizer.step

        def measured(*args: Any, **kwargs: Any) -> Any:
            peak = training_state_peak(lambda: step(*args, **kwargs), model, optimizer)
            self.peaks.append(peak.peak_bytes)
            return peak.result

        optimizer.step = measured  # type: ignore[method-assign]
