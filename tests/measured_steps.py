"""The allocator's peak of one training step under a plan, for the tests that compare a
plan's predicted peak with what its step measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak


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
