"""The kernels' own workspace in a step: what the allocator sees beyond every tensor.

A CPU kernel may allocate buffers no tensor shows (a depthwise convolution's backward
unfolds its input, for one). A dispatch-level tracker cannot see them; the allocator can.
Running one step under both at once (:mod:`memfit.allocator`, :mod:`memfit.memory`) and
taking their difference at the peak measures them, and the planner counts it all step.

Example::

    kernel_workspace_bytes(model, lambda: model(x).sum(), PrecisionPolicy("fp32"))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.allocator import allocator_peak
from memfit.checkpoint.compiled import unwrap_compiled
from memfit.checkpoint.profiler.runner import preserved
from memfit.memory import measure
from memfit.precision.policy import PrecisionPolicy

__all__ = ["kernel_workspace_bytes"]


def kernel_workspace_bytes(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    policy: PrecisionPolicy,
    inputs: Any = None,
) -> int:
    """Bytes kernels allocate for themselves at a step's peak, beyond every tensor: one
    forward and backward of ``loss()`` on CPU measured by the allocator and by the
    storage tracker at once (:mod:`memfit.allocator`, :mod:`memfit.memory`); their
    difference at the peak (the allocator's window runs no garbage collection, so only the
    step's own memory shows). A CPU depthwise convolution's backward, for one, allocates
    unfold buffers the size of its input times its kernel. (What a unit's forward kernels
    hold in a rebuild is measured per unit by the probe.) Gradients, buffers and the random
    state are as before; on other devices 0.

    Example::

        kernel_workspace_bytes(model, lambda: model(x).sum(), PrecisionPolicy("fp32"))
    """
    model = unwrap_compiled(model)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type != "cpu":
        # On CUDA the caching allocator counts every tensor on the device, the tracker
        # only the model's: their difference is not the kernels'. The Engine's closed loop
        # measures the allocator there and corrects the plan instead.
        return 0

    def step() -> None:
        with policy.autocast(device.type):
            value = loss()
        value.backward()

    with preserved(model, train=None, rng_devices=[]):
        peak = allocator_peak(
            lambda: measure(step, model=model),
            live=[*params, *model.buffers(), inputs],
            device=device,
        )
    return max(0, int(peak.peak_bytes - peak.result.tracked_peak_bytes))
