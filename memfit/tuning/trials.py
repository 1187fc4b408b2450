"""Measured trials: candidates trained for a few real steps on fresh models.

A trial builds the model and optimizer afresh (the same seed every trial), makes the
Engine the candidate names, runs a warm-up step (planning, the closed loop, the
optimizer's lazily made state) and measures the next step's peak with the allocator
(:mod:`memfit.allocator`). Then it is timed, one step at a time (:meth:`Trial.time_step`).

The tuner times the trials that succeed side by side, in interleaved rounds: each round
times one step of every trial, in an order rotated from round to round, so a busy moment
of a shared machine slows all of them alike instead of deciding between them
(:func:`time_in_rounds`). The median over the rounds is the trial's step time. On a CUDA
device the trials are measured one after another instead: a trial's peak is read from
the device's own allocator, so no other trial's tensors may be there, and a dedicated GPU
times its steps steadily.

:func:`calibrate` times the model the same way on three small settings before the
search ranks its candidates: the measured terms of the step-time model
(:mod:`memfit.tuning.calibrate`).

When it is closed, a trial reads the gradients of one more micro-batch for the
loss-scale advice. A trial that runs out of memory or raises is caught by the tuner and
recorded; the caller's random state is left as it was.

Example::

    trial = Trial.start(model_fn, batch_fn, loss_fn, None, row, budget, device=torch.device("cpu"))
    trial.peak_bytes, trial.time_step()
    grads = trial.close()
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.engine import Engine, split_batch
from memfit.errors import MemfitError
from memfit.tuning.calibrate import StepTimeModel, TimedPoints, fit_step_time
from memfit.tuning.result import TuneRow


@dataclass(frozen=True)
class GradStats:
    """The unscaled gradients of one micro-batch, for the loss-scale advice."""

    amax: float
    """The largest absolute gradient value."""
    underflow_fraction: float
    """The share of nonzero gradient values below fp16's smallest (2^-24) at scale 1."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_stats(grads: list[torch.Tensor], scale: float = 1.0) -> GradStats | None:
    """:class:`GradStats` of ``grads`` divided by the loss ``scale`` they carry.

    Example::

        grad_stats([p.grad for p in model.parameters() if p.grad is not None])
    """
    dense = [g.detach().float().abs().flatten() / scale for g in grads if not g.is_sparse]
    if not dense:
        return None
    values = torch.cat(dense)
    nonzero = values[values > 0]
    tiny = float((nonzero < 2.0**-24).float().mean()) if nonzero.numel() else 0.0
    return GradStats(float(values.max()), tiny)


@dataclass
class Trial:
    """One candidate's Engine after its warm-up and measured steps, ready to be timed."""

    row: TuneRow
    engine: Engine
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    device: torch.device
    peak_bytes: int
    """The allocator's peak of the step after the warm-up."""
    seconds: list[float] = field(default_factory=list)
    """The timed steps so far, in seconds."""
    error: str | None = None
    """Why a timed step failed (the trial is then timed no more)."""

    @classmethod
    def start(
        cls,
        model_fn: Callable[[], nn.Module],
        batch_fn: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None,
        row: TuneRow,
        budget: int,
        *,
        device: torch.device,
        seed: int = 0,
        estimated_plan: bool = False,
    ) -> Trial:
        """Build ``row``'s setting on a fresh model, run a warm-up step and measure the
        next one's peak. An ``optimal`` row is planned by the Engine at ``budget``, or
        with ``estimated_plan`` takes the estimator's plan (one rank's plan, where this
        process cannot stand for the rank's memory). Raises whatever the model, the
        Engine or the allocator raises (the tuner records it); nothing is left held then."""
        checkpoint: Any = row.checkpoint
        if estimated_plan and row.checkpoint == "optimal" and row.plan is not None:
            checkpoint = row.plan
        engine = None
        try:
            with torch.random.fork_rng(devices=cuda_devices(device), device_type="cuda"):
                engine = fresh_engine(
                    model_fn,
                    optimizer_fn,
                    device,
                    seed,
                    precision=row.precision,
                    checkpoint=checkpoint,
                    memory_budget=budget if checkpoint == "optimal" else None,
                    accumulation_steps=row.accumulation_steps,
                    optimizer_state=row.optimizer_state,
                    release_gradients=row.release_gradients,
                    **storage_setting(row.activation_storage, checkpoint),
                )
                batch = batch_fn(row.micro_batch * row.accumulation_steps)
                engine.train_step(batch, loss_fn)  # plans; the optimizer makes its state
                _sync(device)
                model, optimizer = engine.model, engine.optimizer
                live = [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer)]
                peak = allocator_peak(
                    lambda: engine.train_step(batch, loss_fn), [*live, batch], device
                )
        except BaseException:
            if engine is not None:
                engine.close()
            _collect(device)
            raise
        return cls(row, engine, batch, loss_fn, device, int(peak.peak_bytes))

    def time_step(self) -> float:
        """Time one training step; the seconds are also kept in :attr:`seconds`."""
        self.seconds.append(timed_step(self.engine, self.batch, self.loss_fn, self.device))
        return self.seconds[-1]

    @property
    def median_seconds(self) -> float:
        """The median of the timed steps."""
        return statistics.median(self.seconds)

    def close(self) -> GradStats | None:
        """Read one more micro-batch's unscaled gradients (None when the trial failed or
        the read raised: they only feed the advice), then release the Engine.

        Example::

            stats = trial.close()
        """
        try:
            if self.error is not None:
                return None
            micro = split_batch(self.batch, self.row.accumulation_steps)[0]
            self.engine.backward(micro, self.loss_fn)
            grads = [p.grad for p in self.engine.params if p.grad is not None]
            stats = grad_stats(grads, self.engine.scaler.get_scale())
            self.engine.step()
            return stats
        except Exception:
            return None
        finally:
            self.release()

    def release(self) -> None:
        """Close the Engine and give its memory back, reading nothing more."""
        self.engine.close()
        _collect(self.device)


