"""Budgets held in a plain training loop written with accelerate: its optimizer steps
measured by the allocator against the budget ``plan_accelerated`` planned for and the peak
it predicted.

The loop is accelerate's own pattern: for each micro-batch, under
``accelerator.accumulate(model)``, forward, ``accelerator.backward``, ``optimizer.step()``
and ``optimizer.zero_grad()`` (accelerate skips the last two until the last micro-batch of
an optimizer step). One optimizer step (``gradient_accumulation_steps`` micro-batches) is
measured at a time, counted from the parameters, buffers, gradients, optimizer state and
micro-batches alive when it starts (``memfit.allocator.allocator_peak`` with
``live_complete=True``). The first step is measured too, so that what it leaves is known to
the allocator's reporter; the steps after it, which start with AdamW's state, are the ones
compared. Budgets are placed between steps measured here (the unplanned step, and the step
under memfit's ``full`` plan), not written down, so they follow this machine's kernels.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from cpu_kind import native_bf16
from hf_cases import Tokens, tiny_gpt2

from memfit.errors import BudgetError, ConfigError
from memfit.precision.speed import assumed_speed
from tests.measured_steps import training_state_peak

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import AutocastKwargs  # noqa: E402

from memfit.integrations.accelerate import accelerate_precision, plan_accelerated  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
SEQ = 64
BATCH = 8
#: Optimizer steps run and measured; the first is the warm-up.
STEPS = 3
#: accelerate's ``mixed_precision`` settings tested, and memfit's mode for each.
PRECISIONS = {"no": "fp32", "bf16": "bf16-mixed"}
#: The largest error of a plan's predicted peak against its measured steps, relative to
#: the measurement.
TOLERANCE = 0.03


def _gpt2() -> torch.nn.Module:
    """Four decoder blocks, so that the budgets below leave one, two or three of them to
    recompute."""
    return tiny_gpt2(4, SEQ, VOCAB)


def _accelerator(mixed_precision: str, accumulation: int = 1, **kwargs: Any) -> Accelerator:
    """A fresh CPU ``Accelerator``: accelerate keeps one state per process, which refuses
    another precision once made, so it is reset first."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(
        cpu=True,
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=accumulation,
        **kwargs,
    )


