"""The least plan's predicted peak against the allocator's measurement, and the two counts
behind it that the profiler gets right: gradients the autograd engine sums in place, and
an input that many units receive, held once."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import memfit
from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.checkpoint.planner import RESERVE
from memfit.checkpoint.profiler import profile

pytestmark = pytest.mark.usefixtures("one_thread")

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class ScanBlock(nn.Module):
    """A residual block with a recurrence over time, written as a loop (a state-space
    model's slow path): every step reads one time slice of two full-size tensors, so each
    of them gets its gradient as one full-size tensor per step, summed by the autograd
    engine into one buffer."""

    def __init__(self, width: int, state: int) -> None:
        super().__init__()
        self.state = state
        self.decay = nn.Linear(width, width * state)
        self.drive = nn.Linear(width, width * state)
        self.out = nn.Linear(width * state, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, steps, width = x.shape
        decay = torch.sigmoid(self.decay(x)).view(n, steps, width, self.state)
        drive = self.drive(x).view(n, steps, width, self.state)
        h = torch.zeros(n, width, self.state)
        outs = []
        for t in range(steps):
            h = decay[:, t] * h + drive[:, t]
            outs.append(h)
        return x + self.out(torch.stack(outs, dim=1).flatten(2))


def scan_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(ScanBlock(16, 8) for _ in range(3)))


def scan_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def measured_least_error(
    model: nn.Module, batch: torch.Tensor, loss_fn: LossFn
) -> tuple[float, float]:
    """(predicted, measured) peak of the least plan's step: planned at the least peak of
    the frontier, applied, one whole training step measured by the allocator after a
    warm-up step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step_of(m: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(m, batch).backward()
            opt.step()

        return step

    step_of(model, optimizer)()  # the optimizer's state exists in every copy
    probe_model, probe_opt = copy.deepcopy((model, optimizer))
    whole = memfit.plan(probe_model, batch, loss_fn, precision="fp32", optimizer=probe_opt)
    least = min(p.peak_bytes for p in whole.frontier)
    plan_model, plan_opt = copy.deepcopy((model, optimizer))
    plan = memfit.plan(
        plan_model,
        batch,
        loss_fn,
        precision="fp32",
        optimizer=plan_opt,
        budget=int(least / (1 - RESERVE)) + 1,
    )
    memfit.apply_plan(plan_model, plan)
    step = step_of(plan_model, plan_opt)
    step()
    live = [*plan_model.parameters(), *optimizer_tensors(plan_opt), batch]
    measured = allocator_peak(step, live=live).peak_bytes
    return float(plan.predicted_peak_bytes), float(measured)


def test_summed_gradients_are_counted_as_the_engine_sums_them_in_place() -> None:
    # Before: the profiler's dispatch mode turned each of the engine's in-place sums into
    # an out-of-place add, counting a second full-size buffer at every step: about +18%.
    model = scan_model()
    batch = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(0))
    predicted, measured = measured_least_error(model, batch, scan_loss)
    error = (predicted - measured) / measured
    # About -0.7% here (5 KB under; +8.7% before): within 3%, but below the measurement.
    assert abs(error) <= 0.03, f"predicted {predicted:.0f}, measured {measured:.0f}"


def test_a_units_backward_peak_counts_one_gradient_buffer() -> None:
    # The block's backward as the allocator sees it (a plain step, no dispatch mode) against
    # the profiler's count: saved bytes not yet reached plus what backward holds.
    torch.manual_seed(0)
    block = ScanBlock(16, 8)
    x = torch.randn(4, 32, 16, requires_grad=True)
    prof = profile(block, x, loss_fn=lambda out: out.sum(), units=["", "out"])
    loss = block(x).sum()
    live = [*block.parameters(), x, loss]
    backward = allocator_peak(loss.backward, live=live)
    # The allocator counts from the saved tensors, parameters and input alive at the start.
    resident = sum(t.numel() * t.element_size() for t in [*block.parameters(), x])
    measured = backward.peak_bytes - resident
    counted = prof.root.backward_peak_bytes
    full_buffer = 4 * 32 * 16 * 8 * 4  # one gradient of the decay (or drive) tensor
    assert counted >= measured, (counted, measured)
    # Counted as out-of-place sums, the count was about 2.9 buffers over the allocator's;
    # one buffer of it was the sums' (about 1.9 over now: the rest is not explained yet).
    assert counted - measured < 2.5 * full_buffer, (counted, measured)
