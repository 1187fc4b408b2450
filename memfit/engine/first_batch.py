"""The Engine's first batch: every choice it makes there, in one place and one order.

:class:`FirstBatchStage` is the part of :class:`~memfit.engine.core.Engine` that makes them
(a base class of the Engine, kept in its own module; it imports nothing of the core):
``precision="auto"``, then ``micro_batch="auto"``'s split of the global batch, then the
checkpoint plan, each under those before it (the Engine's order: precision, then plan),
and ``log_dir``'s ``config.json`` once they are made. Here too: the policy's islands put
on the model (when the Engine is made, and again in a mode ``"auto"`` chose), and the move
to more micro-batches when a split's first step measured over the budget, planned again
on the next step.

What each choice is lives in the parts it calls, which take data and return what changes:
:mod:`memfit.engine.auto` (the two ``"auto"`` choices, the smaller split),
:mod:`memfit.engine.precision_stage` (training in the chosen mode),
:mod:`memfit.engine.plan_stage` (the plan) and :mod:`memfit.engine.run_files`
(``config.json``); the methods here set their answers on the Engine.

Example::

    engine = memfit.Engine(model, opt, precision="auto", micro_batch="auto", memory_budget="4GiB")
    engine.train_step(batch, loss_fn)          # Engine._first_batch_choices, then the step
    engine.auto.precision_choice, engine.auto.split_choice, engine.plan
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memfit.engine.auto import (
    AutoRequest,
    FirstBatch,
    choose_precision,
    choose_split,
    smaller_split,
)
from memfit.engine.batches import Batch
from memfit.engine.plan_stage import EnginePlan, strategy_plan
from memfit.engine.precision_stage import switched_precision
from memfit.engine.settings import EngineSettings
from memfit.errors import ConfigError
from memfit.precision.apply import apply_precision, note_kernel_islands
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import LossScaler

if TYPE_CHECKING:
    from memfit.engine.data_parallel import EngineParallel
    from memfit.engine.run_files import RunRecord
    from memfit.monitor.monitor import Monitor
    from memfit.precision.speed import PrecisionChoice

LossFn = Callable[[nn.Module, Batch], torch.Tensor]


class FirstBatchStage:
    """The Engine's methods for its first batch (see the module docstring); the Engine
    sets every attribute below in its ``__init__``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    policy: PrecisionPolicy
    scaler: LossScaler
    settings: EngineSettings
    auto: AutoRequest
    parallel: EngineParallel | None
    monitor: Monitor
    units: list[str] | None
    log_dir: Path | None
    islands: Any
    plan: Any
    plan_check: Any
    _checkpoint_request: Any
    _plan_to_check: EnginePlan | None
    _run_record: RunRecord

    def _first_batch_choices(self, batch: Batch, loss_fn: LossFn, *, global_batch: bool) -> None:
        """Every choice the Engine makes on its first batch, here and in this order, each
        made under those before it (the Engine's order: precision, then plan):

        1. **precision**, for ``precision="auto"``: the matmul probe, then the model timed
           in each candidate mode on the first micro-batch
           (:func:`~memfit.engine.auto.choose_precision`);
        2. **micro-batch**, for ``micro_batch="auto"``: how ``train_step`` splits the
           global batch (``accumulation_steps``), under that precision; with both
           ``"auto"``, 1 and 2 are chosen together, the model timed on the micro-batch the
           probe's mode splits to (:func:`~memfit.engine.auto.choose_split`);
        3. **checkpoint plan**, for micro-batches like the first, under both
           (:meth:`_make_plan`).

        ``train_step`` calls it with its whole batch before splitting it (``global_batch``:
        2, with 1, when ``micro_batch="auto"``); the first micro-batch (``backward``,
        through :meth:`~memfit.engine.core.Engine.prepare`) calls it for the rest: 1 where still open, then 3. A
        choice made is not made again.
        """
        auto = self.auto
        if auto.micro_batch and not global_batch:
            raise ConfigError(
                "micro_batch='auto' chooses how train_step(batch) splits its batches; "
                "micro-batches fed with backward() (or given to prepare()) are split already. "
                "Call train_step(batch) with the global batch, or drop micro_batch='auto'"
            )
        if auto.micro_batch:  # 2, with 1 when precision="auto" too
            first = self._first_batch()
            split = choose_split(first, batch, loss_fn, with_precision=auto.precision)
            if split.precision is not None:
                self._use_precision(split.precision)
            chosen = split.fitting()  # BudgetError when nothing fits
            self.settings.accumulation_steps = chosen.accumulation_steps
            auto.split_choice = chosen
            auto.split_timed = split.timed
            auto.split_ranked, auto.split_request = split.ranked, self._checkpoint_request
            auto.split_plan = split.timed.best.plan if split.timed else None
            auto.micro_batch = False
        if global_batch:
            return  # the rest is for the first micro-batch of the split
        if auto.precision:  # 1
            self._use_precision(choose_precision(self._first_batch(), batch, loss_fn))
        self._make_plan(batch, loss_fn)  # 3
        # log_dir's config.json and plan.json, now that the choices are made.
        self._run_record.write_config(self.log_dir, self)

    def _first_batch(self) -> FirstBatch:
        """What the first batch's choices need (:mod:`memfit.engine.auto`)."""
        return FirstBatch(
            model=self.model,
            optimizer=self.optimizer,
            device=self.device,
            policy=self.policy,
            checkpoint_request=self._checkpoint_request,
            memory_budget=self.settings.memory_budget,
            data_parallel=self.parallel is not None,
            ranges=self.monitor.ranges,
            units=self.units,
        )

    def _use_precision(self, choice: PrecisionChoice) -> None:
        """Train in the mode ``precision="auto"`` chose from now on: its policy, its islands
        and, for fp16, a dynamic loss scaler (when the Engine made its own)."""
        switch = switched_precision(
            choice, self.policy, self.auto.default_scaler, self.parallel is not None
        )
        self.policy = switch.policy
        self.settings.precision = switch.policy.mode
        self._apply_policy()
        if switch.scaler is not None:
            self.scaler = switch.scaler
        self.auto.precision_choice = choice
        self.auto.precision = False

    def _apply_policy(self) -> None:
        """The policy's fp32 islands on the model (stage one of the Engine's order), and
        the modules this device has no kernel for in its dtype."""
        policy = self.parallel.precision(self.policy) if self.parallel else self.policy
        self.islands = apply_precision(self.model, policy)
        self.settings.kernel_islands = note_kernel_islands(self.model, self.policy)

    def _make_plan(self, batch: Batch, loss_fn: LossFn) -> None:
        """Make and apply the checkpoint plan the Engine was asked for (once)."""
        request = self._checkpoint_request
        if request is None:
            return
        if isinstance(request, str) and request == "none":
            self._checkpoint_request = None
            return
        from memfit.checkpoint.apply import apply_plan

        if isinstance(request, str):  # a strategy: planned here (memfit.engine.plan_stage)
            planned = strategy_plan(
                request,
                self.model,
                self.optimizer,
                self.policy,
                self.settings,
                batch,
                loss_fn,
                self.units,
                self.device,
                ready=self.auto.split_plan,
            )
            self.auto.split_plan = None
            self._plan_to_check = planned
            request = planned.result.plan
        apply_plan(self.model, request)
        self.plan = request
        self._checkpoint_request = None  # only now: a failed planning is tried again

    def _split_smaller(self, measured_peak_bytes: int) -> bool:
        """``micro_batch="auto"`` whose first step under its least plan measured over the
        budget (applied: nothing is lost): the batch is split into more micro-batches from
        the next step (:func:`~memfit.engine.auto.smaller_split`), planned again, and its
        first step measured again. False where there is no such split, or under DDP/FSDP2
        (the ranks' measurements differ; every rank raises)."""
        if self.parallel is not None:
            return False
        now, budget = self.settings.accumulation_steps, self.settings.memory_budget
        nxt = smaller_split(self.auto, now, self.policy.mode, measured_peak_bytes, budget)
        if nxt is None:
            return False
        from memfit.checkpoint.apply import remove_plan

        remove_plan(self.model)
        self.plan = self.plan_check = None
        self.settings.accumulation_steps = nxt.accumulation_steps
        self.auto.split_choice = nxt
        self._checkpoint_request = self.auto.split_request  # planned for the new micro-batch
        return True
