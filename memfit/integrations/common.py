"""What the Trainer and Lightning callbacks share: the example batch, the plan, the metrics.

Nothing here imports transformers or lightning. A callback

1. checks its settings when it is made (:func:`check_settings`),
2. at train begin takes an example batch (:func:`example_batch`), plans under the budget
   and applies the plan (:func:`plan_model`), measuring one planned forward and backward,
3. after each optimizer step tells :class:`RunMetrics` whether the step was skipped, and at
   each log step adds :meth:`RunMetrics.log_metrics` to the loop's logs.

:class:`CallbackCore` holds the settings and does steps 1 and 2 for both frameworks.

Example::

    check_settings("200MiB", "optimal")
    batch = example_batch(train_dataloader, torch.device("cpu"))
    run = plan_model(model, batch, loss_fn, budget="200MiB", strategy="optimal",
                     precision="bf16-mixed", accumulation_steps=1, optimizer=optimizer)
    metrics = RunMetrics(run)
    logs.update(metrics.log_metrics(loss=logs.get("loss")))
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.api import Costs, check_costs, make_plan
from memfit.checkpoint.apply import apply_plan, planned
from memfit.checkpoint.measured_fit import FitVerdict, judge_fit
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.planner import Budget, PlanResult
from memfit.checkpoint.profiler.runner import preserved
from memfit.checkpoint.solvers.fixed import parse_strategy
from memfit.checkpoint.step_memory import ZeroGrad
from memfit.errors import BudgetError, ConfigError, PlanError
from memfit.integrations.plan_cache import (
    CachedPlan,
    cache_dir,
    plan_key,
    read_cached,
    write_cached,
)
from memfit.integrations.terms import LoopTerms
from memfit.memory import MemoryReport, measure
from memfit.monitor.health import HealthCheck, HealthThresholds, check_health
from memfit.monitor.metrics import OverflowWindow, memory_metrics, plan_metrics
from memfit.monitor.sinks import is_rank_zero
from memfit.monitor.throughput import recompute_overhead_from_flops
from memfit.nested import to_device
from memfit.precision.optimizer_state import (
    can_keep,
    low_bit_state,
    state_bits,
)
from memfit.precision.optimizer_state import check_optimizer_state as check_state
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes, parse_bytes

log = logging.getLogger("memfit.integrations")

#: The extra that installs every framework the callbacks need.
EXTRA = "integrations"

#: Prefix of every key the callbacks add to the loop's logs.
PREFIX = "memfit/"

#: The keys (under :data:`PREFIX`) a callback logs by default: the ones a user acts on.
#: Each is logged where it is measured (``amp/*`` under fp16 only, the allocator's peak on
#: CUDA only); ``verbose=True`` logs every metric (docs/integrations.md lists them). The
#: loops log their own throughput (the Trainer's ``train_samples_per_second``), so the
#: callbacks add none.
DEFAULT_KEYS = (
    "plan/budget_bytes",  # the budget the plan was made for
    "plan/predicted_peak_bytes",  # the peak the plan predicts for a step
    "plan/measured_peak_bytes",  # one planned forward and backward, measured at train begin
    "memory/allocated_peak_bytes",  # the allocator's peak since the last log step (CUDA)
    "recompute/overhead",  # extra work of the plan's recompute, a fraction of a step
    "amp/overflow_rate",  # skipped steps over steps (fp16)
    "amp/skipped",  # skipped steps in all (fp16)
    "health/warnings",  # health checks that warn; each is logged once with its remedy
)

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def require(modules: Sequence[str], feature: str) -> None:
    """Raise an ImportError naming the extra to install when a module is missing.

    Example::

        require(["transformers", "accelerate"], "memfit.integrations.hf")
    """
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"{feature} needs {' and '.join(missing)}, not installed here; install memfit's "
            f"'{EXTRA}' extra: pip install 'memfit[{EXTRA}]'"
        )


def check_optimizer_state(optimizer_state: str) -> None:
    """Raise ConfigError for an ``optimizer_state`` the callbacks do not take: memfit's
    (:func:`memfit.precision.optimizer_state.check_optimizer_state`) or ``"auto"``, 8-bit
    state only where the budget needs it.

    >>> check_optimizer_state("auto")
    """
    check_state(optimizer_state, also=("auto",))


def keep_optimizer_state(optimizer: torch.optim.Optimizer | None, optimizer_state: str) -> None:
    """Make the loop's ``optimizer`` keep its state as ``optimizer_state`` says
    (:func:`~memfit.precision.optimizer_state.low_bit_state`); a ConfigError when a low-bit
    state is asked for and the loop has no optimizer to keep it.

    Example::

        keep_optimizer_state(trainer_optimizer, "8bit")
    """
    if optimizer_state in ("fp32", "auto"):  # "auto" converts only when planning needs it
        return
    if optimizer is None:
        raise ConfigError(
            f"optimizer_state={optimizer_state!r} converts the loop's optimizer, and this loop "
            "has none (or more than one) at train start; use optimizer_state='fp32', or convert "
            "it yourself with memfit.precision.optimizer_state.low_bit_state"
        )
    low_bit_state(optimizer, optimizer_state)


def check_settings(budget: Budget, strategy: str) -> None:
    """Raise a ConfigError now, not at train begin, for a bad budget or strategy.

    Example::

        check_settings("200MiB", "uniform:2")
    """
    fraction = isinstance(budget, float) and 0 < budget <= 1
    if budget is not None and not fraction:  # a fraction is of the model's device, later
        parse_bytes(budget)
    parse_strategy(strategy)


def example_batch(dataloader: Any, device: torch.device) -> Any:
    """The first batch ``dataloader`` yields in index order, on ``device``.

    Made from the dataloader's dataset and ``collate_fn`` (its first ``batch_size``
    samples) instead of by iterating it: starting an iterator draws from the global random
    state and moves the sampler (and, under accelerate, registers the loader as the active
    one), which would change the run the callback is part of.

    Example::

        batch = example_batch(trainer.get_train_dataloader(), torch.device("cpu"))
    """
    if dataloader is None:
        raise ConfigError(
            "no train dataloader to take an example batch from; pass example_batch= "
            "(one micro-batch as training feeds it) to MemfitCallback"
        )
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    size = getattr(dataloader, "batch_size", None)
    if size is None:
        size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    indexable = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if not (indexable and callable(collate) and size):
        raise ConfigError(
            f"cannot take an example batch from {type(dataloader).__name__}: it needs a "
            "dataset with __len__ and __getitem__, a batch_size and a collate_fn (an "
            "IterableDataset has no first batch to read without iterating); pass "
            "example_batch= to MemfitCallback"
        )
    count = min(int(size), len(dataset))
    if count == 0:
        raise ConfigError("the train dataset is empty: there is no example batch to plan with")
    return to_device(collate([dataset[i] for i in range(count)]), device)


@dataclass(frozen=True)
class PlannedRun:
    """A plan made (or read back) at train begin and what was measured under it."""

    plan: Plan
    """The plan applied to the model."""
    policy: PrecisionPolicy
    """The precision it was planned under."""
    report: MemoryReport | None
    """One forward and backward of the example batch under the plan, by kind and dtype
    (``memfit.measure``), or None when not measured (or read back)."""
    measured_peak_bytes: float | None
    """The plan's step as measured on the example batch: the allocator's count of one
    forward and backward over the step's static bytes as counted (the optimizer state
    included, made or not), in the loop's order (``PlanResult.measured_peak_bytes``)."""
    step_flops: float
    """FLOPs of one unplanned forward and backward (three times the forward's)."""
    device: torch.device
    """The model's device."""
    verdict: FitVerdict | None = None
    """That forward and backward judged against the plan's prediction and budget
    (:func:`~memfit.checkpoint.measured_fit.judge_fit`), or None when not measured. Its
    action is always ``"keep"``: the plan was made again from the measurement already."""
    result: PlanResult | None = None
    """The profile, step memory and solve the plan came from; None for a plan read back
    from the plan cache (:mod:`memfit.integrations.plan_cache`)."""
    kept_in: Path | None = None
    """The plan cache's file the plan was read from or written to, if any."""