def timed_step(
    engine: Engine,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
) -> float:
    """The seconds of one ``engine.train_step`` (the device synchronized before the clock
    stops: a CUDA step's kernels run after the call returns).

    Example::

        seconds = timed_step(engine, batch, loss_fn, torch.device("cpu"))
    """
    start = time.perf_counter()
    engine.train_step(batch, loss_fn)
    _sync(device)
    return time.perf_counter() - start


def storage_setting(activation_storage: tuple[str, ...], checkpoint: Any) -> dict[str, Any]:
    """The Engine's ``activation_storage=`` for a trial: only where the Engine plans the
    real model (``optimal``; an estimator's plan carries its storage itself).

    >>> storage_setting(("keep", "recompute", "fp8"), "optimal")
    {'activation_storage': ('keep', 'recompute', 'fp8')}
    >>> storage_setting(("keep", "recompute", "fp8"), "full")
    {}
    """
    if checkpoint != "optimal" or len(activation_storage) <= 2:
        return {}
    return {"activation_storage": tuple(activation_storage)}


def fresh_engine(
    model_fn: Callable[[], nn.Module],
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None,
    device: torch.device,
    seed: int,
    **settings: Any,
) -> Engine:
    """An Engine with ``settings`` on a model built by ``model_fn`` after seeding
    ``seed`` (the same weights every time) and moved to ``device``, its optimizer
    ``optimizer_fn`` (default AdamW); no monitor, no log lines.

    Example::

        engine = fresh_engine(model_fn, None, torch.device("cpu"), 0, precision="fp32")
    """
    torch.manual_seed(seed)
    model = model_fn().to(device)
    optimizer = (optimizer_fn or torch.optim.AdamW)(model.parameters())
    return Engine(model, optimizer, monitor=False, log_every=10**9, **settings)


def time_in_rounds(trials: Sequence[Trial], rounds: int, first_round: int = 0) -> None:
    """Time ``rounds`` steps of every trial, one step of each per round, the order rotated
    by one each round (so no trial always runs right after the same other one). A trial
    whose step raises keeps the reason in ``error`` and is timed no more. ``first_round``:
    the rotation's start, for a caller timing one round at a time (the rounds so far).

    Example::

        time_in_rounds([a, b, c], rounds=5)   # a b c, b c a, c a b, a b c, b c a
        time_in_rounds([a, b, c], rounds=1, first_round=1)   # b c a
        min(trials, key=lambda t: t.median_seconds)
    """
    for r in range(first_round, first_round + rounds):
        for i in range(len(trials)):
            trial = trials[(i + r) % len(trials)]
            if trial.error is not None:
                continue
            try:
                trial.time_step()
            except Exception as exc:  # recorded on the trial; the others go on
                trial.error = first_line(exc)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 200 characters (a table cell)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def holds_trials(device: torch.device) -> bool:
    """Whether trials on ``device`` are kept alive and timed side by side (the CPU), or
    measured and released one after another (CUDA: see the module's docstring)."""
    return device.type != "cuda"


