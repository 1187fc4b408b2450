"""memfit's metrics for ``model.fit``: :class:`MonitorCallback`.

The callback writes what memfit's Engine writes for a PyTorch run, to the same sinks
(``metrics.jsonl`` and TensorBoard event files under ``tensorboard/``) and the same run
directory files (``config.json``, ``summary.json``, ``health.json``, ``plan.json``), so
``memfit report LOG_DIR`` and ``tensorboard --logdir LOG_DIR`` work on a Keras run.

Metrics (names as in docs/monitoring.md): ``loss``, ``lr``, ``amp/scale``,
``amp/skipped``, ``amp/overflow_rate``, ``amp/overflow_rate_recent`` (with a
``LossScaleOptimizer``), ``grad/norm`` (of the unscaled gradients of the last step),
``throughput/samples_per_second``, ``time/step_seconds``, ``memory/allocated_peak_bytes``
(TensorFlow's CPU allocator since the last log; left out, with one warning that says what
to set, where that allocator does not count every tensor), ``plan/...`` (with ``plan=``)
and ``health/warnings``.

Keras does not count skipped steps: its optimizer's ``iterations`` move only on applied
steps, so a train batch that left them where they were was skipped. The gradient norm and
the batch size are read inside the train step: at train begin the callback wraps the
optimizer's ``apply`` and the model's ``train_step`` for the run (both put back at train
end) and has Keras make its train function again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import weakref
from pathlib import Path
from typing import Any

from memfit.checkpoint.plan import Plan
from memfit.errors import ConfigError
from memfit.keras.backend import keras, tensorflow
from memfit.keras.loss_scale import optimizer_scales, scaler_state
from memfit.keras.memory import AllocatorMeter, allocator_meter
from memfit.keras.policy import precision_of
from memfit.monitor.health import HealthCheck, HealthThresholds, check_health, health_to_dict
from memfit.monitor.metrics import OverflowWindow, plan_metrics
from memfit.monitor.report import CONFIG, HEALTH, METRICS, PLAN, SUMMARY
from memfit.monitor.sinks import JSONLSink, MultiSink, TensorBoardSink, check_log_dir
from memfit.precision.policy import resolve_mode

__all__ = ["MonitorCallback"]

log = logging.getLogger("memfit.keras")


def _writable_target(path: Path) -> None:
    """Refuse now, creating nothing, a log directory that cannot be made or written."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"log directory {path} is a file; give a directory path")
    if (path / METRICS).exists():
        raise ConfigError(
            f"{path} already holds a run ({METRICS}); give another log_dir, or append=True "
            "to add this run's steps to it"
        )
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write to log directory {path}: {parent} is not writable")


