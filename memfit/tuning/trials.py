"""A measured trial: a candidate trained for a few real steps on a fresh model.

The trial builds the model and optimizer afresh (the same seed every trial), makes the
Engine the candidate names, runs a warm-up step (planning, the closed loop, the
optimizer's lazily made state), measures the next step's peak with the allocator
(:mod:`memfit.allocator`) and then times ``steps`` steps, keeping the fastest: on a shared
machine another process's burst slows some steps, never speeds one up, so the fastest is
the setting's own speed (the matmul probe keeps its fastest run for the same reason). The gradients of
one more micro-batch are read for the loss-scale advice. A trial that runs out of memory
or raises is caught by the tuner and recorded; the caller's random state is left as it was.

Example::

    outcome = run_trial(model_fn, batch_fn, loss_fn, None, row, budget, steps=3, device="cpu")
    outcome.peak_bytes, outcome.step_seconds
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.allocator import allocator_peak, optimizer_tensors
from memfit.engine import Engine, split_batch
from memfit.tuning.result import TuneRow


@dataclass(frozen=True)
class GradStats:
    """The unscaled gradients of one micro-batch, for the loss-scale advice."""

    amax: float
    """The largest absolute gradient value."""
    underflow_fraction: float
    """The share of nonzero gradient values below fp16's smallest (2^-24) at scale 1."""


@dataclass(frozen=True)
class TrialOutcome:
    peak_bytes: int
    step_seconds: float
    grads: GradStats | None


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


def run_trial(
    model_fn: Callable[[], nn.Module],
    batch_fn: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None,
    row: TuneRow,
    budget: int,
    *,
    steps: int,
    device: torch.device,
    seed: int = 0,
) -> TrialOutcome:
    """Train ``row``'s setting for ``1 + 1 + steps`` steps and one more micro-batch.

    Raises whatever the model, the Engine or the allocator raises (the tuner records it).
    """
    devices = [device.index or 0] if device.type == "cuda" else []
    held: list[Engine] = []  # closed and dropped at the end, whatever happened
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.manual_seed(seed)
            model = model_fn().to(device)
            optimizer = (optimizer_fn or torch.optim.AdamW)(model.parameters())
            engine = Engine(
                model,
                optimizer,
                precision=row.precision,
                checkpoint=row.checkpoint,
                memory_budget=budget if row.checkpoint == "optimal" else None,
                accumulation_steps=row.accumulation_steps,
                monitor=False,
                log_every=10**9,
            )
            held.append(engine)
            batch = batch_fn(row.micro_batch * row.accumulation_steps)
            engine.train_step(batch, loss_fn)  # plans; the optimizer makes its state
            _sync(device)
            live = [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), batch]
            peak = allocator_peak(lambda: engine.train_step(batch, loss_fn), live, device)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.train_step(batch, loss_fn)
                _sync(device)
                times.append(time.perf_counter() - start)
            micro = split_batch(batch, row.accumulation_steps)[0]
            engine.backward(micro, loss_fn)
            stats = grad_stats(
                [p.grad for p in engine.params if p.grad is not None], engine.scaler.get_scale()
            )
            engine.step()
        return TrialOutcome(peak.peak_bytes, min(times), stats)
    finally:
        for e in held:
            e.close()
        held.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
