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

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit.nested import map_tensors
from memfit.precision.policy import PrecisionPolicy

_ORIGINAL = "_memfit_island_forward"


def _to_fp32(value: Any) -> Any:
    return map_tensors(value, lambda t: t.float() if t.is_floating_point() else t)


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


@contextlib.contextmanager
def precision_applied(model: nn.Module, policy: PrecisionPolicy) -> Iterator[list[str]]:
    """``model`` as training under ``policy`` will run it, inside a ``with`` block: the
    fp32 islands, and in the ``*-master`` modes the low-precision weights. Afterwards it is
    exactly as it was: islands this block added are removed and the weights it cast get
    their original tensors back (no rounding). Planning uses it, so a model planned before
    an Engine has touched it is measured as it will train.

    Example::

        with precision_applied(model, PrecisionPolicy("bf16-mixed")):
            prof = profile(model, x, precision="bf16-mixed")
    """
    had_islands = {id(m) for m in model.modules() if _ORIGINAL in m.__dict__}
    originals = [(p, p.data) for p in model.parameters()]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()]
    islands = apply_precision(model, policy)
    try:
        yield islands
    finally:
        for module in model.modules():
            if id(module) not in had_islands and _ORIGINAL in module.__dict__:
                module.__dict__.pop(_ORIGINAL)
                module.__dict__.pop("forward", None)
        for param, data in originals:
            if param.data is not data:
                param.data = data
        for module, name, buffer in buffers:  # islands' .float() replaced them
            if module._buffers.get(name) is not buffer:
                module._buffers[name] = buffer
