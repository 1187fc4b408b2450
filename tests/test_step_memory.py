"""The step memory model against the allocator (torch.profiler's memory events on CPU).

Plans are solved on counted costs (FLOPs and bytes), so which plans are checked depends on
the model alone, never on how fast this machine ran the profile.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.apply import remove_plan
from memfit.checkpoint.costs import counted_times
from memfit.checkpoint.planner import RESERVE, profile_step, solve_profile
from memfit.engine import split_batch
from memfit.models import build_model
from memfit.precision.policy import PrecisionPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def _allocator_step_peak(engine: memfit.Engine, batch, loss_fn) -> int:
    model, opt = engine.model, engine.optimizer
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), batch]
    return allocator_peak(lambda: engine.train_step(batch, loss_fn), live=live).peak_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_accumulated_gradients_are_held_while_later_micro_batches_run(precision: str) -> None:
    # With 4 micro-batches the gradients of the first three are alive while the last one
    # runs forward and backward; a planner that counts them as absent busts the budget.
    steps = 4
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=6, n_embd=64, n_head=4, block_size=128
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = memfit.Engine(
        model, opt, precision=precision, accumulation_steps=steps, log_every=10**9
    )
    batch = batch_fn(16, generator=0)
    policy = PrecisionPolicy.of(precision)
    profiled = profile_step(model, split_batch(batch, steps)[0], loss_fn, policy)
    profiled = dataclasses.replace(profiled, root=counted_times(profiled.root))

    def plan(strategy: str, budget: int | None) -> memfit.Plan:
        return solve_profile(
            model, profiled, policy, opt, strategy, budget, accumulation_steps=steps
        ).plan

    peaks = sorted(p.peak_bytes for p in plan("optimal", None).frontier)
    budgets = [int(peaks[i] / (1 - RESERVE)) + 1 for i in (0, len(peaks) // 2)]
    engine.train_step(batch, loss_fn)  # the optimizer state exists from here on
    cases = [plan("none", None), plan("full", None), *(plan("optimal", b) for b in budgets)]
    for case in cases:
        memfit.apply_plan(model, case)
        measured = _allocator_step_peak(engine, batch, loss_fn)
        remove_plan(model)
        if case.budget_bytes is not None:
            assert measured <= case.budget_bytes, (precision, case.budget_bytes, measured)
        error = abs(case.predicted_peak_bytes - measured) / measured
        assert error <= 0.10, (precision, case.strategy, case.predicted_peak_bytes, measured)
