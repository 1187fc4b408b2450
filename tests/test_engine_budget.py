"""The Engine's closed loop holds its budget when the first step's measurement makes it
re-plan to recompute less: the re-made plan is measured before it replaces the plan whose
step was measured within the budget (a miss measured on one plan is not the same on
another). Memory is the allocator's; nothing here is timed."""

from __future__ import annotations

import warnings

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


def test_micro_batch_auto_moves_to_a_smaller_micro_batch_instead_of_refusing() -> None:
    """An LSTM whose least plan at the chosen split measures over the budget (its oneDNN
    workspace), where halving the micro-batch fits: the Engine splits further from the
    next step, and its steps then hold the budget. Whichever split the timed trials
    chose, no BudgetError and every later step within the budget."""
    sizes = dict(n_embd=64, hidden_size=128, n_layer=2, seq_len=64)

    def lstm():
        torch.manual_seed(0)
        model, loss_fn, batch_fn = build_model("lstm", data="synthetic", **sizes)
        return model, loss_fn, batch_fn(16, generator=0)

    model, loss_fn, batch = lstm()
    plain = memfit.Engine(model, torch.optim.AdamW(model.parameters()), precision="fp32")
    plain.train_step(batch, loss_fn)
    budget = int(0.3 * _step_peak(plain, batch, loss_fn))
    model, loss_fn, batch = lstm()
    engine = memfit.Engine(
        model,
        torch.optim.AdamW(model.parameters()),
        precision="fp32",
        micro_batch="auto",
        memory_budget=budget,
        monitor=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # at most one move per step; each move's step is measured
            engine.train_step(batch, loss_fn)
    assert _step_peak(engine, batch, loss_fn) <= budget
    moved = [w for w in caught if "from the next step the batch is split" in str(w.message)]
    for w in moved:
        assert "over the budget" in str(w.message)
    assert engine.settings.accumulation_steps == engine.auto.split_choice.accumulation_steps


def test_next_split_is_the_fewest_more_micro_batches_predicted_to_fit() -> None:
    from types import SimpleNamespace

    from memfit.engine.auto import next_split

    def c(acc: int, fits: bool = True, mode: str = "fp32"):
        return SimpleNamespace(accumulation_steps=acc, fits=fits, precision=mode)

    ranked = [c(1), c(8), c(2, fits=False), c(4), c(4, mode="bf16-mixed")]
    assert next_split(ranked, 1, "fp32").accumulation_steps == 4
    assert next_split(ranked, 4, "fp32").accumulation_steps == 8
    assert next_split(ranked, 8, "fp32") is None
