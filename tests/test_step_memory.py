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
from memfit.checkpoint.planner import RESERVE, solve_profile
from memfit.checkpoint.profile_stage import profile_step
from memfit.checkpoint.step_memory import autocast_copy_bytes
from memfit.engine import split_batch
from memfit.errors import ConfigError
from memfit.models import build_model
from memfit.precision.policy import PrecisionPolicy
from tests.measured_steps import training_state_peak

pytestmark = pytest.mark.usefixtures("one_thread")


def _allocator_step_peak(engine: memfit.Engine, batch, loss_fn) -> int:
    model, opt = engine.model, engine.optimizer
    # The loss scaler's own tensors are alive too (the Engine's first step makes them).
    scaler = [v for v in vars(engine.scaler).values() if isinstance(v, torch.Tensor)]
    live = [*model.parameters(), *model.buffers(), *optimizer_tensors(opt), *scaler, batch]
    # Everything the step frees without making it is named: a free of anything else is left
    # out (the profiler may size it by an earlier block at its address: memfit.allocator).
    step = allocator_peak(lambda: engine.train_step(batch, loss_fn), live=live, live_complete=True)
    return step.peak_bytes


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


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(256, 8))


@pytest.mark.parametrize("kind", ["foreach", "per-parameter", "fused"])
def test_the_optimizer_steps_own_temporaries_are_counted(kind: str) -> None:
    # A foreach AdamW (torch's default for CUDA tensors) makes a parameter-sized temporary
    # in its step; when the step is the peak, a plan that leaves it out busts the budget.
    model = _mlp()
    flags = {"foreach": {"foreach": True}, "per-parameter": {"foreach": False}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **flags.get(kind, {"fused": True}))
    engine = memfit.Engine(model, opt, precision="fp32", log_every=10**9)
    batch = torch.randn(64, 256)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    policy = PrecisionPolicy.of("fp32")
    profiled = profile_step(model, batch, loss_fn, policy)
    profiled = dataclasses.replace(profiled, root=counted_times(profiled.root))
    engine.train_step(batch, loss_fn)
    result = solve_profile(model, profiled, policy, opt, "full", None)
    if kind == "fused":
        assert result.memory.optimizer_temp_bytes == 0
    else:
        assert result.memory.optimizer_temp_bytes > 0
    memfit.apply_plan(model, result.plan)
    measured = _allocator_step_peak(engine, batch, loss_fn)
    remove_plan(model)
    assert measured <= result.plan.predicted_peak_bytes * (1 + RESERVE), (kind, measured)
    error = abs(result.plan.predicted_peak_bytes - measured) / measured
    assert error <= 0.03, (kind, result.plan.predicted_peak_bytes, measured)


def _gpt_result(budget_share: float | None):
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=6, n_embd=64, n_head=4, block_size=128
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batch = batch_fn(16, generator=0)
    policy = PrecisionPolicy.of("fp32")
    profiled = profile_step(model, batch, loss_fn, policy)
    profiled = dataclasses.replace(profiled, root=counted_times(profiled.root))
    peaks = sorted(
        p.peak_bytes
        for p in solve_profile(model, profiled, policy, opt, "optimal", None).plan.frontier
    )
    budget = (
        None
        if budget_share is None
        else int(peaks[int(budget_share * (len(peaks) - 1))] / (1 - RESERVE)) + 1
    )
    return model, opt, solve_profile(model, profiled, policy, opt, "optimal", budget)