@contextlib.contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """The global random state as it was afterwards, so planning changes no later draw."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        yield


def plan_model(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    budget: Budget,
    strategy: str,
    precision: str | PrecisionPolicy,
    accumulation_steps: int,
    optimizer: torch.optim.Optimizer | None,
    measure_memory: bool = True,
    zero_grad: ZeroGrad = "before_forward",
    costs: Costs = "counted",
) -> PlannedRun:
    """Plan ``loss_fn(model, batch)`` under ``budget`` (:func:`make_plan`), its step
    measured on ``batch`` and the plan made again from the measurement when it missed
    (``measure_memory``: :func:`~memfit.checkpoint.closed_loop.verify_plan`, the Engine's
    closed loop), and apply the plan to ``model``. ``zero_grad``: where the loop frees
    the last step's gradients (``"before_backward"`` in Lightning's automatic
    optimization). ``costs``: what recompute is weighed by (:func:`make_plan`); counted
    FLOPs and bytes by default, so that the same model, batch and budget get the same plan
    in every run.

    Parameters, gradients, buffers and the random state are as before; only the plan is
    new. Example::

        run = plan_model(model, batch, lambda m, b: m(**b).loss, budget="200MiB",
                         strategy="optimal", precision="fp32", accumulation_steps=1,
                         optimizer=None)
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with _forked_rng(device):
        result = make_plan(
            model,
            batch,
            loss_fn,
            optimizer=optimizer,
            precision=precision,
            strategy=strategy,
            budget=budget,
            accumulation_steps=accumulation_steps,
            frontier=False,
            verify=measure_memory,
            zero_grad=zero_grad,
            costs=costs,
        )
        report = None
        if measure_memory:
            report = _memory_by_kind(model, batch, loss_fn, result, optimizer)
    apply_plan(model, result.plan)
    flops = 3.0 * result.profile.profile.root.fwd_flops
    peak = result.measured_peak_bytes
    verdict = _verdict(result.plan, peak)
    return PlannedRun(result.plan, result.policy, report, peak, flops, device, verdict, result)


