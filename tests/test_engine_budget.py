"""The Engine's closed loop holds its budget when the first step's measurement makes it
re-plan to recompute less: the re-made plan is measured before it replaces the plan whose
step was measured within the budget (a miss measured on one plan is not the same on
another). Memory is the allocator's; nothing here is timed."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(widths=(8, 16, 32), blocks_per_stage=(1, 1, 1), image_size=32)


def _resnet():
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model("resnet", data="synthetic", **SIZES)
    return model, loss_fn, batch_fn(16, generator=0)


def _step_peak(engine: memfit.Engine, batch, loss_fn) -> int:
    live = [
        *engine.model.parameters(),
        *engine.model.buffers(),
        *optimizer_tensors(engine.optimizer),
        batch,
    ]
    return allocator_peak(lambda: engine.train_step(batch, loss_fn), live).peak_bytes


@pytest.mark.parametrize("fraction", [0.3, 0.35, 0.4])
def test_a_budget_met_by_the_first_step_is_held_after_the_closed_loop(fraction: float) -> None:
    model, loss_fn, batch = _resnet()
    plain = memfit.Engine(model, torch.optim.AdamW(model.parameters()), precision="fp32")
    plain.train_step(batch, loss_fn)
    budget = int(fraction * _step_peak(plain, batch, loss_fn))
    model, loss_fn, batch = _resnet()
    engine = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision="fp32",
        memory_budget=budget,
        accumulation_steps=4,
        monitor=False,
    )
    try:
        engine.train_step(batch, loss_fn)  # plans; the closed loop judges this step
    except memfit.BudgetError as exc:
        assert "peaked at" in str(exc)  # refused with the measured number, never busted
        return
    first = engine.plan_check
    if first is None or first.measured_peak_bytes > budget:
        pytest.skip("the first step did not meet the budget on this CPU")
    assert _step_peak(engine, batch, loss_fn) <= budget
