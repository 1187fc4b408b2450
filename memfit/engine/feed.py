"""Micro-batches as they come: one optimizer step's micro-batches, fed one at a time.

``Engine.backward(micro, loss_fn)`` runs a micro-batch's forward and scaled backward;
``Engine.step()`` ends the step. ``Engine.train_step(batch, loss_fn)`` splits its batch and
feeds the parts the same way, so the two give bitwise the same training.

**Weighting.** A step's gradient must be that of one batch of all its micro-batches: each
micro-batch's mean loss weighs ``size / total``. The total is not known until ``step()``,
so each loss is weighted by ``size / reference`` (``reference``: the first micro-batch's
size times ``accumulation_steps``, the total of a full step of micro-batches like it) and
``step()`` multiplies the gradients by ``reference / total`` where the two differ (a short
last step). In the usual case they do not, and nothing is multiplied.

**Measuring.** The first step under a plan memfit made (the closed loop) and the monitor's
memory step are measured call by call: each ``backward`` and the ``step`` runs under the
measurement, and the step's peak is the highest of theirs. Between the calls only the
user's code runs; what the Engine holds then (the gradients so far) is counted at the start
of the next call.

**Data parallel** (DDP, FSDP2; :mod:`memfit.engine.data_parallel`): gradients are reduced only
in the last micro-batch's backward (``no_sync`` / ``set_requires_gradient_sync(False)``
before it), known from ``accumulation_steps`` or ``train_step``'s split; a DDP step that
ends early is averaged at ``step()``.

Nothing here takes the Engine: it is given the model, the optimizer and the work to run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpoint.optimizer_bytes import optimizer_state_bytes
from memfit.distributed.collectives import total_norm
from memfit.engine.plan_stage import EnginePlan


@dataclass
class Window:
    """The micro-batches fed since the last optimizer step.

    Example::

        window = Window(reference=16, loss_sum=torch.zeros(()))
        weight = window.weight(4)  # 0.25 of the step's loss
    """

    reference: int
    """The samples of a full step of micro-batches like the first: its weights' denominator."""
    loss_sum: torch.Tensor
    """The weighted losses so far (fp32, detached, on the device: no sync)."""
    count: int = 0
    """Micro-batches fed."""
    samples: int = 0
    """Samples fed."""
    check: EnginePlan | None = None
    """The plan whose first step this is, to measure by the allocator (the closed loop)."""
    keep_report: bool = False
    """Whether this is the monitor's memory step, whose MemoryReport the monitor keeps."""
    activation_peak: int = 0
    """The highest allocator peak of the ``backward`` calls (with ``check``)."""
    optimizer_peak: int = 0
    """The allocator peak of the ``step`` call (with ``check``)."""
    state_added: int = 0
    """Optimizer state the step created: torch's optimizers make theirs at their first
    step, so the first step's backward passes ran without it (with ``check``)."""
    report: Any = None
    """The MemoryReport of the call with the highest peak (when measured)."""

    def weight(self, size: int) -> float:
        """The weight of a micro-batch of ``size`` samples' mean loss."""
        return size / self.reference

    @property
    def factor(self) -> float:
        """What the step's gradients are multiplied by: ``reference / total`` (1.0 for a
        full step of equal micro-batches)."""
        return self.reference / self.samples

    @property
    def peak_bytes(self) -> int:
        """The step's peak as the allocator saw it, as every later step reaches it: the
        optimizer state a first step created is held through later steps' backward passes.
        """
        return max(self.activation_peak + self.state_added, self.optimizer_peak)

    @property
    def measured(self) -> bool:
        """Whether this step's calls run under a measurement."""
        return self.check is not None or self.keep_report


def rescale_gradients(params: list[torch.Tensor], factor: float) -> None:
    """Multiply the gradients of ``params`` by ``factor`` in place (nothing for 1.0).

    Example::

        rescale_gradients(engine.params, window.factor)
    """
    if factor == 1.0:
        return
    grads = [p.grad for p in params if p.grad is not None]
    dense = [g for g in grads if not g.is_sparse]
    if dense:
        torch._foreach_mul_(dense, factor)
    for g in grads:
        if g.is_sparse:  # an nn.Embedding(sparse=True)'s: foreach takes dense tensors only
            g.mul_(factor)


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of ``params`` to the total norm ``max_norm`` in place; return
    their total norm before clipping, as a device tensor (no sync; the whole model's under
    FSDP2). A non-finite norm clips nothing: that step is skipped, and its gradients are
    left as they are so the diagnosis can still find the parameter that overflowed.

    Example::

        norm = clip_gradients(engine.params, 1.0)
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads)
    safe_norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, safe_norm, foreach=True)
    return norm


def run_measured(
    window: Window,
    work: Callable[[], Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    inputs: Any = None,
    optimizer_phase: bool = False,
) -> Any:
    """Run ``work()``, under the window's measurement when it has one, and return its result.

    With ``window.check`` the allocator measures it (the closed loop's judge) around
    ``memfit.measure`` (the monitor's kinds); the window keeps the peaks and the report of
    the highest. ``inputs``: tensors the work uses that were made before it (the
    micro-batch). ``optimizer_phase``: the work is the optimizer step.

    Example::

        loss = run_measured(window, lambda: backward_one(micro), model, opt, device, micro)
    """
    if not window.measured:
        return work()
    from memfit.allocator import allocator_peak, optimizer_tensors
    from memfit.checkpoint.measured_fit import module_tensors
    from memfit.memory import measure

    def tracked() -> Any:
        return measure(work, model=model, optimizer=optimizer)

    if window.check is None:
        report = tracked()
        if window.report is None or report.peak_bytes > window.report.peak_bytes:
            window.report = report
        return report.result
    # On CPU the allocator starts from what is alive: the weights, the optimizer, the
    # gradients of the micro-batches so far, what the modules keep on themselves and the
    # inputs (on CUDA it knows it itself). Named, each one's free counts its own size; a
    # free of anything else (a scalar of the last step) counts nothing, since the profiler
    # may size it by an earlier block at its address (memfit.allocator).
    # (Listed in the call, not held past it: the work may free them.)
    optimizer_held = optimizer_tensors(optimizer)
    state_before = _state_bytes(optimizer)
    peak = allocator_peak(
        tracked,
        live=[
            *model.parameters(),
            *model.buffers(),
            *optimizer_held,
            *(p.grad for p in (*model.parameters(), *optimizer_held) if p.grad is not None),
            window.loss_sum,
            *module_tensors(model),
            inputs,
        ],
        device=device,
        live_complete=True,
    )
    if optimizer_phase:
        window.optimizer_peak = max(window.optimizer_peak, peak.peak_bytes)
        window.state_added = max(0, _state_bytes(optimizer) - state_before)
    else:
        window.activation_peak = max(window.activation_peak, peak.peak_bytes)
    report = peak.result
    if window.report is None or report.peak_bytes > window.report.peak_bytes:
        window.report = report
    return report.result


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors as allocated now, each storage once."""
    return optimizer_state_bytes(optimizer, predict=False, storages=True)