def _verdict(plan: Plan, measured_peak_bytes: float | None) -> FitVerdict | None:
    """The plan's measured step judged against its prediction and budget, None when not
    measured. No tolerance: the plan was made again from this measurement already
    (verify_plan)."""
    if measured_peak_bytes is None:
        return None
    return judge_fit(plan.predicted_peak_bytes, measured_peak_bytes, plan.budget_bytes)


def _memory_by_kind(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    result: PlanResult,
    optimizer: torch.optim.Optimizer | None,
) -> MemoryReport:
    """One forward and backward under the plan, by kind and dtype (memfit's tracker), with
    gradients and buffers put back."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def step() -> None:
        with result.policy.autocast(device.type):
            loss = loss_fn(model, batch)
        loss.backward()

    # Train mode for the measured step, as the profiler plans it; modes are put back.
    with preserved(model, train=True, rng_devices=[]), planned(model, result.plan):
        return measure(step, model=model, optimizer=optimizer)


class ScaleWatcher:
    """Tells skipped optimizer steps of a ``torch.amp.GradScaler`` from its scale.

    A GradScaler lowers its scale exactly when a step found inf/NaN gradients and was
    skipped, and otherwise keeps or raises it; it counts no skips itself. Reading the scale
    is one host sync per optimizer step, made only while the scaler is enabled (fp16).

    Example::

        watcher = ScaleWatcher(scaler)
        ...  # optimizer step, scaler.update()
        skipped = watcher.step_skipped()
    """

    def __init__(self, scaler: Any) -> None:
        enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
        self.scaler = scaler if enabled else None
        self.scale = self._read()

    def _read(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())

    def step_skipped(self) -> bool:
        """Whether the optimizer step just taken was skipped (False without a scaler)."""
        before, self.scale = self.scale, self._read()
        return before is not None and self.scale is not None and self.scale < before


class RunMetrics:
    """The metrics a callback adds to the loop's logs, from a :class:`PlannedRun` and the
    steps it is told about; names as in docs/monitoring.md, under :data:`PREFIX`.

    ``verbose``: every metric; else the :data:`DEFAULT_KEYS` measured (the health checks
    see every metric either way). ``terms``: the loop's own settings, which the health
    checks' remedies are said in.

    Example::

        metrics = RunMetrics(run, scaler=accelerator.scaler)
        metrics.observe_step()                      # after each optimizer step
        logs.update(metrics.log_metrics(loss=2.3))  # at a log step
    """

    def __init__(
        self,
        run: PlannedRun,
        scaler: Any = None,
        thresholds: HealthThresholds | None = None,
        window: int = 100,
        verbose: bool = False,
        terms: LoopTerms | None = None,
    ) -> None:
        self.run = run
        self.verbose = verbose
        self.terms = terms
        self.thresholds = thresholds or HealthThresholds()
        self.watcher = ScaleWatcher(scaler)
        self.window = OverflowWindow(window)
        self.steps = 0
        self.skipped = 0
        self.checks: list[HealthCheck] = []
        self._warned: set[str] = set()

    def observe_step(self) -> None:
        """Count one optimizer step (skipped or not, from the scaler)."""
        skipped = self.watcher.step_skipped()
        self.steps += 1
        self.skipped += int(skipped)
        self.window.push(skipped)

    def plan_metrics(self) -> dict[str, float]:
        """The plan's prediction and cost, and the planned forward and backward measured at
        train begin. No tensor is read."""
        plan = self.run.plan
        out = plan_metrics(plan)
        if self.run.step_flops > 0:
            out["recompute/overhead"] = recompute_overhead_from_flops(
                plan.recompute_flops, self.run.step_flops
            )
        if self.run.measured_peak_bytes is not None:
            out["plan/measured_peak_bytes"] = self.run.measured_peak_bytes
        if self.run.report is not None:
            out.update(memory_metrics(self.run.report))
        return out

    def amp_metrics(self) -> dict[str, float]:
        """Loss-scaler counters, when the loop scales the loss (fp16)."""
        if self.watcher.scaler is None:
            return {}
        return {
            "amp/scale": float(self.watcher.scale or 0.0),
            "amp/skipped": float(self.skipped),
            "amp/overflow_rate": self.skipped / self.steps if self.steps else 0.0,
            **self.window.metrics(),
        }

    def log_metrics(self, loss: float | None = None) -> dict[str, float]:
        """The metrics with :data:`PREFIX` (every one when ``verbose``, else the
        :data:`DEFAULT_KEYS` measured), and the health checks' warnings counted
        (``memfit/health/warnings``); each check that turns to a warning is logged once with
        its remedy. On CUDA, ``memory/allocated_peak_bytes`` is the allocator's peak since
        the last call (the statistic is reset)."""
        metrics = {**self.plan_metrics(), **self.amp_metrics()}
        device = self.run.device
        if device.type == "cuda":
            metrics["memory/allocated_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        checked = dict(metrics)
        if loss is not None:
            checked["loss"] = float(loss)
        self.checks = check_health(checked, self.run.policy, self.thresholds, {"has_plan": True})
        warned = [c for c in self.checks if c.status == "warn"]
        for check in warned:
            if check.name not in self._warned and is_rank_zero():
                self._warned.add(check.name)
                said = f"{check.name} ({check.detail})" if check.detail else check.name
                remedy = self.terms.say(check.remedy) if self.terms else check.remedy
                log.warning("memfit health: %s: %s", said, remedy)
        metrics["health/warnings"] = float(len(warned))
        return {
            PREFIX + key: value
            for key, value in metrics.items()
            if self.verbose or key in DEFAULT_KEYS
        }


def announce(run: PlannedRun, verbose: bool) -> None:
    """The plan's summary, once, on rank zero: logged to the ``memfit.integrations``
    logger, and printed when ``verbose``."""
    if not is_rank_zero():
        return
    text = run.plan.summary()
    if run.measured_peak_bytes is not None:
        text += (
            f"\nmeasured at train begin (the planned step on the example batch, in the "
            f"loop's order): {format_bytes(run.measured_peak_bytes)}"
        )
    if run.kept_in is not None:
        how = "read from" if run.result is None else "kept in"
        text += f"\nplan {how} {run.kept_in} (plan_cache=None plans every run)"
    log.info("memfit plan:\n%s", text)
    if verbose:
        print(text)


class CallbackCore:
    """What both ``MemfitCallback`` classes hold and do, framework-free: the settings
    (checked when made), the example batch, the plan made and applied at the start of
    training with its metrics, and the health of the last log step.

    A framework's callback subclasses it first, then the framework's callback class, and
    calls :meth:`start_run` once its loop has the model, the optimizer and the data.

    Example::

        class MemfitCallback(CallbackCore, TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                batch = self.planning_batch(kwargs["train_dataloader"], model.device)
                self.start_run(model, batch, self.loss_fn, precision="fp32",
                               accumulation_steps=1, optimizer=None)
    """

    #: The framework's own settings, which the callback's advice is said in.
    terms: LoopTerms | None = None

    def __init__(
        self,
        budget: Budget,
        strategy: str,
        *,
        loss_fn: LossFn | None,
        example_batch: Any,
        measure_memory: bool,
        thresholds: HealthThresholds | None,
        verbose: bool,
        costs: Costs = "counted",
        plan_cache: str | os.PathLike[str] | None = "auto",
        optimizer_state: str = "fp32",
    ) -> None:
        check_settings(budget, strategy)
        check_optimizer_state(optimizer_state)
        self.optimizer_state = optimizer_state
        self.plan_cache = plan_cache
        check_costs(costs)
        self.costs: Costs = costs
        self.budget = budget
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.example_batch = example_batch
        self.measure_memory = measure_memory
        self.thresholds = thresholds
        self.verbose = verbose
        self.run: PlannedRun | None = None
        self.metrics: RunMetrics | None = None

    @property
    def plan(self) -> Any:
        """The plan applied at the start of training (None before)."""
        return None if self.run is None else self.run.plan

    def health(self) -> list[HealthCheck]:
        """The health checks of the last log step (empty before one)."""
        return [] if self.metrics is None else list(self.metrics.checks)

    def planning_batch(self, dataloader: Any, device: torch.device) -> Any:
        """The ``example_batch`` given to the callback, else the first batch of
        ``dataloader`` (:func:`example_batch`), on ``device``."""
        if self.example_batch is not None:
            return to_device(self.example_batch, device)
        return example_batch(dataloader, device)

    def start_run(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn,
        *,
        precision: str | PrecisionPolicy,
        accumulation_steps: int,
        optimizer: torch.optim.Optimizer | None,
        scaler: Any = None,
        zero_grad: ZeroGrad = "before_forward",
    ) -> None:
        """Plan and apply under the callback's budget and strategy (:func:`plan_model`),
        make the run's :class:`RunMetrics` (``scaler``: the loop's fp16 GradScaler, if
        any) and announce the plan. ``zero_grad``: where the loop frees the gradients."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        policy = PrecisionPolicy.of(precision)
        if self.terms is not None:
            self.terms.warn_if_slow(policy, device)
        # Before planning: the plan is made for the state the optimizer will keep.
        keep_optimizer_state(optimizer, self.optimizer_state)
        # "auto" decides by planning, each run: a plan read back would not say the state.
        directory = None if self.optimizer_state == "auto" else cache_dir(self.plan_cache)
        settings = _planning_settings(self, policy, accumulation_steps, optimizer, zero_grad)
        key = plan_key(model, batch, loss_fn, settings) if directory is not None else ""
        cached = read_cached(directory, key)
        if cached is not None and not _applied(model, cached.plan):
            cached = None
        if cached is not None:
            plan, peak = cached.plan, cached.measured_peak_bytes
            verdict = _verdict(plan, peak)
            kept = None if directory is None else directory / f"{key}.json"
            self.run = PlannedRun(
                plan, policy, None, peak, cached.step_flops, device, verdict, None, kept
            )
        else:

            def plan() -> PlannedRun:
                return plan_model(
                    model,
                    batch,
                    loss_fn,
                    budget=self.budget,
                    strategy=self.strategy,
                    precision=policy,
                    accumulation_steps=accumulation_steps,
                    optimizer=optimizer,
                    measure_memory=self.measure_memory,
                    zero_grad=zero_grad,
                    costs=self.costs,
                )

            try:
                try:
                    run = plan()
                except BudgetError:
                    if not _state_can_shrink(self.optimizer_state, optimizer):
                        raise
                    # No plan fits with the optimizer's own state: with 8-bit state, 6 of
                    # AdamW's 8 bytes a parameter are free for the plan.
                    low_bit_state(optimizer, "8bit")
                    say_once(
                        f"memfit: no checkpoint plan fits {format_bytes(parse_bytes(self.budget, device))} "
                        "with the optimizer's fp32 state; its state is kept in 8 bits "
                        "(optimizer_state='auto', docs/tiers.md)"
                    )
                    run = plan()
            except BudgetError as exc:
                if self.terms is None:
                    raise
                raise BudgetError(self.terms.say(str(exc))) from None
            kept = write_cached(
                directory, key, CachedPlan(run.plan, run.measured_peak_bytes, run.step_flops)
            )
            self.run = dataclasses.replace(run, kept_in=kept)
        self.metrics = RunMetrics(
            self.run, scaler, self.thresholds, verbose=self.verbose, terms=self.terms
        )
        announce(self.run, self.verbose)


