"""Apply a precision policy to a model in place: fp32 islands and low-precision weights.

An island's ``forward`` is replaced on the instance (not the class) by one that casts its
floating-point inputs to fp32 and turns autocast off inside, so its statistics are computed
in fp32 whatever surrounds it. Removing restores the original ``forward``.

Example::

    policy = memfit.PrecisionPolicy("bf16-mixed")
    apply_precision(model, policy)       # LayerNorms now run in fp32
    remove_precision(model)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from memfit.precision.policy import PrecisionPolicy

_ORIGINAL = "_memfit_island_forward"


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _island_forward(original: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(_device_type(args, kwargs), enabled=False):
        return original(*_to_fp32(args), **_to_fp32(kwargs))


def apply_precision(model: nn.Module, policy: PrecisionPolicy) -> list[str]:
    """Make the policy's fp32 islands run in fp32; return their qualified names.

    In the ``*-master`` modes, parameters outside the islands are cast to the compute dtype
    (:class:`~memfit.precision.master.MasterWeights` does this with an optimizer; calling it
    alone is for planning and inference). Idempotent.
    """
    islands: list[str] = []
    if not policy.mixed:
        return islands
    for name, module in model.named_modules():
        if policy.is_island(module):
            islands.append(name)
            if _ORIGINAL not in module.__dict__:
                original = module.forward
                setattr(module, _ORIGINAL, original)
                module.forward = functools.partial(_island_forward, original)
            module.float()
    if policy.master_weights:
        island_params = {id(p) for n in islands for p in model.get_submodule(n).parameters()}
        with torch.no_grad():
            for param in model.parameters():
                if id(param) not in island_params and param.is_floating_point():
                    if param.dtype != policy.compute_dtype:
                        param.data = param.data.to(policy.compute_dtype)
    return islands


def remove_precision(model: nn.Module) -> None:
    """Restore the islands' original forwards (weights keep their current dtype)."""
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            module.__dict__.pop("forward", None)
