"""Throughput and recompute overhead: samples/s, tokens/s, FLOP/s, MFU, counted FLOPs.

Host-side only: nothing here reads the device except :func:`count_flops`, which runs the
function it is given. :func:`throughput_metrics` is the one formula of the rates: the
Engine reports its ``throughput/*`` with it every ``log_every`` steps, and
:class:`Throughput` with it for measuring outside the Engine. Also importable from
:mod:`memfit.monitor.metrics`.

Example::

    tp = Throughput(tokens_per_sample=256)
    tp.add(samples=16, seconds=0.12)
    tp.metrics()   # {"throughput/samples_per_second": 133.3, "throughput/tokens_per_second": ...}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from memfit.errors import ConfigError

__all__ = [
    "Throughput",
    "count_flops",
    "recompute_overhead_from_flops",
    "recompute_overhead_from_time",
    "throughput_metrics",
]


def throughput_metrics(
    samples: int,
    seconds: float,
    tokens_per_sample: float | None = None,
    flops_per_sample: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """The ``throughput/*`` metrics of ``samples`` processed in ``seconds`` of wall time:
    samples/s, and tokens/s, FLOP/s and model FLOP utilization where ``tokens_per_sample``,
    ``flops_per_sample`` and ``peak_flops`` are given. Every rate is 0.0 when no time passed.

    Example::

        throughput_metrics(16, 0.12, tokens_per_sample=256)
        # {"throughput/samples_per_second": 133.3, "throughput/tokens_per_second": 34133.3}
    """
    sps = samples / seconds if seconds > 0 else 0.0
    out = {"throughput/samples_per_second": sps}
    if tokens_per_sample is not None:
        out["throughput/tokens_per_second"] = sps * tokens_per_sample
    if flops_per_sample is not None:
        flops = sps * flops_per_sample
        out["throughput/flops_per_second"] = flops
        if peak_flops is not None:
            out["throughput/mfu"] = flops / peak_flops
    return out


def recompute_overhead_from_flops(recompute_flops: float, forward_backward_flops: float) -> float:
    """Extra work from checkpointing: ``recompute_flops / forward_backward_flops``.

    ``forward_backward_flops`` is one step's forward and backward without checkpointing
    (count both with ``torch.utils.flop_counter.FlopCounterMode``, see :func:`count_flops`).
    This is the overhead if every FLOP cost the same time; memory-bound recomputed ops
    (norms, activations) cost more time per FLOP, so it reads low for them.

    Example::

        recompute_overhead_from_flops(plan.recompute_flops, 3 * forward_flops)
    """
    if not forward_backward_flops > 0:
        raise ConfigError(
            f"forward_backward_flops must be > 0, got {forward_backward_flops}; count the step first"
        )
    if recompute_flops < 0:
        raise ConfigError(f"recompute_flops must be >= 0, got {recompute_flops}")
    return float(recompute_flops) / float(forward_backward_flops)


def recompute_overhead_from_time(
    step_seconds_with_plan: float, step_seconds_without: float
) -> float:
    """Extra step time from checkpointing: ``with_plan / without - 1``.

    Measure both as the mean over several steps after warm-up, with the device synced at
    the ends of the window. This is the overhead that matters, but it includes noise; it
    can come out slightly negative, which means "no measurable overhead".

    Example::

        recompute_overhead_from_time(0.130, 0.100)   # 0.3
    """
    if not step_seconds_without > 0:
        raise ConfigError(f"step_seconds_without must be > 0, got {step_seconds_without}")
    return float(step_seconds_with_plan) / float(step_seconds_without) - 1.0


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of running ``fn()`` once, counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Counts matmuls, convolutions and attention (what dominates); runs ``fn`` for real.

    Example::

        flops = count_flops(lambda: model(x).sum().backward())
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


class Throughput:
    """Samples/s, tokens/s and achieved FLOP/s over a window of steps (host-side).

    Give it the samples and wall seconds of each step (or of a window of steps). Timing on
    an accelerator is only right over windows whose ends were synced (the engine reads
    metrics every ``log_every`` steps, which syncs). ``tokens_per_sample`` and
    ``flops_per_sample`` (forward + backward + recompute, e.g. from :func:`count_flops`
    divided by the batch size) enable the matching metrics; ``peak_flops`` (the device's
    peak FLOP/s in the training dtype) adds model FLOP utilization.

    Example::

        tp = Throughput(tokens_per_sample=256, flops_per_sample=6 * n_params * 256)
        tp.add(samples=16, seconds=0.12)
        tp.metrics()   # {"throughput/samples_per_second": 133.3, "throughput/tokens_per_second": ...}
    """

    def __init__(
        self,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        for name, value in (
            ("tokens_per_sample", tokens_per_sample),
            ("flops_per_sample", flops_per_sample),
            ("peak_flops", peak_flops),
        ):
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 or None, got {value}")
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.samples = 0
        self.seconds = 0.0
        self._started: float | None = None

    def add(self, samples: int, seconds: float) -> None:
        """Count ``samples`` processed in ``seconds`` of wall time."""
        if samples < 0 or seconds < 0:
            raise ConfigError(f"samples and seconds must be >= 0, got {samples}, {seconds}")
        self.samples += int(samples)
        self.seconds += float(seconds)

    def start(self) -> None:
        """Start timing a step on the host clock; :meth:`stop` adds it."""
        self._started = time.perf_counter()

    def stop(self, samples: int) -> None:
        """Add the step started by :meth:`start` with ``samples`` samples."""
        if self._started is None:
            raise ConfigError("Throughput.stop() called without start()")
        self.add(samples, time.perf_counter() - self._started)
        self._started = None

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Rates over the window since the last reset; empty when no time was counted."""
        if self.seconds <= 0:
            return {}
        out = throughput_metrics(
            self.samples,
            self.seconds,
            self.tokens_per_sample,
            self.flops_per_sample,
            self.peak_flops,
        )
        if reset:
            self.samples = 0
            self.seconds = 0.0
        return out
