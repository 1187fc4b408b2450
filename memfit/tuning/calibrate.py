"""The step-time model's measured terms: what counting FLOPs leaves out.

The tuner's search predicts a step from counted FLOPs and bytes at the matmul probe's
rate (:mod:`memfit.candidates`). That count misses what makes small micro-batches slow
and tiny models slower than their FLOPs: each micro-batch's fixed cost (every op's
dispatch, autograd's bookkeeping, autocast's casts), each step's fixed cost (the
optimizer step, zeroing gradients), and how far the model's kernels run from the probe's
rate. So before ranking, the model itself is timed on a few small steps of real data,
in the precision the tuner ranks first (fp32 where it is compared), through the Engine
the trials use:

- micro-batch ``m1`` as one micro-batch: ``t1 = per_micro + scale x c1 + per_step``;
- micro-batch ``m2`` (> ``m1``) as one: ``t2 = per_micro + scale x c2 + per_step``;
- ``2 x m1`` as two micro-batches of ``m1``: ``t3 = 2 (per_micro + scale x c1) + per_step``;

where ``c1``, ``c2`` are the counted seconds of one micro-batch. Three equations give
the three terms (:func:`fit_step_time`); each is kept at zero or above, and without a
usable ``m2`` the scale stays 1. A fourth step, ``m2`` with every block checkpointed,
gives what recompute really costs: ``t4 - t2 = recompute_scale x r2``, ``r2`` the
recompute counted (without it, or where it measured nothing, the scale of the rest). A
predicted step is then
``accumulation x (per_micro + scale x counted + recompute_scale x recompute) + per_step``
(:meth:`StepTimeModel.seconds`). The points are timed like the trials
(:func:`memfit.tuning.trials.calibrate`): after a warm-up step each, 7 interleaved
rounds (on CUDA one point after another), and each point's fastest step counts: the
least disturbed by the rest of a shared machine.

Example::

    model = fit_step_time(TimedPoints(c1=1e-3, c2=4e-3, t1=0.020, t2=0.029, t3=0.031))
    model.seconds(counted=2e-3, accumulation=4)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimeModel:
    """A step's time from counted seconds: ``accumulation x (per_micro_seconds + scale x
    counted) + per_step_seconds``. The default is the count alone."""

    scale: float = 1.0
    """Measured seconds per counted second of a micro-batch's FLOPs and bytes."""
    per_micro_seconds: float = 0.0
    """Each micro-batch's fixed cost."""
    per_step_seconds: float = 0.0
    """Each step's fixed cost (the optimizer step among it)."""
    measured: bool = False
    """Whether the terms were measured on the model (False: the count alone)."""
    note: str = ""
    """Why the terms were not measured, where they were not."""
    recompute_scale: float = 1.0
    """Measured seconds per counted second of recompute (its ops' dispatch and the
    checkpoint's bookkeeping come on top of its FLOPs)."""

    def seconds(self, counted: float, recompute: float, accumulation: int) -> float:
        """A step of ``accumulation`` micro-batches of ``counted`` seconds each, the plan
        recomputing ``recompute`` counted seconds in each.

        Example::

            StepTimeModel(2.0, 0.01, 0.05).seconds(0.1, 0.0, 2)   # 2 x (0.01 + 0.2) + 0.05
        """
        micro = self.per_micro_seconds + self.scale * counted + self.recompute_scale * recompute
        return accumulation * micro + self.per_step_seconds


@dataclass(frozen=True)
class TimedPoints:
    """Counted and measured seconds of the calibration steps (module docstring)."""

    c1: float
    """Counted seconds of one micro-batch of ``m1``."""
    c2: float | None
    """Counted seconds of one micro-batch of ``m2`` (None: no usable ``m2``)."""
    t1: float
    """Measured: ``m1`` as one micro-batch."""
    t2: float | None
    """Measured: ``m2`` as one micro-batch."""
    t3: float
    """Measured: ``2 x m1`` as two micro-batches."""
    r2: float | None = None
    """Counted recompute seconds of one micro-batch of ``m2`` with every block
    checkpointed (None: not measured)."""
    t4: float | None = None
    """Measured: ``m2`` as one micro-batch, every block checkpointed."""


def fit_step_time(p: TimedPoints) -> StepTimeModel:
    """The terms from the points, each at zero or above.

    Example::

        fit_step_time(TimedPoints(c1=1e-3, c2=4e-3, t1=0.020, t2=0.029, t3=0.031)).scale   # 3.0
    """
    scale = 1.0
    if p.c2 is not None and p.t2 is not None and p.c2 > p.c1:
        slope = (p.t2 - p.t1) / (p.c2 - p.c1)
        if slope > 0:
            scale = slope
    per_micro = max(0.0, p.t3 - p.t1 - scale * p.c1)
    per_step = max(0.0, p.t1 - per_micro - scale * p.c1)
    recompute_scale = scale
    if p.r2 and p.t4 is not None and p.t2 is not None and p.t4 > p.t2:
        recompute_scale = (p.t4 - p.t2) / p.r2
    return StepTimeModel(scale, per_micro, per_step, True, "", recompute_scale)
