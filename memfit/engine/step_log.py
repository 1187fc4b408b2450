"""What a log step reports: the optimizer steps since the last one, and the metrics of them.

Every ``log_every`` steps (and on ``Engine.read_metrics``) the Engine reads its metrics
from the device. The rates are over the :class:`LogWindow`, the steps since the last log
step, whose ends are synced by that read: ``throughput/*`` by the monitor's one formula
(:func:`memfit.monitor.throughput.throughput_metrics`), and ``recompute/overhead`` as the
plan's recompute over the step's own work.

Nothing here takes the Engine: it is given the window and what the Engine holds.

Example::

    window = LogWindow()
    window.add_step(samples=32, micro_batches=4)
    metrics = log_step_metrics(window, scaler, step=1, applied_steps=applied, loss=loss,
                               grad_norm=None, lr=1e-3, plan=None)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.monitor.throughput import recompute_overhead_from_flops, throughput_metrics
from memfit.precision.scaler import LossScaler


@dataclass
class LogWindow:
    """The optimizer steps since the last log step, which a log step's rates are over.

    Example::

        window = LogWindow()
        window.add_step(samples=32, micro_batches=4)
        window.samples, window.steps   # (32, 1)
    """

    start: float = field(default_factory=time.perf_counter)
    """When the window opened (the host clock)."""
    samples: int = 0
    """Samples of its steps."""
    steps: int = 0
    """Optimizer steps in it."""
    last_samples: int = 0
    """Samples of the last step: the work the plan's recompute adds to."""
    last_micro_batches: int = 0
    """Micro-batches of the last step: the plan's recompute runs once for each."""

    def add_step(self, samples: int, micro_batches: int) -> None:
        """Count an optimizer step of ``samples`` samples in ``micro_batches`` micro-batches."""
        self.samples += samples
        self.steps += 1
        self.last_samples = samples
        self.last_micro_batches = micro_batches

    def restart(self) -> None:
        """Open the next window (after a log step)."""
        self.start = time.perf_counter()
        self.samples = 0
        self.steps = 0


def log_step_metrics(
    window: LogWindow,
    scaler: LossScaler,
    *,
    step: int,
    applied_steps: torch.Tensor,
    loss: torch.Tensor | None,
    grad_norm: torch.Tensor | None,
    lr: float,
    plan: Any,
    tokens_per_sample: float | None = None,
    flops_per_sample: float | None = None,
) -> dict[str, float]:
    """A log step's metrics over ``window``: the step counters, the loss, the learning
    rate, the loss scaler's (``amp/*``), the step time, the rates and, under ``plan``, its
    recompute overhead. Syncs: the scaler's counters first, which the window's time then
    includes, and the device tensors (``applied_steps``, ``loss``, ``grad_norm``).

    ``tokens_per_sample`` and ``flops_per_sample`` add the matching rates; with
    ``flops_per_sample`` the overhead is counted in FLOPs, else in the plan's predicted
    seconds over the measured step time.

    Example::

        metrics = log_step_metrics(window, engine.scaler, step=10, applied_steps=applied,
                                   loss=loss, grad_norm=None, lr=1e-3, plan=None)
        metrics["throughput/samples_per_second"]
    """
    stats = scaler.stats
    elapsed = time.perf_counter() - window.start
    metrics = {
        "step": float(step),
        "applied_steps": float(int(applied_steps.item())),
        "loss": float(loss.item()) if loss is not None else math.nan,
        "lr": float(lr),
        "amp/scale": stats.scale,
        "amp/skipped": float(stats.skipped),
        "amp/overflow_rate": stats.overflow_rate,
        "amp/consecutive_skips": float(stats.consecutive_skips),
        "time/step_seconds": elapsed / max(window.steps, 1),
    }
    # 0 tokens or FLOPs per sample count as not given.
    rates = throughput_metrics(
        window.samples, elapsed, tokens_per_sample or None, flops_per_sample or None
    )
    metrics["throughput/samples_per_second"] = rates.pop("throughput/samples_per_second")
    if grad_norm is not None:
        metrics["grad/norm"] = float(grad_norm.item())
    if stats.skipped and loss is not None:
        metrics["amp/nonfinite_loss"] = float(not torch.isfinite(loss).item())
    metrics.update(rates)  # tokens/s and FLOP/s, where given
    if plan is not None:
        # The plan's recompute is one micro-batch's; a step runs it once per micro-batch.
        micro = max(window.last_micro_batches, 1)
        if flops_per_sample:
            # The model's own work is 3x its forward; recompute adds forward FLOPs.
            per_step = flops_per_sample * window.last_samples
            recompute = (plan.recompute_flops or 0) * micro
            metrics["recompute/overhead"] = (
                recompute_overhead_from_flops(recompute, per_step) if per_step else 0.0
            )
        elif metrics["time/step_seconds"] > 0:
            metrics["recompute/overhead"] = (
                plan.recompute_seconds * micro / metrics["time/step_seconds"]
            )
    return metrics
