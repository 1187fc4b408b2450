"""The training engine: precision, checkpoint plan, accumulation, clipping, skipping, saving.

One :meth:`Engine.train_step` is one optimizer step over ``accumulation_steps``
micro-batches. In every precision mode a step whose gradients are not finite is skipped
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

import math
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError, NonFiniteError
from memfit.monitor.health import HealthCheck
from memfit.monitor.monitor import Monitor, MonitorConfig
from memfit.monitor.sinks import Sink
from memfit.nested import map_tensors, tensors
from memfit.precision.apply import apply_precision
from memfit.precision.master import MasterWeights
from memfit.precision.policy import PrecisionPolicy
from memfit.precision.scaler import LossScaler
from memfit.savefile import atomic_save, safe_load
from memfit.units import device_memory_bytes, format_bytes, parse_bytes

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass
class EngineSettings:
    """The settings an Engine was made with; saved in every checkpoint."""

    precision: str = "bf16-mixed"
    """Precision mode (resolved name)."""
    checkpoint: str = "none"
    """Checkpoint spec: "none", "auto", "full", "uniform:k", "sqrt", or "plan" for a given Plan."""
    memory_budget: int | None = None
    """Peak memory budget of a whole step in bytes, for planning; None = no budget."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    clip_grad_norm: float | None = None
    """Clip the unscaled gradients' total norm to this value; None = no clipping."""
    log_every: int = 10
    """Read metrics from the device every this many steps."""
    max_consecutive_skips: int = 50
    """Raise NonFiniteError after this many skipped steps in a row."""


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Split a tensor, or a nested tuple/list/dict of tensors, into ``parts`` along dim 0;
    values that are not tensors are given to every part as they are.

    Example::

        first, second = split_batch({"x": torch.zeros(4, 3), "lr": 0.1}, 2)
    """
    size = batch_size(batch)
    if size < parts:
        raise ConfigError(
            f"batch of {size} samples cannot be split into accumulation_steps={parts} "
            "micro-batches; use a larger batch or fewer accumulation steps"
        )
    if parts == 1:
        return [batch]
    chunks = {id(t): torch.tensor_split(t, parts, dim=0) for t in tensors(batch)}
    return [map_tensors(batch, lambda t, i=i: chunks[id(t)][i]) for i in range(parts)]


def batch_size(batch: Batch) -> int:
    """Size of dim 0 shared by every tensor of the batch."""
    found = tensors(batch)
    if not found:
        raise ConfigError(
            f"the batch ({type(batch).__name__}) holds no tensor; give a tensor or a "
            "tuple/list/dict of them"
        )
    if any(t.dim() == 0 for t in found):
        raise ConfigError("batch tensors need a batch dimension (dim 0); got a scalar")
    sizes = {t.shape[0] for t in found}
    if len(sizes) > 1:
        raise ConfigError(f"batch tensors disagree on dim 0 sizes {sorted(sizes)}; they must match")
    return sizes.pop()


def _check_checkpoint_request(checkpoint: Any) -> None:
    # A misspelt strategy should fail when the Engine is made, not at the first step.
    if isinstance(checkpoint, str):
        if checkpoint not in ("none", "auto"):
            from memfit.checkpoint.solvers import parse_strategy

            parse_strategy(checkpoint)
    elif not (hasattr(checkpoint, "decisions") and hasattr(checkpoint, "segments")):
        raise ConfigError(
            "checkpoint= takes a Plan or one of 'none', 'auto', 'optimal', 'full', "
            f"'uniform:k', 'sqrt'; got {type(checkpoint).__name__}"
        )


def _model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class Engine:
    """Train a model with a precision policy, a checkpoint plan, accumulation and clipping.

    The model is changed in one documented order (torchtitan's ``apply_*`` order):

    1. **precision**, when the Engine is made: fp32 master weights (the ``*-master``
       modes; the optimizer then updates fp32 copies) and the fp32 islands
       (:func:`~memfit.precision.apply.apply_precision`);
    2. **checkpoint plan**, on the first micro-batch (:meth:`prepare`, which the first
       :meth:`train_step` calls): planned under the precision of step 1 by
       :func:`~memfit.checkpoint.planner.make_plan`, then applied with ``apply_plan``.

    Example::

        engine = memfit.Engine(model, optimizer, precision="bf16-mixed", accumulation_steps=2)
        loss = engine.train_step(batch, loss_fn)   # loss_fn(model, micro_batch) -> scalar
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: str | PrecisionPolicy = "bf16-mixed",
        checkpoint: Any = "none",
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
    ) -> None:
        if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
        if clip_grad_norm is not None and not (
            clip_grad_norm > 0 and math.isfinite(clip_grad_norm)
        ):
            raise ConfigError(
                f"clip_grad_norm must be a positive number or None, got {clip_grad_norm}"
            )
        if int(log_every) != log_every or log_every < 1:
            raise ConfigError(f"log_every must be an int >= 1, got {log_every}")
        if max_consecutive_skips < 1:
            raise ConfigError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        _check_checkpoint_request(checkpoint)
        self.policy = PrecisionPolicy.of(precision)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = _model_device(model)
        self.policy.check_device(self.device)
        budget = None if memory_budget is None else parse_bytes(memory_budget, self.device)
        self.settings = EngineSettings(
            precision=self.policy.mode,
            checkpoint=checkpoint if isinstance(checkpoint, str) else "plan",
            memory_budget=budget,
            accumulation_steps=int(accumulation_steps),
            clip_grad_norm=clip_grad_norm,
            log_every=int(log_every),
            max_consecutive_skips=int(max_consecutive_skips),
        )
        self.master: MasterWeights | None = None
        if self.policy.master_weights:
            self.master = MasterWeights(
                model, optimizer, self.policy.compute_dtype, self.policy.is_island
            )
        self.islands = apply_precision(model, self.policy)
        if scaler is None:
            scaler = (
                LossScaler()
                if self.policy.loss_scaling
                else LossScaler(init_scale=1.0, dynamic=False)
            )
        self.scaler = scaler
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if isinstance(monitor, bool):
            monitor = MonitorConfig(enabled=monitor)
        # Created before any training so an unwritable log_dir fails now, not an hour in.
        self.monitor = Monitor(model, monitor, self.log_dir, sinks)
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self._measuring = False
        self._checkpoint_request = checkpoint
        self.plan: Any = None
        # The first step under a plan memfit made is measured against its prediction.
        self._plan_to_check: Any = None
        self._budget_to_verify: int | None = None  # set where only a measurement can tell
        self.plan_check: Any = None  # a PlanCheck, once the first planned step was measured
        self.steps = 0  # optimizer steps attempted
        self.micro_steps = 0
        self._applied_steps = torch.zeros((), dtype=torch.int64, device=self.device)
        self._last_loss: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._window_steps = 0
        self._window_batch = 0
        self._session_steps = 0  # steps taken by this object, resumed runs included
        self.memory_report: Any = None
        self.metrics: dict[str, float] = {}
        self.extra: dict[str, Any] = {}

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
        tensor (no sync).
        """
        if self._checkpoint_request is not None:
            # Planned before anything is measured: the profile's own step is not training.
            self.prepare(split_batch(batch, self.settings.accumulation_steps)[0], loss_fn)
        if self._plan_to_check is not None and not self._measuring:
            return self._checked_step(batch, loss_fn)
        memory_step = self.monitor.config.measure_memory_step
        if (
            self.monitor.config.enabled
            and memory_step is not None
            and self._session_steps + 1 == memory_step
            and not self._measuring
        ):
            return self._measured_step(batch, loss_fn)
        micro_batches = split_batch(batch, self.settings.accumulation_steps)
        total = batch_size(batch)
        try:
            loss_sum = self._accumulate(micro_batches, total, loss_fn)
        except BaseException:
            # A failed micro-batch (out of memory, a bad batch, Ctrl-C) must not leave
            # half-accumulated gradients for the next step to add to.
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            self.scaler.discard_step()
            raise
        self._last_loss = loss_sum
        self.scaler.unscale_(self.optimizer)
        log_now = (self.steps + 1) % self.settings.log_every == 0
        # Gradient statistics describe the unscaled gradients before clipping.
        grad_metrics = (
            self.monitor.gradient_metrics(
                self._named_grad_params(), self.policy, self.scaler.scale_tensor
            )
            if log_now
            else {}
        )
        self._grad_norm = None
        if self.settings.clip_grad_norm is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            self._grad_norm = norm
            # A non-finite norm means this step is skipped: leave the gradients as they are
            # so the diagnosis can still find the parameter that overflowed.
            safe_norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
            torch.nn.utils.clip_grads_with_norm_(
                self.params, self.settings.clip_grad_norm, safe_norm, foreach=True
            )
        applied = self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.master is not None:
            self.master.copy_to_model()
        self._applied_steps += applied
        if self.lr_scheduler is not None and bool(applied):  # host sync, see module doc
            self.lr_scheduler.step()
        self.steps += 1
        self._window_samples += total
        self._window_batch = total
        self._session_steps += 1
        self._window_steps += 1
        error: NonFiniteError | None = None
        if self.device.type == "cpu" or log_now:
            error = self._check_skips()
        self.optimizer.zero_grad(set_to_none=True)
        if error is not None:
            raise error
        if log_now:
            self._read_metrics(grad_metrics)
        return loss_sum

    def _measure_step(self, batch: Batch, loss_fn: LossFn) -> Any:
        from memfit.memory import measure

        self._measuring = True
        try:
            return measure(
                lambda: self.train_step(batch, loss_fn), model=self.model, optimizer=self.optimizer
            )
        finally:
            self._measuring = False

    def _measured_step(self, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        report = self._measure_step(batch, loss_fn)
        self._keep_memory_report(report)
        return report.result

    def _keep_memory_report(self, report: Any) -> None:
        """The measured step's memory, for the monitor's memory metrics and the report."""
        from memfit.monitor.metrics import memory_metrics

        self.memory_report = report
        self.monitor.memory = memory_metrics(report)

    def _make_plan(self, batch: Batch, loss_fn: LossFn, strategy: str, budget: Any) -> Any:
        """The plan under ``budget``; where the model predicts none fits, the ``full``
        plan, whose first step the closed loop then measures against the budget: a budget
        the measured ``full`` plan meets is not refused on a prediction."""
        from memfit.checkpoint.planner import profile_step, solve_profile
        from memfit.errors import BudgetError

        profiled = profile_step(self.model, batch, loss_fn, self.policy)
        steps = self.settings.accumulation_steps
        # Training needs the plan, not the frontier `memfit plan` shows (start-up time).
        try:
            return solve_profile(
                self.model, profiled, self.policy, self.optimizer, strategy, budget, steps, False
            )
        except BudgetError as exc:
            if strategy != "optimal" or budget is None:
                raise
            full = solve_profile(
                self.model, profiled, self.policy, self.optimizer, "full", None, steps, False
            )
            if full.memory.optimizer_phase_bytes > budget:
                raise  # the optimizer step alone holds more: no plan can help
            full.plan.notes.append(
                f"the planner predicts no plan fits ({exc}); training with 'full', whose "
                "first step is measured against the budget"
            )
            self._budget_to_verify = int(budget)
            return full

    def _checked_step(self, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        # Closed-loop planning: the first step under a plan memfit made is measured by the
        # allocator, and the plan is made again once from the same profile when its
        # prediction was off by more than the reserve (check_plan). The step itself trains
        # as any other.
        from memfit.allocator import allocator_peak, optimizer_tensors
        from memfit.checkpoint.apply import apply_plan, remove_plan
        from memfit.checkpoint.planner import check_plan
        from memfit.errors import BudgetError

        result, self._plan_to_check = self._plan_to_check, None
        # The allocator judges (kernels' workspaces included, as the prediction counts
        # them); memfit.measure's tracker, running inside it, gives the monitor its kinds.
        live = [*self.model.parameters(), *self.model.buffers()]
        live += [*optimizer_tensors(self.optimizer), batch]
        measured = allocator_peak(
            lambda: self._measure_step(batch, loss_fn), live=live, device=self.device
        )
        report = measured.result
        budget, self._budget_to_verify = self._budget_to_verify, None
        if budget is not None and measured.peak_bytes > budget:
            raise BudgetError(
                f"memory_budget={format_bytes(budget)} is below the smallest peak any plan "
                f"reaches: the first step under 'full' (every unit recomputed) peaked at "
                f"{format_bytes(measured.peak_bytes)}. The step was applied and nothing is "
                "lost; raise the budget, use a smaller micro-batch (more accumulation steps) "
                "or a '*-master' precision."
            )
        check = check_plan(result, measured.peak_bytes, self.model, self.optimizer)
        if check.replanned:
            remove_plan(self.model)
            apply_plan(self.model, check.plan)
        self.plan = check.plan
        self.plan_check = check
        if self.steps % self.settings.log_every == 0:  # this step's metrics went out before
            plan_metrics = self._plan_check_metrics()
            self.log_metrics(plan_metrics)
            self.metrics.update(plan_metrics)
        if self._session_steps == self.monitor.config.measure_memory_step:
            self._keep_memory_report(report)  # the monitor's memory step was this one
        return report.result

    def _plan_check_metrics(self) -> dict[str, float]:
        check = self.plan_check
        if check is None:
            return {}
        return {
            "plan/predicted_peak_bytes": float(check.predicted_peak_bytes),
            "plan/measured_peak_bytes": float(check.measured_peak_bytes),
            "plan/replanned": float(check.replanned),
        }

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send extra metrics (e.g. ``{"val/loss": 2.1}``) to the sinks at the current step."""
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
        """Flush and close the sinks and remove the monitor's hooks."""
        self.monitor.close()

    def _accumulate(self, micro_batches: list[Batch], total: int, loss_fn: LossFn) -> torch.Tensor:
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in micro_batches:
            # Weight by size so k micro-batches give the gradient of one batch of k*b.
            weight = batch_size(micro) / total
            with self.policy.autocast(self.device.type):
                loss = loss_fn(self.model, micro)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError(
                    "loss_fn(model, micro_batch) must return a scalar tensor, got "
                    f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
                )
            if not loss.requires_grad:
                raise ConfigError(
                    "the loss does not require grad: loss_fn must compute it from the model's "
                    "output, not under torch.no_grad()"
                )
            loss = loss.reshape(()).float() * weight
            self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
            self.micro_steps += 1
        return loss_sum

    def prepare(self, batch: Batch, loss_fn: LossFn) -> Any:
        """Make and apply the checkpoint plan for micro-batches like ``batch`` (stage two of
        the Engine's order; the first ``train_step`` calls it when it has not run).

        A :class:`~memfit.checkpoint.plan.Plan` given as ``checkpoint=`` is applied as
        is. ``"auto"`` and ``"optimal"`` plan optimally under ``memory_budget`` (default:
        90% of the device's memory); ``"full"``, ``"uniform:k"`` and ``"sqrt"`` use that
        strategy (under the budget when one is given). Returns the plan (None for
        ``"none"``); later calls return it without planning again.

        Example::

            engine = memfit.Engine(model, opt, checkpoint="auto", memory_budget="8GiB")
            print(engine.prepare(batch, loss_fn).summary())
        """
        request = self._checkpoint_request
        if request is None:
            return self.plan
        if isinstance(request, str) and request == "none":
            self._checkpoint_request = None
            return None
        from memfit.checkpoint.apply import apply_plan

        if isinstance(request, str):
            strategy = "optimal" if request == "auto" else request
            budget = self.settings.memory_budget
            if budget is None and strategy == "optimal":
                budget = int(0.9 * device_memory_bytes(self.device))
            result = self._make_plan(batch, loss_fn, strategy, budget)
            self._plan_to_check = result
            request = result.plan
            # Planning ran backward passes; in the *-master modes their gradients went
            # into the fp32 masters' buffers, which the first step must not add to.
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
        apply_plan(self.model, request)
        self.plan = request
        self._checkpoint_request = None  # only now: a failed planning is tried again
        return request

    def _check_skips(self) -> NonFiniteError | None:
        consecutive = self.scaler.consecutive_skips_tensor
        if consecutive is None:
            return None
        skips = int(consecutive.item())
        if skips < self.settings.max_consecutive_skips:
            return None
        return NonFiniteError(self._diagnose(skips))

    def _diagnose(self, skips: int) -> str:
        head = f"{skips} optimizer steps in a row were skipped because of non-finite values"
        if self._last_loss is not None and not torch.isfinite(self._last_loss).all():
            return (
                f"{head}: the loss itself is {self._last_loss.item()} (the forward pass "
                "overflowed or the data holds inf/nan). Check the inputs, lower the learning "
                "rate, or use precision='bf16-mixed' (fp16's range ends at 65504)."
            )
        for name, param in self._named_grad_params():
            if param.grad is not None and not torch.isfinite(param.grad).all():
                remedy = (
                    "lower the learning rate, set clip_grad_norm, or keep that module in fp32 "
                    "(PrecisionPolicy(fp32_islands=...))"
                )
                if self.policy.loss_scaling:
                    remedy = (
                        f"lower LossScaler(init_scale=...) (now {self.scaler.get_scale():g}), "
                        + remedy
                    )
                return f"{head}: the first parameter with a non-finite gradient is {name!r}. Remedy: {remedy}."
        return f"{head}. Lower the learning rate or set clip_grad_norm."

    def _named_grad_params(self) -> list[tuple[str, torch.Tensor]]:
        """Each model parameter by name, as its fp32 master where the mode keeps one: the
        tensors whose gradients the optimizer steps."""
        masters = dict(zip(self.master.names, self.master.masters)) if self.master else {}
        return [(name, masters.get(name, p)) for name, p in self.model.named_parameters()]

    def _read_metrics(self, extra: dict[str, float] | None = None) -> dict[str, float]:
        stats = self.scaler.stats
        elapsed = time.perf_counter() - self._window_start
        metrics = {
            "step": float(self.steps),
            "applied_steps": float(self.applied_steps),
            "loss": float(self._last_loss.item()) if self._last_loss is not None else math.nan,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "amp/scale": stats.scale,
            "amp/skipped": float(stats.skipped),
            "amp/overflow_rate": stats.overflow_rate,
            "amp/consecutive_skips": float(stats.consecutive_skips),
            "time/step_seconds": elapsed / max(self._window_steps, 1),
            "throughput/samples_per_second": self._window_samples / elapsed if elapsed > 0 else 0.0,
        }
        if self._grad_norm is not None:
            metrics["grad/norm"] = float(self._grad_norm.item())
        if stats.skipped and self._last_loss is not None:
            metrics["amp/nonfinite_loss"] = float(not torch.isfinite(self._last_loss).item())
        sps = metrics["throughput/samples_per_second"]
        if self.tokens_per_sample:
            metrics["throughput/tokens_per_second"] = sps * self.tokens_per_sample
        if self.flops_per_sample:
            metrics["throughput/flops_per_second"] = sps * self.flops_per_sample
        recompute = getattr(self.plan, "recompute_flops", 0) or 0
        if self.plan is not None:
            if self.flops_per_sample:
                # The model's own work is 3x its forward; recompute adds forward FLOPs.
                per_step = self.flops_per_sample * self._window_batch
                metrics["recompute/overhead"] = recompute / per_step if per_step else 0.0
            elif metrics["time/step_seconds"] > 0:
                metrics["recompute/overhead"] = (
                    self.plan.recompute_seconds / metrics["time/step_seconds"]
                )
        metrics.update(self._plan_check_metrics())
        metrics.update(extra or {})
        self.metrics = self.monitor.log(metrics)
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._window_steps = 0
        return metrics

    # ------------------------------------------------------------------ save / resume

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: weights, masters, optimizer, scaler, RNG, counters."""
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": _python_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        plan = (
            self.plan.to_json() if self.plan is not None and hasattr(self.plan, "to_json") else None
        )
        return {
            "settings": asdict(self.settings),
            "model": self.model.state_dict(),
            "master": self.master.state_dict() if self.master is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict()
            if self.lr_scheduler is not None
            else None,
            "rng": rng,
            "counters": {
                "steps": self.steps,
                "micro_steps": self.micro_steps,
                "applied_steps": self.applied_steps,
            },
            "plan": plan,
        }

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint atomically (temp file, fsync, rename). ``extra`` is saved as is."""
        state = self.state_dict()
        state["extra"] = extra or {}
        return atomic_save(state, path)

    @classmethod
    def resume(
        cls,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        **overrides: Any,
    ) -> Engine:
        """Rebuild an Engine from a checkpoint with its saved settings and every state.

        ``model`` and ``optimizer`` are freshly built the same way as for the saved run.
        ``overrides`` replace saved settings (e.g. ``log_every``). The saved ``extra`` dict
        is available as ``engine.extra``.
        """
        state = safe_load(path)
        settings = dict(state["settings"])
        plan = state.get("plan")
        checkpoint: Any = settings.pop("checkpoint")
        if plan is not None:
            from memfit.checkpoint.plan import Plan

            checkpoint = Plan.from_json(plan)
        settings.update(overrides)
        engine = cls(model, optimizer, checkpoint=checkpoint, lr_scheduler=lr_scheduler, **settings)
        try:
            model.load_state_dict(state["model"])
            if engine.master is not None:
                engine.master.load_state_dict(state["master"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ConfigError(
                f"checkpoint {path} does not fit this model/optimizer ({exc}); build them the "
                "same way as for the saved run"
            ) from exc
        engine.scaler.load_state_dict(state["scaler"])
        if lr_scheduler is not None and state["lr_scheduler"] is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
        elif state["lr_scheduler"] is not None:
            warnings.warn(
                f"checkpoint {path} holds LR scheduler state but no lr_scheduler was given; "
                "pass lr_scheduler= to continue the schedule",
                stacklevel=2,
            )
        counters = state["counters"]
        engine.steps = int(counters["steps"])
        engine.micro_steps = int(counters["micro_steps"])
        engine._applied_steps.fill_(int(counters["applied_steps"]))
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(_to_tuple(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        engine.extra = state.get("extra", {})
        return engine


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _to_tuple(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