def cuda_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose random state a fork around work on ``device`` keeps."""
    return [device.index or 0] if device.type == "cuda" else []


def _collect(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


#: Timed steps per calibration point, after one warm-up step.
TIMED_STEPS = 7


def calibrate(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None,
    *,
    precision: str,
    counted: Callable[[int], float | None],
    recomputed: Callable[[int], float | None],
    m1: int,
    m2: int | None,
    device: torch.device,
) -> StepTimeModel:
    """Time the model on the points of :mod:`memfit.tuning.calibrate` and fit the terms;
    a model that fails here (out of memory, an error on real data) gives the count alone,
    with the reason in ``note`` (the trials then report the error themselves).

    ``counted(m)``: the counted seconds of one micro-batch of ``m`` in ``precision``
    without checkpointing; ``recomputed(m)``: what checkpointing every block recomputes
    in it, counted (None where the search has none).

    Example::

        calibrate(model_fn, batch_fn, loss_fn, None, precision="fp32",
                  counted=lambda m: per_micro[m], recomputed=lambda m: None, m1=2, m2=8,
                  device=torch.device("cpu"))
    """
    c1 = counted(m1)
    c2 = counted(m2) if m2 is not None else None
    r2 = recomputed(m2) if m2 is not None and c2 else None
    if not c1:
        return StepTimeModel(note=f"no counted time of micro-batch {m1} in {precision}")
    sizes: list[tuple[int, int, str]] = [(m1, 1, "none"), (2 * m1, 2, "none")]
    if m2 is not None and c2:
        sizes.append((m2, 1, "none"))
        if r2:
            sizes.append((m2, 1, "full"))
    points: list[_Point] = []  # in the order of sizes
    try:
        with torch.random.fork_rng(devices=cuda_devices(device), device_type="cuda"):
            for n, accumulation, checkpoint in sizes:
                point = _Point.start(
                    model_fn,
                    batch_fn,
                    loss_fn,
                    optimizer_fn,
                    device,
                    n,
                    precision=precision,
                    accumulation_steps=accumulation,
                    checkpoint=checkpoint,
                )
                points.append(point)
                if not holds_trials(device):  # CUDA: one at a time, as the trials are
                    time_in_rounds([point], TIMED_STEPS)
                    point.release()
            if holds_trials(device):
                time_in_rounds(points, TIMED_STEPS)
    except (MemfitError, RuntimeError, ValueError, TypeError) as exc:
        return StepTimeModel(note=f"timing the model failed: {type(exc).__name__}: {exc}"[:200])
    finally:
        for point in points:
            point.release()
    failed = next((p.error for p in points if p.error), None)
    if failed:
        return StepTimeModel(note=f"timing the model failed: {failed}")
    # The fastest of each point's steps: the least disturbed by the rest of the machine.
    t1, t3, *rest = (min(p.seconds) for p in points)
    t2, t4 = (rest + [None, None])[:2]
    return fit_step_time(TimedPoints(c1, c2, t1, t2, t3, r2, t4))


@dataclass
class _Point:
    """One calibration step's Engine after a warm-up step, timed like a trial."""

    engine: Engine | None
    """None once released (its timed steps stay)."""
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    device: torch.device
    seconds: list[float] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def start(
        cls,
        model_fn: Callable[[], nn.Module],
        batch_fn: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None,
        device: torch.device,
        n: int,
        **settings: Any,
    ) -> _Point:
        # A fresh model each point: a mode may recast its weights.
        engine = fresh_engine(model_fn, optimizer_fn, device, 0, **settings)
        point = cls(engine, batch_fn(n), loss_fn, device)
        try:
            engine.train_step(point.batch, loss_fn)  # warm-up: the optimizer's state
        except BaseException:
            engine.close()
            raise
        return point

    def time_step(self) -> float:
        assert self.engine is not None, "a released calibration point is not timed"
        self.seconds.append(timed_step(self.engine, self.batch, self.loss_fn, self.device))
        return self.seconds[-1]

    def release(self) -> None:
        """Close the Engine and give its memory back, keeping the timed steps."""
        if self.engine is not None:
            self.engine.close()
            self.engine = self.batch = None
            _collect(self.device)
