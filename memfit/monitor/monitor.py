"""The Engine's monitor: gathers the metrics at log steps and sends them to the sinks.

Between log steps it costs one sampled min/max per unit output on every ``every``-th forward
and nothing else; at a log step (every ``log_every`` optimizer steps) it reads everything in
a few host syncs: scaler counters, gradient norms and underflow (one pass over the
gradients), activation maxima, and, once per run, a measured memory breakdown.

The monitor knows nothing of the Engine: it is given the model, and at each call the data
it reads (gradients, the precision policy, the loss scale, the metrics). The Engine makes
one and calls it; a training loop of your own can do the same.

Example::

    engine = memfit.Engine(model, opt, precision="fp16-mixed", log_dir="runs/a",
                           monitor=MonitorConfig(activation_every=20))
    ...
    for check in engine.health():
        print(check.name, check.status, check.remedy)

    # Without an Engine:
    monitor = Monitor(model, MonitorConfig(), log_dir=Path("runs/b"))
    metrics = {"step": 10.0, "amp/skipped": 0.0, "loss": loss.item()}
    metrics.update(monitor.gradient_metrics(model.named_parameters(), policy, scale))
    monitor.log(metrics)
    monitor.health(metrics, policy, min_scale=1.0, has_plan=False)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.monitor.advice import Advice, RunFacts, advise
from memfit.monitor.health import HealthCheck, HealthThresholds, check_health
from memfit.monitor.metrics import (
    ActivationRanges,
    OverflowWindow,
    activation_metrics,
    grad_norm_stats,
    gradient_underflow,
    near_fp16_limit,
)
from memfit.monitor.sinks import JSONLSink, Sink, TensorBoardSink, check_log_dir
from memfit.precision.policy import PrecisionPolicy

#: Log records :attr:`Monitor.records` keeps before it thins them.
MAX_RECORDS = 2048


@dataclass
class MonitorConfig:
    """What the Engine's monitor gathers. The defaults cost ≤ 3% of a step (docs/benchmarks.md)."""

    enabled: bool = True
    """False turns off everything beyond the engine's own loss/scale/throughput metrics."""
    activation_every: int = 10
    """Record activation ranges on every this-many-th forward (0: never)."""
    activation_units: Sequence[str] | None = None
    """Modules whose outputs are tracked; None: the checkpoint units found in the model."""
    grad_stats: bool = True
    """At log steps: per-parameter gradient norms and the fp16 underflow fraction."""
    overflow_window: int = 100
    """Steps in the recent overflow-rate window."""
    measure_memory_step: int | None = 2
    """Measure the peak memory by kind and dtype on this step of the Engine object (1-based,
    counted again after a resume; None: never)."""
    tensorboard: bool = True
    """With a log_dir, also write TensorBoard event files (when tensorboard is installed)."""
    thresholds: HealthThresholds = field(default_factory=HealthThresholds)
    """Where the health checks turn to warnings."""