def test_a_step_that_peaks_above_its_prediction_is_replanned_from_the_same_profile() -> None:
    from memfit.checkpoint.closed_loop import check_plan

    model, opt, result = _gpt_result(0.6)
    predicted = result.plan.predicted_peak_bytes
    # Within the reserve the plan stands.
    same = check_plan(result, predicted * (1 + RESERVE / 2), model, opt)
    assert not same.replanned and same.plan is result.plan and same.correction_bytes == 0
    # 3% over: the step memory is corrected by the miss and the plan made again.
    miss = 0.03 * predicted
    check = check_plan(result, predicted + miss, model, opt)
    assert check.correction_bytes == pytest.approx(miss) and check.error == pytest.approx(0.03)
    assert check.plan.predicted_peak_bytes <= result.plan.budget_bytes * (1 - RESERVE)
    assert check.plan.static_bytes == pytest.approx(result.plan.static_bytes + miss)
    assert check.replanned and check.plan.recompute_seconds > result.plan.recompute_seconds
    assert "re-planned" in check.plan.notes[-1] and "+3.0%" in check.plan.notes[-1]
    # A miss no plan can absorb keeps the plan, and says so.
    with pytest.warns(UserWarning, match="no plan fits the budget"):
        kept = check_plan(result, 3 * predicted, model, opt)
    assert not kept.replanned and kept.plan is result.plan
    # Without a budget there is nothing to re-plan for.
    model, opt, unbudgeted = _gpt_result(None)
    assert not check_plan(
        unbudgeted, 2 * unbudgeted.plan.predicted_peak_bytes, model, opt
    ).replanned