class MonitorCallback(keras.callbacks.Callback):
    """Send memfit's training metrics from ``model.fit`` to memfit's sinks.

    ``log_dir``: the run directory (created at train begin). ``log_every``: write metrics
    every this many train batches (each write reads a few values from the device).
    ``precision``: memfit's mode the model trains in (default: read from its layers'
    policies); it decides which health checks apply. ``plan``: the checkpoint plan the
    model trains with, logged and saved as ``plan.json``. ``tensorboard``: also write
    TensorBoard event files. ``append``: add to a run directory that holds metrics.

    Example::

        model.fit(x, y, epochs=2, callbacks=[memfit.keras.MonitorCallback("runs/keras")])
        # memfit report runs/keras ; tensorboard --logdir runs/keras
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        log_every: int = 10,
        *,
        precision: str | None = None,
        plan: Plan | None = None,
        tensorboard: bool = True,
        append: bool = False,
        thresholds: HealthThresholds | None = None,
    ) -> None:
        super().__init__()
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ConfigError(f"log_every must be an int >= 1, got {log_every!r}")
        if plan is not None and not isinstance(plan, Plan):
            raise ConfigError(f"plan must be a memfit.Plan, got {type(plan).__name__}")
        self.precision = None if precision is None else resolve_mode(precision)
        self.log_dir = Path(log_dir)
        if not append:
            _writable_target(self.log_dir)
        self.log_every = log_every
        self.plan = plan
        self.tensorboard = tensorboard
        self.thresholds = thresholds or HealthThresholds()
        self.checks: list[HealthCheck] = []
        self.steps = 0
        self.skipped = 0
        self.last_metrics: dict[str, float] = {}
        self._sinks: MultiSink | None = None
        self._meter: AllocatorMeter | None = None
        self._window = OverflowWindow()
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ train begin/end

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._tf = tensorflow("memfit.keras.MonitorCallback")
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ConfigError("MonitorCallback needs a compiled model (model.compile(...))")
        # Keras calls no on_train_end when fit() raises: what an interrupted run left (this
        # callback's open sinks, the wrappers of a MonitorCallback of that fit) is undone first.
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None
        _unwrap(model, optimizer, stale_for=self)
        if self.precision is None:
            self.precision = precision_of(list(model._flatten_layers(include_self=False)))
        check_log_dir(self.log_dir)
        sinks: list[Any] = [JSONLSink(self.log_dir / METRICS)]
        if self.tensorboard:
            sinks.append(TensorBoardSink(self.log_dir / "tensorboard"))
        self._sinks = MultiSink(sinks)
        self._write(CONFIG, {"framework": "keras", "precision": self.precision})
        if self.plan is not None:
            (self.log_dir / PLAN).write_text(self.plan.to_json(), encoding="utf-8")
        self._watch(model, optimizer)
        self._meter = self._memory_meter()
        self._iterations = scaler_state(optimizer).iterations - (self.steps - self.skipped)
        self._since_samples = 0.0
        self._since_time = time.perf_counter()
        self._since_steps = 0

    def _memory_meter(self) -> AllocatorMeter | None:
        """The allocator meter, its peak started now (not at whatever ran before fit); None,
        warned once with the remedy, where it cannot count: training goes on without
        memory metrics rather than failing the user's fit."""
        try:
            meter = allocator_meter("memfit.keras.MonitorCallback")
        except ConfigError as exc:
            if "memory meter" not in self._warned:
                self._warned.add("memory meter")
                log.warning("%s Training goes on without memory/allocated_peak_bytes.", exc)
            return None
        meter.reset_peak()
        return meter

    def _watch(self, model: Any, optimizer: Any) -> None:
        """Wrap ``optimizer.apply`` (gradient norm) and ``model.train_step`` (batch size)
        for this run, and have Keras make its train function again with them."""
        tf = self._tf
        self._grad_norm = tf.Variable(0.0, trainable=False, dtype=tf.float32)
        self._samples = tf.Variable(0, trainable=False, dtype=tf.int64)
        apply, train_step = optimizer.apply, model.train_step
        scales = optimizer_scales(optimizer)

        def measured_apply(grads: Any, trainable_variables: Any = None) -> Any:
            present = [tf.cast(g, tf.float32) for g in grads if g is not None]
            norm = tf.linalg.global_norm(present) if present else tf.constant(0.0)
            if scales and optimizer.built:
                norm = norm / tf.cast(optimizer.dynamic_scale, tf.float32)
            self._grad_norm.assign(norm)
            return apply(grads, trainable_variables)

        def counted_train_step(data: Any) -> Any:
            first = keras.tree.flatten(data)[0]
            self._samples.assign_add(tf.cast(tf.shape(first)[0], tf.int64))
            return train_step(data)

        for owner, name, wrapper in (
            (optimizer, "apply", measured_apply),
            (model, "train_step", counted_train_step),
        ):
            # What the instance itself held (a user's override, or None: the class's
            # method) comes back when the wrapper is taken off.
            wrapper._memfit_replaced = vars(owner).get(name)  # type: ignore[attr-defined]
            wrapper._memfit_owner = weakref.ref(self)  # type: ignore[attr-defined]
            setattr(owner, name, wrapper)
        model.make_train_function(force=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.steps % self.log_every:
            self._log()
        _unwrap(self.model, self.model.optimizer)
        last = self.last_metrics
        self._write(
            SUMMARY,
            {
                "framework": "keras",
                "precision": self.precision,
                "steps": self.steps,
                "skipped_steps": self.skipped,
                "final_loss": last.get("loss"),
                "plan_predicted_peak_bytes": None
                if self.plan is None
                else self.plan.predicted_peak_bytes,
            },
        )
        self._write(HEALTH, health_to_dict(self.checks))
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None

    # ------------------------------------------------------------------ per batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.steps += 1
        self._since_steps += 1
        self._logs = logs  # read at the log step only: reading a value syncs
        if self.steps % self.log_every == 0:
            self._log()

    def _log(self) -> None:
        if self._sinks is None or self._since_steps == 0:
            return
        optimizer = self.model.optimizer
        state = scaler_state(optimizer)
        applied = state.iterations - self._iterations
        self.skipped = max(0, self.steps - applied)
        now = time.perf_counter()
        seconds = max(now - self._since_time, 1e-12)
        samples = float(self._samples.numpy())
        metrics: dict[str, float] = {
            "grad/norm": float(self._grad_norm.numpy()),
            "throughput/samples_per_second": (samples - self._since_samples) / seconds,
            "time/step_seconds": seconds / self._since_steps,
            "lr": float(keras.ops.convert_to_numpy(optimizer.learning_rate)),
        }
        logs = getattr(self, "_logs", None)
        if logs and "loss" in logs:
            metrics["loss"] = float(keras.ops.convert_to_numpy(logs["loss"]))
        if state.scale is not None:
            self._window.update(self.steps, self.skipped)
            metrics.update(
                {
                    "amp/scale": state.scale,
                    "amp/skipped": float(self.skipped),
                    "amp/overflow_rate": self.skipped / self.steps,
                    **self._window.metrics(),
                }
            )
        if self._meter is not None:
            metrics["memory/allocated_peak_bytes"] = self._meter.peak()
            self._meter.reset_peak()
        if self.plan is not None:
            metrics.update(plan_metrics(self.plan))
        self.checks = check_health(
            metrics, self.precision or "fp32", self.thresholds, {"has_plan": self.plan is not None}
        )
        warned = [c for c in self.checks if c.status == "warn"]
        for check in warned:
            if check.name not in self._warned:
                self._warned.add(check.name)
                log.warning("memfit health: %s (%s): %s", check.name, check.detail, check.remedy)
        metrics["health/warnings"] = float(len(warned))
        self._sinks.log(self.steps, metrics)
        self.last_metrics = metrics
        self._since_samples, self._since_time, self._since_steps = samples, now, 0

    def _write(self, name: str, data: dict[str, Any]) -> None:
        def finite(value: Any) -> Any:  # JSON has no NaN: written as memfit's sinks write it
            if isinstance(value, float) and not math.isfinite(value):
                return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            return value

        path = self.log_dir / name
        tmp = path.with_suffix(".tmp")
        text = json.dumps({k: finite(v) for k, v in data.items()}, indent=1, allow_nan=False)
        tmp.write_text(text, "utf-8")
        os.replace(tmp, path)


def _unwrap(model: Any, optimizer: Any, stale_for: MonitorCallback | None = None) -> None:
    """Take a MonitorCallback's wrappers off ``model.train_step`` and ``optimizer.apply``
    (what they replaced shows again), and have Keras make its train function anew.

    ``stale_for``: take off only wrappers left by a fit() other than the one that
    callback runs in (every callback of one fit shares the ``params`` dict Keras gives
    them), every such layer; without it, the top layer."""
    found = False
    for owner, name in ((optimizer, "apply"), (model, "train_step")):
        while hasattr(wrapper := vars(owner).get(name), "_memfit_replaced"):
            if stale_for is not None:
                by = wrapper._memfit_owner()
                if by is not None and by.params is stale_for.params:
                    break  # another callback of this same fit: kept
            found = True
            if wrapper._memfit_replaced is None:
                delattr(owner, name)
            else:
                setattr(owner, name, wrapper._memfit_replaced)
            if stale_for is None:
                break
    if found:
        model.train_function = None  # made again without the wrappers next time