@pytest.fixture(scope="module", autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """No accelerate state left behind for the tests after these."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@dataclass(frozen=True)
class LoopRun:
    """One run of the loop: each optimizer step's measured peak and what was planned."""

    steps: list[int]
    """The measured peak of optimizer steps 1 to :data:`STEPS`, bytes."""
    predicted_peak_bytes: float | None
    """The plan's predicted peak of a step (None without a plan)."""
    recomputed: tuple[str, ...]
    """The units the plan recomputes (none without a plan)."""

    @property
    def peak(self) -> int:
        """The highest measured step after the first (AdamW's state exists from then on)."""
        return max(self.steps[1:])

    @property
    def error(self) -> float:
        """The predicted peak's error relative to the measured steps (+: over-predicted)."""
        assert self.predicted_peak_bytes is not None
        return (self.predicted_peak_bytes - self.peak) / self.peak


def _train(
    mixed_precision: str,
    accumulation: int,
    zero_grad_between: bool = False,
    **planning: Any,
) -> LoopRun:
    """:data:`STEPS` optimizer steps of the plain loop on the tiny GPT-2, each measured;
    planned first with ``plan_accelerated(**planning)`` when ``planning`` is given.
    ``zero_grad_between``: the loop calls ``optimizer.zero_grad()`` between the forward and
    the backward instead of after the optimizer's step."""
    accelerator = _accelerator(mixed_precision, accumulation)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        Tokens(BATCH * accumulation * STEPS, SEQ, VOCAB), batch_size=BATCH
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # Drawn before measuring: the loader's collation is not the step's memory.
    batches = list(loader)
    plan = None
    if planning:
        run = plan_accelerated(accelerator, model, batches[0], optimizer=optimizer, **planning)
        plan = run.result.plan

    def step(micro_batches: list[dict[str, torch.Tensor]]) -> None:
        for batch in micro_batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if zero_grad_between:
                    optimizer.zero_grad()
                accelerator.backward(loss)
                optimizer.step()
                if not zero_grad_between:
                    optimizer.zero_grad()

    steps = []
    for i in range(STEPS):
        micro_batches = batches[i * accumulation : (i + 1) * accumulation]
        peak = training_state_peak(
            functools.partial(step, micro_batches), model, optimizer.optimizer, micro_batches
        )
        steps.append(peak.peak_bytes)
    assert accelerator.step == STEPS * accumulation  # every micro-batch ran
    if plan is None:
        return LoopRun(steps, None, ())
    recomputed = tuple(name for name, d in plan.decisions.items() if d != "keep")
    return LoopRun(steps, plan.predicted_peak_bytes, recomputed)


@pytest.fixture(scope="module")
def reference(one_thread: None) -> Callable[[str, int, str], LoopRun]:
    """The runs the budgets are placed between, each made once for the module:
    ``reference(mixed_precision, accumulation, kind)`` with kind "unplanned" (no plan) or
    "full" (memfit's full plan, the least peak its strategies reach here)."""
    runs: dict[tuple[str, int, str], LoopRun] = {}

    def get(mixed_precision: str, accumulation: int, kind: str) -> LoopRun:
        key = (mixed_precision, accumulation, kind)
        if key not in runs:
            planning = {"budget": None, "strategy": "full"} if kind == "full" else {}
            runs[key] = _train(mixed_precision, accumulation, **planning)
        return runs[key]

    return get


#: Known shortfalls, on the unsafe side, where the CPU computes bf16 natively: the plan at
#: a quarter of the way recomputes block 0 and the attention of blocks 1-3 ("selective"),
#: and its step measures above the prediction by more than the tolerance (accumulation 1:
#: 3,070,140 bytes against 2,964,660 predicted, -3.4%; accumulation 2: 3,297,980 against
#: 3,167,924, -3.9%). plan_accelerated's own measurement of the step (the allocator's,
#: within a few bytes of the loop's) holds the budget all the same.
_NATIVE_BF16_SHORT = {("bf16", 1, 0.25), ("bf16", 2, 0.25)}


@pytest.mark.parametrize("mixed_precision", list(PRECISIONS))
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_loop_steps_hold_the_budget_and_the_prediction(
    mixed_precision: str,
    accumulation: int,
    fraction: float,
    reference: Callable[[str, int, str], LoopRun],
    request: pytest.FixtureRequest,
) -> None:
    if (mixed_precision, accumulation, fraction) in _NATIVE_BF16_SHORT and native_bf16():
        reason = "native bf16: the selective plan's peak under-predicted by 3.4-3.9%, target 3%"
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))
    unplanned = reference(mixed_precision, accumulation, "unplanned")
    least = reference(mixed_precision, accumulation, "full")
    assert least.peak < unplanned.peak, (least.steps, unplanned.steps)
    # A fraction of the way from the least step memfit's full plan reaches to the unplanned.
    budget = int(least.peak + fraction * (unplanned.peak - least.peak))
    run = _train(mixed_precision, accumulation, budget=budget, strategy="optimal")
    # Under the unplanned step, only a plan that recomputes can hold the budget.
    assert run.recomputed, budget
    assert run.peak <= budget, (budget, run.steps, run.recomputed)
    assert abs(run.error) <= TOLERANCE, (budget, run.predicted_peak_bytes, run.steps)


def test_accumulated_gradients_are_planned_for(
    reference: Callable[[str, int, str], LoopRun],
) -> None:
    # With two micro-batches a step, the first one's gradients are held while the second
    # runs: each step peaks higher than with one, and the plan predicts it so.
    for kind in ("unplanned", "full"):
        one, two = reference("no", 1, kind), reference("no", 2, kind)
        assert two.peak > one.peak, (kind, one.steps, two.steps)
    full_one, full_two = reference("no", 1, "full"), reference("no", 2, "full")
    assert full_one.predicted_peak_bytes is not None and full_two.predicted_peak_bytes is not None
    assert full_two.predicted_peak_bytes > full_one.predicted_peak_bytes