def test_the_engine_measures_its_first_planned_step_and_reports_it() -> None:
    from memfit.checkpoint.apply import applied_plan

    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=4, n_embd=64, n_head=4, block_size=64
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    whole = memfit.plan(model, batch_fn(8, generator=0), loss_fn, precision="fp32", optimizer=opt)
    peaks = sorted(p.peak_bytes for p in whole.frontier)
    engine = memfit.Engine(
        model,
        opt,
        precision="fp32",
        checkpoint="auto",
        memory_budget=int(peaks[len(peaks) // 2]),
        log_every=1,
    )
    engine.train_step(batch_fn(8, generator=0), loss_fn)
    check = engine.plan_check
    assert check is not None and check.measured_peak_bytes > 0
    assert applied_plan(model) is engine.plan is check.plan
    assert engine.metrics["plan/measured_peak_bytes"] == check.measured_peak_bytes
    assert engine.metrics["plan/replanned"] == float(check.replanned)
    engine.train_step(batch_fn(8, generator=1), loss_fn)  # later steps are not measured again
    assert engine.plan_check is check


class _Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_blocks_of_different_widths_hold_their_budgets_across_the_frontier(precision: str) -> None:
    # Blocks 16x apart in width: a wide block's backward makes gradients of its hidden
    # layer, 16x the stream between blocks. The profiler measures what each unit's backward
    # holds beyond what it saves; without it every plan here ran 6-10% over its budget.
    torch.manual_seed(0)
    hidden = (64, 1024) * 4
    model = torch.nn.Sequential(*[_Block(64, h) for h in hidden], torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = memfit.Engine(model, opt, precision=precision, log_every=10**9)
    batch = torch.randn(256, 64)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    policy = PrecisionPolicy.of(precision)
    profiled = profile_step(model, batch, loss_fn, policy)
    profiled = dataclasses.replace(profiled, root=counted_times(profiled.root))
    engine.train_step(batch, loss_fn)
    frontier = solve_profile(model, profiled, policy, opt, "optimal", None).plan.frontier
    assert len(frontier) >= 10, len(frontier)
    for i, point in enumerate(frontier):  # every point of the frontier
        budget = int(point.peak_bytes / (1 - RESERVE)) + 1
        plan = solve_profile(model, profiled, policy, opt, "optimal", budget).plan
        memfit.apply_plan(model, plan)
        measured = _allocator_step_peak(engine, batch, loss_fn)
        remove_plan(model)
        assert measured <= budget, (precision, budget, measured, plan.decisions)
        error = abs(plan.predicted_peak_bytes - measured) / measured
        assert error <= (0.03 if i == 0 else 0.10), (precision, plan.predicted_peak_bytes, measured)


def test_a_budget_the_measured_full_plan_meets_is_not_refused() -> None:
    # The budget is what the full plan measures: whatever the model predicts, the Engine
    # trains (with 'full' where the prediction says nothing fits) and the first measured
    # step decides; far below it, the measured step says so with a BudgetError.
    import copy

    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=4, n_embd=64, n_head=4, block_size=64
    )
    batch = batch_fn(8, generator=0)
    probe_model = copy.deepcopy(model)
    probe_opt = torch.optim.AdamW(probe_model.parameters(), lr=1e-3, fused=True)
    probe = memfit.Engine(probe_model, probe_opt, precision="fp32", checkpoint="full")
    probe.train_step(batch, loss_fn)
    full_peak = _allocator_step_peak(probe, batch, loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # The first step is measured as later steps run (the optimizer state it creates
    # counted through backward), so it reaches full_peak itself; the allocator's peak
    # varies by a few KiB between steps, which the budget allows for.
    budget = int(full_peak * 1.001)
    engine = memfit.Engine(
        model, opt, precision="fp32", checkpoint="auto", memory_budget=budget, log_every=1
    )
    engine.train_step(batch, loss_fn)  # no BudgetError
    assert engine.plan_check is not None
    assert engine.plan_check.measured_peak_bytes <= full_peak * (1 + RESERVE)
    tight_model = copy.deepcopy(probe_model)
    memfit.remove_plan(tight_model)
    tight = memfit.Engine(
        tight_model,
        torch.optim.AdamW(tight_model.parameters(), lr=1e-3, fused=True),
        precision="fp32",
        checkpoint="auto",
        memory_budget=int(0.5 * full_peak),
    )
    with pytest.raises(memfit.errors.BudgetError, match="peaked at|below"):
        tight.train_step(batch, loss_fn)


def test_a_rank_layout_is_made_from_world_size_and_data_parallel_by_one_rule() -> None:
    from memfit.checkpoint.step_memory import RankLayout
    from memfit.errors import ConfigError

    assert RankLayout.of() == RankLayout.of(1, None) == RankLayout()
    # More than one rank without a kind: DDP, what memfit.parallelize runs by default.
    assert RankLayout.of(4) == RankLayout.of(4, "ddp") == RankLayout("ddp", 4)
    assert RankLayout.of(8, "fsdp") == RankLayout("fsdp", 8)
    with pytest.raises(ConfigError, match="needs world_size > 1"):
        RankLayout.of(1, "fsdp")
    with pytest.raises(ConfigError, match="data_parallel must be"):
        RankLayout.of(2, "zero")
    with pytest.raises(ConfigError, match="world_size must be"):
        RankLayout.of(0)


def test_optimizer_state_is_predicted_before_a_step_or_counted_as_allocated() -> None:
    from memfit.checkpoint.optimizer_bytes import optimizer_state_bytes

    model = torch.nn.Linear(8, 4)  # 36 elements in 2 tensors
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_state_bytes(opt) == 2 * 36 * 4 + 2 * 4  # two fp32 buffers, two steps
    assert optimizer_state_bytes(opt, predict=False) == 0  # nothing allocated yet
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert optimizer_state_bytes(opt, predict=False) == optimizer_state_bytes(opt) == 296
    # A view counts its own elements, or with storages=True all of its base, once.
    base = torch.zeros(10)
    opt.state[model.weight]["extra"] = base[:2]
    opt.state[model.bias]["extra"] = base[2:4]
    assert optimizer_state_bytes(opt) == 296 + 2 * 2 * 4
    assert optimizer_state_bytes(opt, storages=True) == 296 + 10 * 4


def test_autocasts_copies_are_of_the_weights_it_multiplies_not_of_lookup_tables() -> None:
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, 64), torch.nn.EmbeddingBag(500, 64), torch.nn.Linear(64, 32)
    )
    # bf16 copies of the Linear's weight alone: autocast casts no embedding lookup.
    assert autocast_copy_bytes(model, PrecisionPolicy("bf16-mixed")) == 64 * 32 * 2
    assert autocast_copy_bytes(model, PrecisionPolicy("fp32")) == 0


def _loop_step_peak(model, opt, batch, loss_fn, zero_grad: str) -> int:
    """The allocator's peak of one step of a plain loop that frees the gradients where
    ``zero_grad`` says, from the parameters, gradients and optimizer state alive."""

    def step() -> None:
        if zero_grad == "before_forward":
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        if zero_grad == "before_backward":  # Lightning's automatic optimization
            opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    # A first step under the allocator's profiler, so that the gradients it leaves are
    # known to its reporter with their sizes: a free of a block allocated outside any
    # profiling goes unreported.
    allocator_peak(step)
    return training_state_peak(step, model, opt, batch).peak_bytes


@pytest.mark.parametrize("strategy", ["none", "full"])
def test_a_loop_that_frees_the_gradients_before_backward_holds_them_through_the_forward(
    strategy: str,
) -> None:
    # Lightning runs training_step before zero_grad: the last step's gradients are alive
    # at the end of forward. Planned for that order the step is predicted within 3%;
    # planned for the usual order it measures above its prediction by about them.
    torch.manual_seed(0)
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=4, n_embd=64, n_head=4, block_size=64
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batch = batch_fn(8, generator=0)
    loss_fn(model, batch).backward()
    opt.step()  # the optimizer state and the gradients exist, as after any step
    plans = {
        order: memfit.plan(
            model,
            batch,
            loss_fn,
            precision="fp32",
            optimizer=opt,
            strategy=strategy,
            zero_grad=order,
            verify=False,
        )
        for order in ("before_forward", "before_backward")
    }
    grads = sum(p.numel() * 4 for p in model.parameters())
    before_forward = plans["before_forward"].predicted_peak_bytes
    predicted = plans["before_backward"].predicted_peak_bytes
    memfit.apply_plan(model, plans["before_backward"])
    measured = _loop_step_peak(model, opt, batch, loss_fn, "before_backward")
    remove_plan(model)
    assert abs(predicted - measured) <= 0.03 * measured, (strategy, predicted, measured)
    if strategy == "none":  # the end of forward is the step's peak: the gradients lift it
        assert 0 < predicted - before_forward <= grads
        assert measured > before_forward, (measured, before_forward)  # under-predicted
    else:  # recomputing every block, the end of forward is low: the peak is elsewhere
        assert predicted - before_forward <= grads


def test_zero_grad_names_where_the_loop_frees_the_gradients() -> None:
    model, loss_fn, batch_fn = build_model(
        "gpt", data="synthetic", n_layer=1, n_embd=16, n_head=2, block_size=8
    )
    with pytest.raises(ConfigError, match="zero_grad='after_step' is not a place"):
        memfit.plan(model, batch_fn(2, generator=0), loss_fn, zero_grad="after_step")


def test_the_losss_spike_leaves_out_a_block_a_checkpoint_keeps() -> None:
    # The spike (at the last unit's end, 5000 above the end of forward) held block 3
    # (2000 bytes) unsaved; the moments after it hold 2500. A plan that keeps block 3 as a
    # checkpoint's input counts it with what is kept: the spike is 3000 or the later 2500.
    from memfit.checkpoint.step_memory import StepMemory

    mem = StepMemory(
        base_bytes=0.0,
        loss_bytes=5000.0,
        grad_bytes=0.0,
        in_flight_bytes=0.0,
        loss_uncast_bytes=100.0,
        loss_quiet_bytes=100.0,
        spike_bytes=5000.0,
        spike_later_bytes=2500.0,
        spike_unsaved_inputs=((3, 2000.0),),
    )
    assert mem.loss_for(0.0) == 5000.0  # nothing kept as a checkpoint's input
    assert mem.loss_for(0.0, {4}) == 5000.0
    assert mem.loss_for(0.0, {3}) == 3000.0
    later = dataclasses.replace(mem, spike_later_bytes=4000.0)
    assert later.loss_for(0.0, {3}) == 4000.0
