"""What the allocator sees of a step that no tensor count predicts, measured on the model.

Two parts of a step's memory cannot be counted from tensors:

* **the kernels' own workspace.** A CPU kernel may allocate buffers no tensor shows (a
  depthwise convolution's backward unfolds its input, for one). A dispatch-level tracker
  cannot see them; the allocator can (on CUDA, cuBLAS's workspaces, kept from a
  handle's first matmul on: 32 MiB a handle on a Hopper GPU). Running one step under both at once
  (:mod:`memfit.allocator`, :mod:`memfit.memory`) and taking their difference at the
  peak of the units' part of the step measures them, and the planner counts it all step.
* **the edges of the step**, while no unit runs: before the first unit's forward (an
  embedding, a convolution stem) and after the last unit's backward (that stem's backward,
  with every gradient made by then). No plan changes what is held there, so the planned
  peak is never below it. A stem's backward can be the step's peak: on a CPU without
  bf16 kernels, a bf16 convolution's backward unfolds its input into a buffer larger than
  any activation. It is measured, not modelled.

Example::

    m = step_workspace(model, lambda: model(x).sum(), PrecisionPolicy("fp32"),
                       units=["layers.0", "layers.1"])
    m.workspace_bytes, m.edges
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.allocator import Timeline, allocator_peak, release_kernel_workspaces, storage_bytes
from memfit.checkpoint.compiled import unwrap_compiled
from memfit.checkpoint.profiler.runner import preserved
from memfit.memory import measure, tracked_bytes
from memfit.nested import tensors
from memfit.precision.policy import PrecisionPolicy

__all__ = ["StepEdges", "StepWorkspace", "step_workspace"]

_BEGIN = "memfit::unit_begin"
_END = "memfit::unit_end"
_BACKWARD_DONE = "memfit::unit_backward_done"
_FORWARD_DONE = "memfit::forward_done"
_OUTPUT_GRAD = "memfit::unit_output_grad"


@dataclass(frozen=True)
class StepEdges:
    """What a step holds while none of its units runs, above its parameters, buffers and
    inputs (the allocator's count, kernels' buffers included)."""

    head_bytes: int
    """The most held before the first unit's forward begins."""
    tail_bytes: int
    """The most held after the last unit's backward is done, less the gradients the
    measured step had made by its end (the planner adds the step's own gradients)."""
    loss_spike_bytes: int = 0
    """The most the loss's part of forward (from the end of the last unit's forward to
    the call of ``backward``) held above what was left when it ended: its transients (a
    segmentation model's upsampled logits made contiguous for ``log_softmax``), which no
    count of saved tensors sees. The same ops run there under any plan."""
    loss_spike_later_bytes: int = 0
    """The same, of the moments after the last unit's end: the loss's part of forward with
    what the last unit's end held and freed soon after left out (a concatenation's
    output the model holds until it returns). A plan that keeps such a tensor as a
    checkpoint's input counts it with what is kept: the spike less it is at least this
    (:meth:`memfit.checkpoint.step_memory.StepMemory.loss_for`)."""
    head_backward_bytes: int | None = None
    """The most the head of backward (from the call of ``backward`` until the gradient of
    a unit's output is made, which starts that unit's backward: the loss's backward and
    the ops after the last unit) held above what was held when forward ended: the
    gradients it makes less the loss's saved tensors it frees, kernels' buffers included.
    The same ops run there under any plan, with everything kept held. None when not seen."""
    forward_end_untracked_bytes: int | None = None
    """What the allocator held at the end of forward beyond every tensor the storage
    tracker saw alive then: kernels' buffers that outlive their op (an LSTM's, kept for its
    backward). The moments of the loss hold this much of the kernels' workspace, not the
    whole of the units' (a transient of some unit's backward). None when not seen."""


@dataclass(frozen=True)
class StepWorkspace:
    """One step measured by the allocator and the storage tracker at once."""

    workspace_bytes: int
    """What kernels allocate beyond every tensor at the peak of the units' part of the
    step: the allocator's peak there less the tracker's peak."""
    edges: StepEdges | None
    """The step's edges, when the units' first forward and last backward were seen."""


def step_workspace(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    policy: PrecisionPolicy,
    inputs: Any = None,
    units: Sequence[str] = (),
) -> StepWorkspace:
    """One forward and backward of ``loss()`` on CPU measured by the allocator and by the
    storage tracker at once (the allocator's window runs no garbage collection, so only
    the step's own memory shows): the kernels' workspace at the peak of the part of the
    step where ``units`` (the planned modules' names) run, and what the step
    holds before and after them (:class:`StepEdges`). On CUDA the workspace alone, no
    edges (:func:`_cuda_workspace`: mostly cuBLAS's, which a step holds from its first
    matmul on). Gradients, buffers and the random state are as before; on other devices
    nothing is measured (zeros, no edges).

    Example::

        step_workspace(model, lambda: model(x).sum(), PrecisionPolicy("fp32"), None,
                       ["layers.0", "layers.1"]).edges.tail_bytes
    """
    model = unwrap_compiled(model)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        return StepWorkspace(_cuda_workspace(model, loss, policy, device), None)
    if device.type != "cpu":
        return StepWorkspace(0, None)

    forward_end: list[int | None] = []

    def step() -> None:
        with policy.autocast(device.type):
            value = loss()
        forward_end.append(tracked_bytes())  # no allocation between this and the mark
        with torch.profiler.record_function(_FORWARD_DONE):
            pass
        value.backward()

    modules = [model.get_submodule(name) for name in units if name]
    with preserved(model, train=None, rng_devices=[]), _marked(modules):
        peak = allocator_peak(
            lambda: measure(step, model=model),
            live=[*params, *model.buffers(), inputs],
            device=device,
            timeline=True,
        )
        grads = storage_bytes([p.grad for p in params if p.grad is not None])
    timeline = peak.timeline
    edges = _edges(timeline, int(grads)) if timeline is not None else None
    if edges is not None and forward_end and forward_end[0] is not None:
        done = timeline.marks.get(_FORWARD_DONE)
        if done:
            held = peak.start_bytes + timeline.highest(done[0], done[0])
            untracked = max(0, int(held - forward_end[0]))
            edges = dataclasses.replace(edges, forward_end_untracked_bytes=untracked)
    units_peak = peak.peak_bytes
    if timeline is not None and edges is not None:
        begin, done = timeline.marks[_BEGIN][0], timeline.marks[_BACKWARD_DONE][-1]
        units_peak = peak.start_bytes + timeline.highest(begin, done)
    return StepWorkspace(max(0, int(units_peak - peak.result.tracked_peak_bytes)), edges)


