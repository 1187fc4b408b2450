"""What a step that releases each gradient in backward holds for it, tensor by tensor.

A loop that applies each update as its gradient is made and frees the gradient at once
(``Engine(release_gradients=True)``, :mod:`memfit.engine.release`; planned with
``zero_grad="in_backward"``) holds one trained tensor's gradient and the temporaries of
its update at a time. Which tensor depends on where backward is: autograd accumulates a
parameter's gradient as soon as its last contribution is made, so a unit's backward
updates only tensors its own modules use, and the head of backward (the loss and the
layers after the last unit) only tensors the model trains outside every unit. Charging
every moment the largest tensor's update over-predicted a small GPT's released step by
10.6% with 8-bit state: its head of backward was charged an MLP matrix's update (2.25 MiB),
which runs inside a block.

Example::

    charges = released_tensors(model, optimizer, masters=False)
    charges["blocks.0.mlp.fc.weight"].total_bytes
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from memfit.checkpoint.costs import UnitCost
from memfit.fake import one_tensor_step_temp_bytes
from memfit.precision.optimizer_state import step_temp_bytes as low_bit_step_temp_bytes

#: What an update in backward allocates beside the optimizer's temporaries: the release
#: hook's scalars (the gradient's norm, its square, the finiteness flag) and the step's own
#: (its count, its sums), a few small allocations: 36 bytes were missed on a CPU step
#: without them, and CUDA rounds each up to 512 bytes. Eight such, counted whole.
UPDATE_SCALAR_BYTES = 8 * 512


@dataclass(frozen=True)
class ReleasedTensor:
    """One trained tensor's share of a released step: its gradient and its update's
    temporaries, held together while it is updated."""

    grad_bytes: float
    """The gradient as the optimizer sees it (fp32 for a master)."""
    temp_bytes: float
    """What an update of this tensor alone allocates for itself, with the release hook's
    scalars (:data:`UPDATE_SCALAR_BYTES`)."""

    @property
    def total_bytes(self) -> float:
        return self.grad_bytes + self.temp_bytes


def released_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, masters: bool
) -> dict[str, ReleasedTensor]:
    """Each parameter the model trains, by name (a tied tensor once), with its gradient
    and its update's temporaries; empty without an optimizer.

    A converted optimizer's temporaries (8-bit or bf16 state) follow its own rule for a
    tensor of that size; torch's own are measured once, on fake tensors, for the largest
    tensor alone, and scaled by size for the others (an elementwise update allocates in
    proportion to the tensor). ``masters``: the optimizer steps fp32 masters (the
    ``*-master`` modes), whose gradients are fp32 whatever the weight's width.

    Example::

        layer = nn.Linear(4, 4)
        charges = released_tensors(layer, torch.optim.SGD(layer.parameters(), lr=0.1), False)
        charges["weight"].grad_bytes   # 64.0
    """
    if optimizer is None:
        return {}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not trained or not stepped:
        return {}
    largest = max(p.numel() for p in stepped)
    low_bit = low_bit_step_temp_bytes(optimizer) is not None
    largest_temp = 0 if low_bit else one_tensor_step_temp_bytes(optimizer)

    def temp(numel: int) -> float:
        if low_bit:
            step = low_bit_step_temp_bytes(optimizer, numel) or 0
        else:
            step = math.ceil(largest_temp * min(numel, largest) / largest)
        return float(step + UPDATE_SCALAR_BYTES)

    return {
        name: ReleasedTensor(
            float(p.numel() * (4 if masters else p.element_size())), temp(p.numel())
        )
        for name, p in trained
    }


def released_backward_peak(
    unit: UnitCost, released: Mapping[str, float], grads: float, most: float
) -> float:
    """The most a loop that releases each gradient in backward holds while ``unit``'s
    subtree runs backward: the measured peak less the gradients accumulated by then, or a
    moment where it updates a tensor, with that tensor's gradient and update temporaries
    (``released``, by name; ``most``, the most of the unit's own tensors', for a name the
    planned model does not know). Where the moments were not measured: the peak less every
    gradient made by then (``grads``), and ``most`` on top.

    Example::

        released_backward_peak(unit, mem.released_by_param, grads=0.0, most=0.0)
    """
    if not unit.release_levels and not unit.backward_peak_released_bytes:
        return unit.backward_peak_bytes - grads + most
    updates = [level + released.get(n, most) for n, level in unit.release_levels.items()]
    return max([unit.backward_peak_released_bytes, *updates])