def _state_can_shrink(optimizer_state: str, optimizer: torch.optim.Optimizer | None) -> bool:
    """``optimizer_state="auto"``, and an optimizer whose state 8 bits can keep."""
    if optimizer_state != "auto" or optimizer is None or state_bits(optimizer) != "fp32":
        return False
    return can_keep(optimizer, "8bit")


def _applied(model: nn.Module, plan: Plan) -> bool:
    """Apply a plan read back from the cache; False (with a warning) where it does not
    fit the model after all, which is then planned again."""
    try:
        apply_plan(model, plan)
    except PlanError as exc:
        warnings.warn(
            f"the kept plan does not fit this model ({exc}); planning again", stacklevel=4
        )
        return False
    return True


def _planning_settings(
    core: CallbackCore,
    policy: PrecisionPolicy,
    accumulation_steps: int,
    optimizer: torch.optim.Optimizer | None,
    zero_grad: str,
) -> dict[str, Any]:
    """Everything besides the model, batch and loss that a plan depends on (the plan
    cache's key): the callback's settings, the precision, the loop and the optimizer's
    class and hyperparameters."""
    groups = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            hyper = {k: repr(v) for k, v in group.items() if k != "params"}
            groups.append([len(group["params"]), hyper])
    return {
        "budget": repr(core.budget),
        "strategy": core.strategy,
        "measure_memory": core.measure_memory,
        "costs": core.costs,
        "precision": [
            policy.mode,
            policy.autocast_cache,
            sorted(f"{t.__module__}.{t.__qualname__}" for t in policy.fp32_islands),
        ],
        "accumulation_steps": int(accumulation_steps),
        "zero_grad": zero_grad,
        "optimizer": None if optimizer is None else type(optimizer).__qualname__,
        "optimizer_state": state_bits(optimizer),
        "param_groups": groups,
    }


def say_once(message: str) -> None:
    """A warning for something the callback changed in the user's setup."""
    if is_rank_zero():
        warnings.warn(message, stacklevel=3)
        log.warning(message)


def loss_from(output: Any, where: str) -> torch.Tensor:
    """The loss in a step's output: a tensor, an object with ``.loss`` or a mapping with
    ``"loss"``; a ConfigError saying what to do when there is none."""
    loss = output
    if not isinstance(output, torch.Tensor):
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"{where} gave no loss tensor (got {type(output).__name__}"
            f"{'' if loss is None else ' with loss ' + type(loss).__name__}); put labels in "
            "the batch so the model computes its loss, or pass loss_fn=(model, batch) -> loss "
            "to MemfitCallback"
        )
    return loss
