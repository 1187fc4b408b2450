"""The optimizer's bytes in a training step: its state (:func:`optimizer_state_bytes`,
measured once it exists, else predicted by type) and what its step allocates for itself
(:func:`optimizer_temp_bytes`).

:mod:`memfit.checkpoint.step_memory` counts both into the step; the Engine reads the
state's storages as allocated.
"""

from __future__ import annotations

import logging

import torch

from memfit.fake import optimizer_step_temp_bytes
from memfit.nested import tensors
from memfit.precision.optimizer_state import predicted_state_bytes as predicted_low_bit_state_bytes
from memfit.precision.optimizer_state import step_temp_bytes as low_bit_step_temp_bytes

__all__ = ["optimizer_state_bytes", "optimizer_temp_bytes"]

log = logging.getLogger(__name__)

#: Optimizer state per parameter element, in fp32 elements, when it has no state yet.
_STATE_ELEMENTS = {
    torch.optim.Adam: 2,
    torch.optim.AdamW: 2,
    torch.optim.Adamax: 2,
    torch.optim.NAdam: 2,
    torch.optim.RAdam: 2,
    torch.optim.Adagrad: 1,
    torch.optim.RMSprop: 1,
    torch.optim.Adadelta: 2,
}
#: Scalar tensors of state per parameter (the step count; NAdam's running momentum product).
_STATE_SCALARS = {cls: 2 if cls is torch.optim.NAdam else 1 for cls in _STATE_ELEMENTS}


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer | None, *, predict: bool = True, storages: bool = False
) -> int:
    """Bytes of the optimizer's state: every tensor in it (the step counts too), each once.

    ``predict``: an optimizer with no state yet (before its first step) gets the state it
    will make, by type (Adam/AdamW two fp32 buffers per parameter element and a step count
    per parameter, SGD with momentum and Adagrad one buffer; 8-bit or bf16 state for an
    optimizer :func:`~memfit.precision.optimizer_state.low_bit_state` converted); False counts what is there
    now, 0. ``storages``: count each tensor's whole storage, once per storage (what the
    allocator holds: a view holds all of its base) instead of the tensor's own elements.

    Example::

        optimizer_state_bytes(torch.optim.AdamW(model.parameters()))  # before a step: predicted
        optimizer_state_bytes(opt, predict=False, storages=True)      # what is allocated now
    """
    if optimizer is None:
        return 0
    if not optimizer.state:
        if not predict:
            return 0
        low_bit = predicted_low_bit_state_bytes(optimizer)  # 8-bit or bf16 moments
        return _predicted_state_bytes(optimizer) if low_bit is None else low_bit
    seen: dict[int, int] = {}
    for value in tensors(list(optimizer.state.values())):
        if storages:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        else:
            seen.setdefault(value.data_ptr(), value.numel() * value.element_size())
    return sum(seen.values())


def _predicted_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The state ``optimizer`` will make on its first step, by its type."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    elements = sum(p.numel() for p in params)
    per = _STATE_ELEMENTS.get(type(optimizer), 0)
    if isinstance(optimizer, torch.optim.SGD):
        per = 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        per += 1
    # The scalars are float32 unless the default dtype is float64, as torch.optim makes them.
    scalar = 8 if torch.get_default_dtype() == torch.float64 else 4
    return per * elements * 4 + _STATE_SCALARS.get(type(optimizer), 0) * len(params) * scalar


def optimizer_temp_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """What ``optimizer.step()`` allocates for itself beyond its state (a ``foreach``
    optimizer's temporaries, about one parameter-sized tensor per group for AdamW): a
    low-bit optimizer's by count, any other's measured on a shadow optimizer over fake
    tensors; 0, with a warning, for an optimizer fake tensors cannot run.

    Example::

        optimizer_temp_bytes(torch.optim.AdamW(model.parameters(), foreach=True))
    """
    if optimizer is None:
        return 0
    low_bit = low_bit_step_temp_bytes(optimizer)  # its own step, one parameter at a time
    if low_bit is not None:
        return low_bit
    try:
        return optimizer_step_temp_bytes(optimizer)
    except Exception as exc:  # an optimizer fake tensors cannot run: plan without the term
        log.warning(
            "could not measure the temporaries of %s.step() on fake tensors (%s: %s); the "
            "plan leaves them out, so keep some margin in the budget",
            type(optimizer).__name__,
            type(exc).__name__,
            exc,
        )
        return 0
