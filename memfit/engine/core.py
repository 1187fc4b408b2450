"""The training engine: precision, checkpoint plan, accumulation, clipping, skipping, saving.

One :meth:`Engine.train_step` is one optimizer step over ``accumulation_steps``
micro-batches; the same step fed micro-batch by micro-batch is :meth:`Engine.backward` for
each, then :meth:`Engine.step` (:mod:`memfit.engine.feed`). In every precision mode a step whose gradients are not finite is skipped
(never written into the weights, the optimizer state or the LR schedule) and counted.

Host syncs: none per micro-batch. Per optimizer step: one inside ``LossScaler.step`` unless
the optimizer is fused (see :mod:`memfit.precision.scaler`), and one when an LR scheduler is
given (torch's schedulers run on the host and must not advance on a skipped step). Metrics
are read every ``log_every`` steps. On CPU the skip counter is also read every step, which
costs nothing there.

Example::

    engine = memfit.Engine(model, torch.optim.AdamW(model.parameters(), fused=True),
                           precision="bf16-mixed", accumulation_steps=4, clip_grad_norm=1.0)
    for batch in loader:
        loss = engine.train_step(batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    engine.save("run/last.pt")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from memfit.engine.auto import auto_policy
from memfit.engine.batches import Batch, batch_size, checked_loss, split_batch
from memfit.engine.data_parallel import EngineParallel
from memfit.engine.diagnose import check_skips, named_trained_params
from memfit.engine.evaluation import eval_context
from memfit.engine.feed import Window, clip_gradients, rescale_gradients, run_measured
from memfit.engine.first_batch import FirstBatchStage
from memfit.engine.plan_stage import EnginePlan, check_first_step
from memfit.engine.precision_stage import check_rounded_weights, default_scaler, fp32_masters
from memfit.engine.release import GradientRelease, release_choice
from memfit.engine.run_files import RunRecord
from memfit.engine.saving import SavingStage
from memfit.engine.settings import (
    EngineSettings,
    check_arguments,
    resolve_checkpoint,
    unit_names,
)
from memfit.engine.step_log import LogWindow, log_step_metrics
from memfit.errors import BudgetError, ConfigError, NonFiniteError
from memfit.monitor.health import HealthCheck
from memfit.monitor.metrics import plan_check_metrics
from memfit.monitor.monitor import Monitor, MonitorConfig
from memfit.monitor.sinks import Sink
from memfit.precision.kernels import module_device
from memfit.precision.optimizer_state import check_keepable, low_bit_state
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import LossScaler
from memfit.units import parse_bytes

LossFn = Callable[[nn.Module, Batch], torch.Tensor]


class Engine(FirstBatchStage, SavingStage):
    """Train a model with a precision policy, a checkpoint plan, accumulation and clipping.

    The model is changed in one documented order (torchtitan's ``apply_*`` order):

    1. **precision**, when the Engine is made: fp32 master weights (the ``*-master``
       modes; the optimizer then updates fp32 copies), or in ``bf16-sr`` memfit's own
       update with stochastic rounding of the bf16 weights, and the fp32 islands
       (:func:`~memfit.precision.apply.apply_precision`);
    2. **checkpoint plan**, on the first micro-batch (:meth:`prepare`, which the first
       micro-batch calls): planned under the precision of step 1 by
       :func:`~memfit.checkpoint.api.make_plan`, then applied with ``apply_plan``.

    ``memory_budget`` without ``checkpoint`` implies ``checkpoint="auto"``; with an
    explicit ``checkpoint="none"`` it is a ConfigError (the budget would be ignored).
    ``units``: the candidate checkpoint units (module names or the modules) instead of
    those :func:`memfit.checkpoint.find_units` finds, for models whose blocks it cannot find.
    ``precision="auto"`` and ``micro_batch="auto"`` choose the precision and the split of
    the global batch on the first batch, before the plan (:meth:`_first_batch_choices`
    holds every first-batch choice, in order). ``optimizer_state``: ``"8bit"`` or
    ``"bf16"`` make an Adam, AdamW or SGD optimizer keep its moments in fewer bits
    (:mod:`memfit.precision.optimizer_state`: 2 or 4 bytes a parameter for AdamW, not 8).
    ``release_gradients``: each update applied as its gradient is made in backward, so
    the gradients are never all held (:mod:`memfit.engine.release`; ``"auto"``: where legal).
    ``activation_storage``: beside ``"keep"`` and ``"recompute"``, ``"bf16"``, ``"int8"``, ``"fp8"``
    and (CUDA) ``"offload"`` let the plan store kept units' saved tensors coded where the
    budget needs it (:mod:`memfit.checkpoint.storage_stage`; ``plan.storage``).

    A step is a whole batch (:meth:`train_step`) or micro-batches fed as they come
    (:meth:`backward` each, then :meth:`step`); both train bitwise the same.

    After (or between) training: :meth:`eval_context` evaluates under the training
    precision, :meth:`model_state_dict` and :meth:`export` give the weights (the fp32
    masters in the ``*-master`` modes) for a fresh model, :meth:`save` and :meth:`load`
    go back to a step exactly.

    Example::

        engine = memfit.Engine(model, optimizer, precision="bf16-mixed", accumulation_steps=2)
        loss = engine.train_step(batch, loss_fn)   # loss_fn(model, micro_batch) -> scalar
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: str | PrecisionPolicy = "auto",
        checkpoint: Any = None,
        memory_budget: str | int | float | None = None,
        accumulation_steps: int = 1,
        clip_grad_norm: float | None = None,
        scaler: LossScaler | None = None,
        lr_scheduler: Any = None,
        log_every: int = 10,
        log_dir: str | Path | None = None,
        max_consecutive_skips: int = 50,
        monitor: MonitorConfig | bool = True,
        sinks: Sequence[Sink] = (),
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        units: Sequence[str | nn.Module] | None = None,
        micro_batch: str | None = None,
        optimizer_state: str = "fp32",
        release_gradients: bool | str = False,
        activation_storage: Sequence[str] = ("keep", "recompute"),
    ) -> None:
        check_arguments(
            accumulation_steps=accumulation_steps,
            clip_grad_norm=clip_grad_norm,
            log_every=log_every,
            max_consecutive_skips=max_consecutive_skips,
            checkpoint=checkpoint,
            memory_budget=memory_budget,
            optimizer_state=optimizer_state,
        )
        checkpoint = resolve_checkpoint(checkpoint, memory_budget)
        self.units = unit_names(model, units)
        self.policy, self.auto = auto_policy(precision, micro_batch, accumulation_steps, scaler)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = module_device(model)
        self.policy.check_device(self.device)
        budget = None if memory_budget is None else parse_bytes(memory_budget, self.device)
        self.settings = EngineSettings(
            precision="auto" if self.auto.precision else self.policy.mode,
            checkpoint=checkpoint if isinstance(checkpoint, str) else "plan",
            memory_budget=budget,
            accumulation_steps=int(accumulation_steps),
            clip_grad_norm=clip_grad_norm,
            log_every=int(log_every),
            max_consecutive_skips=int(max_consecutive_skips),
            optimizer_state=optimizer_state,
            activation_storage=_checked_storage(activation_storage),
        )
        if set(self.settings.activation_storage) - {"keep", "recompute"} and checkpoint == "none":
            raise ConfigError(
                f"activation_storage={self.settings.activation_storage!r} is chosen by the "
                "planner: give a memory_budget (checkpoint='auto'), or a Plan made with "
                "memfit.plan(..., activation_storage=...)"
            )
        self.scaler = scaler if scaler is not None else default_scaler(self.policy)
        # DDP or FSDP2 (memfit/engine/data_parallel.py); None on one process.
        self.parallel = EngineParallel.of(model, optimizer, self.policy, self.scaler, checkpoint)
        kind = self.parallel.kind if self.parallel else None
        # Refused before the model or the optimizer is changed (a failed start leaves them).
        rounded = self.policy.rounded_weights  # bf16-sr: memfit's step rounds the weights
        check_rounded_weights(
            self.policy, self.settings.accumulation_steps, self.auto.micro_batch, kind is not None
        )
        if optimizer_state != "fp32" or rounded:
            check_keepable(optimizer, optimizer_state, kind, rounded)
        released = release_choice(
            release_gradients,
            self.settings,
            self.auto.precision,
            self.auto.micro_batch,
            self.policy,
            self.scaler,
            self.parallel is not None,
            self.device,
        )
        owned = self.parallel is not None and self.parallel.owns_masters  # FSDP2 keeps its own
        self.master = fp32_masters(model, optimizer, self.policy, owned)
        # The state of what the optimizer updates (the masters, where there are masters).
        low_bit_state(optimizer, optimizer_state, kind, rounded)
        # After the masters' hooks: the release's hooks run once a master has its gradient.
        self.release = GradientRelease(model, optimizer, self.master) if released else None
        self._apply_policy()
        log_dir = self.parallel.log_dir(log_dir) if self.parallel else log_dir
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if isinstance(monitor, bool):
            monitor = MonitorConfig(enabled=monitor)
        # Created before any training so an unwritable log_dir fails now, not an hour in.
        self.monitor = Monitor(model, monitor, self.log_dir, sinks)
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self._checkpoint_request = checkpoint
        self._window: Window | None = None  # the micro-batches fed since the last step
        self._step_parts: int | None = None  # train_step's micro-batches, while it feeds
        self.plan: Any = None
        # The first step under a plan memfit made is measured against its prediction.
        self._plan_to_check: EnginePlan | None = None
        self.plan_check: Any = None  # a PlanCheck, once the first planned step was measured
        self.steps = 0  # optimizer steps attempted
        self.micro_steps = 0
        self._applied_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self._last_loss: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._log_window = LogWindow()  # the steps since the last log step
        self._session_steps = 0  # steps taken by this object, resumed runs included
        self.memory_report: Any = None
        self.metrics: dict[str, float] = {}
        self.extra: dict[str, Any] = {}
        # What log_dir's config.json and summary.json record (memfit/engine/run_files.py).
        self._run_record = RunRecord(budget_given=memory_budget)

    # ------------------------------------------------------------------ training

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates (fp32 masters in the ``*-master`` modes)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def applied_steps(self) -> int:
        """Optimizer steps that were applied, not skipped (syncs)."""
        return int(self._applied_steps.item())

    def train_step(self, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        """One optimizer step over ``accumulation_steps`` micro-batches of ``batch``.

        ``loss_fn(model, micro_batch)`` returns the mean loss of the micro-batch; it runs
        under the precision's autocast. Returns the batch's mean loss as a detached device
        tensor (no sync). A batch with fewer samples than ``accumulation_steps`` (a
        DataLoader's last batch) runs as one micro-batch per sample, weighted by size.

        It feeds the parts to :meth:`backward` and calls :meth:`step`: the same training,
        bitwise, as feeding those micro-batches yourself.
        """
        if self._window is not None:
            raise ConfigError(
                f"train_step() called while {self._window.count} micro-batch(es) fed with "
                "engine.backward() wait for their step; call engine.step() first"
            )
        size = batch_size(batch)
        if size == 0:
            raise ConfigError("the batch is empty (0 samples); give at least one sample")
        if self.auto.pending:  # the first batch: micro_batch="auto" splits it
            self._first_batch_choices(batch, loss_fn, global_batch=True)
        micro_batches = split_batch(batch, min(size, self.settings.accumulation_steps))
        self._step_parts = len(micro_batches)
        try:
            for micro in micro_batches:
                self.backward(micro, loss_fn)
        finally:
            self._step_parts = None
        return self.step()

    def backward(self, micro_batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of one micro-batch, fed as it comes; :meth:`step` ends the
        optimizer step after up to ``accumulation_steps`` of them.

        ``loss_fn(model, micro_batch)`` returns the micro-batch's mean loss; it runs under
        the precision's autocast, and the backward is scaled and weighted by the
        micro-batch's size, so the step's gradient is that of one batch of all its
        micro-batches, whatever their sizes (:mod:`memfit.engine.feed`). The first
        micro-batch of training plans (:meth:`prepare`). Returns the micro-batch's mean
        loss, detached (no sync). When it raises, the micro-batches fed since the last
        step are discarded.

        Example::

            for i, micro in enumerate(loader):  # DataLoader(..., batch_size=4)
                engine.backward(micro, loss_fn)
                if i % 4 == 3:
                    engine.step()
            if engine.pending_micro_batches:
                engine.step()  # the last, shorter step
        """
        try:
            size = batch_size(micro_batch)
            if size == 0:
                raise ConfigError("the micro-batch is empty (0 samples); give at least one")
            window = self._window
            if window is None:
                if self._checkpoint_request is not None:
                    # Planned before anything is measured: the profile's step is not training.
                    self.prepare(micro_batch, loss_fn)
                window = self._window = self._open_window(size)
            elif window.count >= self.settings.accumulation_steps:
                raise ConfigError(
                    f"{window.count + 1} micro-batches fed for one step, but "
                    f"accumulation_steps={self.settings.accumulation_steps} (the plan and "
                    "the loss weights are made for at most that many); call engine.step() "
                    "or raise accumulation_steps"
                )
            return run_measured(
                window,
                lambda: self._backward_one(window, micro_batch, size, loss_fn),
                self.model,
                self.optimizer,
                self.device,
                micro_batch,
            )
        except BaseException as exc:
            # A failed micro-batch (out of memory, a bad batch, Ctrl-C) must not leave
            # half-accumulated gradients for the next step to add to.
            self._discard_window()
            if self.parallel is not None:
                self.parallel.fail(exc)  # another rank's failure: names that rank
            raise

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches fed with :meth:`backward` since the last :meth:`step`."""
        return 0 if self._window is None else self._window.count

    def _open_window(self, size: int) -> Window:
        config = self.monitor.config
        check, self._plan_to_check = self._plan_to_check, None
        self._run_record.step_began()
        if self.release is not None:
            self.release.begin(self.device)
        return Window(
            reference=size * self.settings.accumulation_steps,
            loss_sum=torch.zeros((), dtype=torch.float32, device=self.device),
            check=check,
            keep_report=config.enabled and self._session_steps + 1 == config.measure_memory_step,
        )

    def _discard_window(self) -> None:
        window, self._window = self._window, None
        if window is not None and window.check is not None:
            self._plan_to_check = window.check  # the next step is the first planned one
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.scaler.discard_step()

    def _backward_one(self, window: Window, micro: Batch, size: int, loss_fn: LossFn) -> Tensor:
        # Data parallel: gradients are reduced in the step's last micro-batch only.
        last = window.count + 1 == (self._step_parts or self.settings.accumulation_steps)
        with self.parallel.sync(last) if self.parallel else contextlib.nullcontext():
            with self.policy.autocast(self.device.type):
                loss = checked_loss(loss_fn(self.model, micro))
            weighted = loss * window.weight(size)
            with self.release.releasing() if self.release else contextlib.nullcontext():
                self.scaler.scale(weighted).backward()
        window.loss_sum += weighted.detach()
        window.count += 1
        window.samples += size
        self.micro_steps += 1
        return loss.detach()

    def step(self) -> torch.Tensor:
        """End the optimizer step over the micro-batches fed with :meth:`backward`: unscale,
        rescale to the step's total size, clip, skip on overflow, the optimizer step, the
        master copy, the LR schedule, counters and metrics, as :meth:`train_step` does.

        Returns the step's mean loss over all its samples, detached (no sync). ConfigError
        when no micro-batch was fed since the last step.

        Example::

            engine.backward(first, loss_fn)
            engine.backward(second, loss_fn)
            loss = engine.step()
        """
        window = self._window
        if window is None:
            raise ConfigError(
                "engine.step() with no micro-batch fed since the last step; call "
                "engine.backward(micro_batch, loss_fn) first"
            )
        log_now = (self.steps + 1) % self.settings.log_every == 0
        try:
            grad_metrics = run_measured(
                window,
                lambda: self._optimizer_step(window, log_now),
                self.model,
                self.optimizer,
                self.device,
                optimizer_phase=True,
            )
        except BaseException as exc:
            self._discard_window()
            if self.parallel is not None:
                self.parallel.fail(exc)
            raise
        self._window = None
        self.steps += 1
        self._run_record.step_ended(window.samples)
        self._log_window.add_step(window.samples, window.count)
        self._session_steps += 1
        error: NonFiniteError | None = None
        if self.device.type == "cpu" or log_now:
            error = check_skips(
                self.scaler,
                self.settings.max_consecutive_skips,
                self._last_loss,
                self.model,
                self.master,
                self.policy,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self._judge_measured(window)
        if error is not None:
            raise error
        if log_now:
            self._read_metrics(grad_metrics)
        if self._signal_stop is not None:  # stop_on_signal(): save and stop at this boundary
            self._signal_stop.at_step_boundary(self.steps)
        assert self._last_loss is not None
        return self._last_loss

    def _optimizer_step(self, window: Window, log_now: bool) -> dict[str, float]:
        """The step after the backward passes; returns the gradient metrics of a log step."""
        factor = window.factor
        self._last_loss = window.loss_sum * factor if factor != 1.0 else window.loss_sum
        if self.parallel is not None:
            self.parallel.finish(self.params)  # a step whose last backward did not reduce
            self._last_loss = self.parallel.mean(self._last_loss)
        self.scaler.unscale_(self.optimizer)
        if self.release is not None:  # the updates were applied in backward
            self.scaler.note_non_finite(self.optimizer, self.release.found_inf())
        rescale_gradients(self.params, factor)
        # Gradient statistics describe the unscaled gradients before clipping.
        grad_metrics = (
            self.monitor.gradient_metrics(
                named_trained_params(self.model, self.master), self.policy, self.scaler.scale_tensor
            )
            if log_now
            else {}
        )
        self._grad_norm = None if self.release is None else self.release.grad_norm()
        if self.settings.clip_grad_norm is not None:
            self._grad_norm = clip_gradients(self.params, self.settings.clip_grad_norm)
        applied = self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.master is not None:
            self.master.copy_to_model()
        self._applied_steps += applied
        if self.lr_scheduler is not None and bool(applied):  # host sync, see module doc
            self.lr_scheduler.step()
        return grad_metrics

    def _judge_measured(self, window: Window) -> None:
        """What a measured step tells: the closed loop's verdict on the first planned step
        (:mod:`memfit.engine.plan_stage`), and the monitor's memory step."""
        if window.check is not None:
            try:
                check = check_first_step(
                    window.check, window.peak_bytes, self.model, self.optimizer
                )
            except BudgetError:
                if not self._split_smaller(window.peak_bytes):
                    raise
                return
            self.plan = check.plan
            self.plan_check = check
        if window.keep_report and window.report is not None:
            self._keep_memory_report(window.report)

    def _keep_memory_report(self, report: Any) -> None:
        """The measured step's memory, for the monitor's memory metrics and the report."""
        from memfit.monitor.metrics import memory_metrics

        self.memory_report = report
        self.monitor.memory = memory_metrics(report)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send extra metrics (e.g. ``{"val/loss": 2.1}``) to the sinks at the current step.
        The last ``"val/loss"`` is ``final_val_loss`` in ``log_dir``'s ``summary.json``."""
        if "val/loss" in metrics:
            self._run_record.val_loss = float(metrics["val/loss"])
        for sink in self.monitor.sinks:
            sink.log(self.steps, {"step": float(self.steps), **metrics})

    def read_metrics(self) -> dict[str, float]:
        """Read the metrics now instead of at the next log step: the same host syncs and
        names as a log step (without the gradient statistics, which need the gradients
        before ``zero_grad``), sent to the sinks, kept in ``engine.metrics`` and returned.

        Use it after a run whose last step was not a log step.

        Example::

            for batch in batches:
                engine.train_step(batch, loss_fn)
            if engine.steps % engine.settings.log_every:
                print(engine.read_metrics()["loss"])
        """
        return self._read_metrics()

    def health(self) -> list[HealthCheck]:
        """Each health check on the latest metrics: value, threshold, pass/warn, remedy."""
        return self.monitor.health(
            self.metrics, self.policy, self.scaler.min_scale, has_plan=self.plan is not None
        )

    def close(self) -> None:
        """Write ``log_dir``'s ``summary.json`` (and ``plan.json``) when this Engine trained
        a step, then flush and close the sinks and remove the monitor's hooks.

        ``summary.json`` holds what ``memfit train``'s does (:mod:`memfit.engine.run_files`):
        the step counts, the last losses, the peak memory, the precision and loss scale,
        the budget, and the throughput over this object's steps (``wall_seconds``: from
        the start of its first step, after the first batch's choices, to the end of its
        last; one host sync reads the last loss)."""
        records = [*self.monitor.records, self.metrics]
        self._run_record.write_summary(self.log_dir, self, records, self._last_loss)
        self.monitor.close()

    def prepare(self, batch: Batch, loss_fn: LossFn) -> Any:
        """Make and apply the checkpoint plan for micro-batches like ``batch`` (stage two of
        the Engine's order; the first micro-batch, fed by ``train_step`` or ``backward``, calls
        it when it has not run). With ``precision="auto"`` the precision is chosen on
        ``batch`` first.

        A :class:`~memfit.checkpoint.plan.Plan` given as ``checkpoint=`` is applied as
        is. ``"auto"`` and ``"optimal"`` plan optimally under ``memory_budget`` (default:
        90% of the device's memory); ``"full"``, ``"uniform:k"`` and ``"sqrt"`` use that
        strategy (under the budget when one is given). Returns the plan (None for
        ``"none"``); later calls return it without planning again.

        Example::

            engine = memfit.Engine(model, opt, checkpoint="auto", memory_budget="8GiB")
            print(engine.prepare(batch, loss_fn).summary())
        """
        self._first_batch_choices(batch, loss_fn, global_batch=False)
        return self.plan

    def _read_metrics(self, extra: dict[str, float] | None = None) -> dict[str, float]:
        metrics = log_step_metrics(
            self._log_window,
            self.scaler,
            step=self.steps,
            applied_steps=self._applied_steps,
            loss=self._last_loss,
            grad_norm=self._grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
            plan=self.plan,
            tokens_per_sample=self.tokens_per_sample,
            flops_per_sample=self.flops_per_sample,
        )
        metrics.update(plan_check_metrics(self.plan_check))
        metrics.update(extra or {})
        self.metrics = self.monitor.log(metrics)
        self._log_window.restart()
        return metrics

    # ------------------------------------------------------------------ evaluation / export

    def eval_context(self) -> Any:
        """A ``with`` block that evaluates as training computes: the precision's autocast,
        ``model.eval()`` and ``torch.no_grad()``; each module's train/eval flag is restored
        after. Use it for validation and generation in every mode.

        Example::

            with engine.eval_context():
                out = engine.model.generate(ids, max_new_tokens=20)
        """
        return eval_context(self.model, self.policy, self.device)


def _checked_storage(choices: Sequence[str]) -> tuple[str, ...]:
    """:func:`~memfit.checkpoint.planner.check_activation_storage` (the planner loads with
    the first plan, not with the Engine)."""
    from memfit.checkpoint.planner import check_activation_storage

    return check_activation_storage(choices)