def _cuda_workspace(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    policy: PrecisionPolicy,
    device: torch.device,
) -> int:
    """One forward and backward on CUDA, cuBLAS's workspaces freed first: the caching
    allocator's rise less the storage tracker's. That is what kernels hold that no tensor
    shows (the workspaces each handle makes at its first matmul and keeps, the allocator's
    rounding), held from the step's first matmul on. The rises, not the levels: the
    allocator counts every tensor on the device, the tracker only those of the step."""
    tracked_start: list[int | None] = []

    def step() -> None:
        tracked_start.append(tracked_bytes())
        with policy.autocast(device.type):
            value = loss()
        value.backward()

    with preserved(model, train=None, rng_devices=[device.index or 0]):
        release_kernel_workspaces(device)
        report = measure(step, model=model, device=device)
    start = tracked_start[0] if tracked_start and tracked_start[0] is not None else 0
    allocator_rise = report.peak_bytes - report.start_bytes
    tracker_rise = report.tracked_peak_bytes - start
    return max(0, int(allocator_rise - tracker_rise))


def _edges(timeline: Timeline, grad_bytes: int) -> StepEdges | None:
    begins, dones = timeline.marks.get(_BEGIN), timeline.marks.get(_BACKWARD_DONE)
    if not begins or not dones:
        return None
    end = timeline.times[-1] if timeline.times else dones[-1]
    head = timeline.highest(float("-inf"), begins[0])
    tail = timeline.highest(dones[-1], end)
    spike = later = 0
    ends, done = timeline.marks.get(_END, []), timeline.marks.get(_FORWARD_DONE, [])
    if done and ends and ends[0] < done[0]:
        start = max(t for t in ends if t < done[0])  # the last unit's end in forward
        left = timeline.highest(done[0], done[0])
        spike = timeline.highest(start, done[0]) - left
        # The moments after it: from the first allocation or free after the start.
        i = bisect.bisect_right(timeline.times, start)
        if i < len(timeline.times) and timeline.times[i] <= done[0]:
            later = timeline.highest(timeline.times[i], done[0]) - left
    head_backward = None
    grads_out = timeline.marks.get(_OUTPUT_GRAD, [])
    if done and any(t > done[0] for t in grads_out):
        first = min(t for t in grads_out if t > done[0])  # the first unit's backward begins
        head_backward = max(
            0, timeline.highest(done[0], first) - timeline.highest(done[0], done[0])
        )
    return StepEdges(
        head_bytes=head,
        tail_bytes=max(0, tail - grad_bytes),
        loss_spike_bytes=max(0, spike),
        loss_spike_later_bytes=max(0, later),
        head_backward_bytes=head_backward,
    )


@contextlib.contextmanager
def _marked(modules: list[nn.Module]) -> Iterator[None]:
    """Marks on the profiler's clock when any of ``modules`` begins and ends its forward,
    when the gradient of its output is made (its backward begins), and when each part of
    its backward is done: the gradient of each input made in the step, and each
    parameter's gradient accumulated. The last such mark ends the last unit's backward; a
    unit with neither has no backward."""
    step_handles: list[Any] = []

    def mark(name: str) -> None:
        with torch.profiler.record_function(name):
            pass

    def done(_: torch.Tensor) -> None:
        mark(_BACKWARD_DONE)

    def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        mark(_BEGIN)
        if torch.is_grad_enabled():
            # Only tensors made in the step: a leaf's hook would outlive it.
            made = [t for t in tensors((args, kwargs)) if t.requires_grad and t.grad_fn]
            step_handles.extend(t.register_hook(done) for t in made)

    def grad_made(_: torch.Tensor) -> None:
        mark(_OUTPUT_GRAD)

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        mark(_END)
        if torch.is_grad_enabled():
            made = [t for t in tensors(output) if t.requires_grad and t.grad_fn]
            step_handles.extend(t.register_hook(grad_made) for t in made)

    params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad}
    handles = [p.register_post_accumulate_grad_hook(done) for p in params.values()]
    handles += [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules]
    handles += [m.register_forward_hook(post_hook) for m in modules]
    try:
        yield
    finally:
        for h in [*handles, *step_handles]:
            h.remove()