class Monitor:
    """Collects a training run's metrics and writes them to sinks (JSONL, TensorBoard, yours).

    ``model`` is the module whose unit outputs are tracked (activation ranges); ``log_dir``
    adds a JSONL sink (and a TensorBoard one) to ``sinks``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: MonitorConfig,
        log_dir: Path | None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.config = config
        self.sinks: list[Sink] = list(sinks)
        self.log_dir = None if log_dir is None else check_log_dir(log_dir)
        if self.log_dir is not None:
            self.sinks.append(JSONLSink(self.log_dir / "metrics.jsonl"))
            if config.tensorboard:
                try:
                    self.sinks.append(TensorBoardSink(self.log_dir / "tensorboard"))
                except Exception:  # tensorboard is optional: the JSONL log has everything
                    pass
        self.window = OverflowWindow(config.overflow_window)
        self.memory: dict[str, float] = {}
        self.activations: dict[str, float] = {}
        self.last_nonfinite: str | None = None
        self.records: list[dict[str, float]] = []
        """What :meth:`log` sent, in step order (thinned past :data:`MAX_RECORDS`)."""
        self.ranges: ActivationRanges | None = None
        if config.enabled and config.activation_every:
            units = config.activation_units
            if units is None:
                units = _default_units(model)
            if units:
                self.ranges = ActivationRanges(model, units, every=config.activation_every)

    def gradient_metrics(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        policy: PrecisionPolicy,
        loss_scale: float | torch.Tensor | None,
    ) -> dict[str, float]:
        """Norm distribution and underflow of the unscaled gradients (before zero_grad).

        ``named_params``: (name, tensor) for each tensor the optimizer steps (the fp32
        masters in the ``*-master`` modes); those without a ``.grad`` are left out.
        ``loss_scale``: the scale the backward ran with (None: 1), for the underflow counts
        of a mixed ``policy``. Sharded gradients (FSDP2's DTensors) count by this rank's
        shards.
        """
        if not (self.config.enabled and self.config.grad_stats):
            return {}
        # FSDP2's gradients are DTensors: the statistics are of this rank's shards.
        named = {name: _local(p.grad) for name, p in named_params if p.grad is not None}
        if not named:
            return {}
        out = grad_norm_stats(named).to_metrics()
        if policy.mixed:
            scale = 1.0 if loss_scale is None else loss_scale
            out.update(gradient_underflow(list(named.values()), scale).to_metrics())
        return out

    def log(self, metrics: dict[str, float]) -> dict[str, float]:
        """Add the monitor's metrics to ``metrics`` and send them to every sink."""
        self.window.update(metrics["step"], metrics["amp/skipped"])
        metrics.update(self.window.metrics())
        if self.ranges is not None:
            values = self.ranges.read()
            if values:
                # Kept until the next sample, so every log line carries the latest ranges.
                self.activations = activation_metrics(values)
        metrics.update(self.activations)
        metrics.update(self.memory)
        step = int(metrics["step"])
        for sink in self.sinks:
            sink.log(step, metrics)
        self.records.append(dict(metrics))
        if len(self.records) > MAX_RECORDS:
            # Every other record goes, the first and the latest stay: a long run keeps its
            # whole trajectory at half the resolution, in bounded memory.
            self.records = self.records[:-1:2] + self.records[-1:]
        return metrics

    def advice(self, facts: RunFacts | None = None) -> list[Advice]:
        """Advice on the loss scale, checkpointing, the micro-batch and throughput from
        :attr:`records` (see :func:`memfit.monitor.advice.advise`); ``facts`` adds what the
        records do not hold (precision, budget, accumulation).

        Example::

            for item in monitor.advice(RunFacts(precision="fp16-mixed")):
                print(item.topic, item.text)
        """
        return advise(self.records, facts, self.config.thresholds)

    def health(
        self,
        metrics: Mapping[str, float],
        policy: PrecisionPolicy,
        min_scale: float,
        has_plan: bool,
    ) -> list[HealthCheck]:
        """The health checks on ``metrics`` (the latest logged ones) with this config's
        thresholds; ``min_scale`` is the loss scaler's, ``has_plan`` whether a checkpoint
        plan is in use."""
        extra = {"min_scale": min_scale, "has_plan": has_plan}
        return check_health(metrics, policy, self.config.thresholds, extra)

    def near_fp16_limit(self, metrics: Mapping[str, float]) -> list[tuple[str, float]]:
        """Units whose activations in ``metrics`` came within half of fp16's largest value."""
        prefix = "act/max/"
        values = {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}
        return near_fp16_limit(values, self.config.thresholds.max_activation_fp16_fraction)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.ranges is not None:
            self.ranges.remove()
            self.ranges = None


def _default_units(model: torch.nn.Module) -> list[str]:
    from memfit.checkpoint.tree import find_units
    from memfit.errors import PlanError

    try:
        tree = find_units(model)
    except PlanError:
        return [name for name, _ in model.named_children()]
    # The blocks themselves: the units that have no unit children (leaves of the unit tree).
    return [u.name for u in tree.root.walk() if u.name and not u.children]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``to_local``); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