def test_a_loop_that_zeroes_the_gradients_before_backward_is_planned_so() -> None:
    # optimizer.zero_grad() between forward and backward: the last step's gradients are
    # alive through the forward. Planned with zero_grad="before_backward", the prediction
    # counts them there and holds within the tolerance of the loop's measured steps.
    usual = _train("no", 1, budget=None, strategy="none")
    between = _train("no", 1, True, budget=None, strategy="none", zero_grad="before_backward")
    assert usual.predicted_peak_bytes is not None and between.predicted_peak_bytes is not None
    grads = sum(p.numel() * 4 for p in _gpt2().parameters())
    assert 0 < between.predicted_peak_bytes - usual.predicted_peak_bytes <= grads
    for run in (usual, between):
        assert abs(run.error) <= TOLERANCE, (run.predicted_peak_bytes, run.steps)


def test_precision_is_the_accelerators() -> None:
    for setting, mode in PRECISIONS.items():
        policy = accelerate_precision(_accelerator(setting))
        assert (policy.mode, policy.autocast_cache) == (mode, True)
    # accelerate passes its AutocastKwargs to torch.autocast: no cache, none planned.
    handler = AutocastKwargs(cache_enabled=False)
    policy = accelerate_precision(_accelerator("bf16", kwargs_handlers=[handler]))
    assert (policy.mode, policy.autocast_cache) == ("bf16-mixed", False)


def test_fp16_on_a_cpu_is_planned_as_the_fp32_it_computes() -> None:
    # accelerate runs no fp16 autocast (and no loss scaler) on a CPU.
    with pytest.warns(UserWarning, match="planned as fp32"):
        policy = accelerate_precision(_accelerator("fp16"))
    assert policy.mode == "fp32"


def test_a_slow_bf16_cpu_is_said_in_accelerates_settings() -> None:
    accelerator = _accelerator("bf16")
    model = accelerator.prepare(_gpt2())
    ids = Tokens(BATCH, SEQ, VOCAB).ids
    with assumed_speed("cpu", {torch.bfloat16: 0.2}):
        with pytest.warns(UserWarning, match=r"0\.20x .* use Accelerator\(mixed_precision='no'\)"):
            with pytest.raises(BudgetError):  # warned before planning; no plan needed here
                plan_accelerated(accelerator, model, {"input_ids": ids, "labels": ids}, budget=1)


def test_a_precision_memfit_does_not_plan_is_a_config_error() -> None:
    # fp8 needs kernels a CPU has not: a stand-in accelerator that says it.
    fp8 = types.SimpleNamespace(mixed_precision="fp8", gradient_accumulation_steps=1)
    with pytest.raises(ConfigError, match=r"mixed_precision='fp8'.*'no', 'bf16', 'fp16'"):
        plan_accelerated(fp8, _gpt2(), {}, budget="10MiB")


def test_a_batch_without_labels_is_a_config_error() -> None:
    accelerator = _accelerator("no")
    model = accelerator.prepare(_gpt2())
    batch = {"input_ids": Tokens(BATCH, SEQ, VOCAB).ids}
    with pytest.raises(ConfigError, match="put labels in the batch .* to plan_accelerated"):
        plan_accelerated(accelerator, model, batch, budget=None, strategy="none")


def test_a_budget_too_small_is_said_in_accelerates_settings(
    reference: Callable[[str, int, str], LoopRun],
) -> None:
    accelerator = _accelerator("bf16", 2)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = Tokens(BATCH, SEQ, VOCAB).ids
    batch = {"input_ids": ids, "labels": ids}
    # Below what the optimizer step alone holds: 16-bit weights, accelerate's way.
    with pytest.raises(BudgetError) as raised:
        plan_accelerated(accelerator, model, batch, budget="1KiB", optimizer=optimizer)
    said = str(raised.value)
    # Without optimizer=, the optimizer accelerate prepared is counted: the same error.
    with pytest.raises(BudgetError) as by_default:
        plan_accelerated(accelerator, model, batch, budget="1KiB")
    assert str(by_default.value) == said
    assert "model.to(torch.bfloat16), with Accelerator(mixed_precision='no')" in said, said
    assert "'*-master' precision" not in said, said
    # Below the least step any plan reaches (measured here): a smaller micro-batch, with
    # more accumulation steps, accelerate's way.
    budget = int(0.9 * reference("bf16", 2, "full").peak)
    with pytest.raises(BudgetError) as raised:
        plan_accelerated(accelerator, model, batch, budget=budget, optimizer=optimizer)
    said = str(raised.value)
    assert "larger Accelerator(gradient_accumulation_steps=...)" in said, said
    assert "more accumulation steps" not in said, said
