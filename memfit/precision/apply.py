"""Apply a precision policy to a model in place: fp32 islands and low-precision weights.

An island's ``forward`` is replaced on the instance (not the class) by one that casts its
floating-point inputs to fp32 and turns autocast off inside, so its statistics are computed
in fp32 whatever surrounds it. Its floating-point outputs go back to the dtype of the input
that came in (a bf16 activation in, a bf16 activation out), so an island is invisible to
the layers around it, under autocast or not. Removing restores the original ``forward``.

In the ``*-master`` modes and ``bf16-sr`` the model's own weights are 16-bit. A plain call
(no autocast active, e.g. ``model.eval(); model(images)`` after training) would feed fp32 inputs to
16-bit layers; a hook on the model casts its floating-point inputs to the weights' dtype
and its floating-point outputs back to the dtype that came in (as Lightning's
``bf16-true`` converts inputs and outputs). Under autocast (training, ``eval_context``)
the hook does nothing, so training is unchanged by it.

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

from memfit.nested import map_tensors, tensors
from memfit.precision.kernels import kernel_device, warn_missing
from memfit.precision.policy import PrecisionPolicy

_ORIGINAL = "_memfit_island_forward"
_INPUT_CAST = "_memfit_input_cast"


def is_island(module: nn.Module) -> bool:
    """Whether :func:`apply_precision` made ``module`` an fp32 island (its forward runs in
    fp32 without autocast).

    Example::

        is_island(model.rnn)   # True for an LSTM under bf16 on a CPU without its kernel
    """
    return _ORIGINAL in module.__dict__


def _to_fp32(value: Any) -> Any:
    return map_tensors(value, lambda t: t.float() if t.is_floating_point() else t)


def _cast(value: Any, source: torch.dtype, target: torch.dtype) -> Any:
    """``value`` with each tensor of dtype ``source`` cast to ``target``."""
    return map_tensors(value, lambda t: t.to(target) if t.dtype == source else t)


def _floating_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of the first floating-point tensor among the arguments, if any."""
    for t in tensors((args, kwargs)):
        if t.is_floating_point():
            return t.dtype
    return None


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _island_forward(original: Any, *args: Any, **kwargs: Any) -> Any:
    came_in = _floating_dtype(args, kwargs)
    with torch.autocast(_device_type(args, kwargs), enabled=False):
        out = original(*_to_fp32(args), **_to_fp32(kwargs))
    if came_in is None or came_in == torch.float32:
        return out
    return _cast(out, torch.float32, came_in)


class _InputCast:
    """The hooks of a ``*-master`` model's plain calls: floating inputs to the weights'
    dtype, floating outputs back to the dtype that came in. Nothing under autocast."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._came_in: list[torch.dtype | None] = []  # one per call in flight
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, always_call=True),
        ]

    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        came_in = _floating_dtype(args, kwargs)
        if came_in == self.dtype or torch.is_autocast_enabled(_device_type(args, kwargs)):
            came_in = None
        self._came_in.append(came_in)
        if came_in is None:
            return None

        def to_weights(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.dtype) if t.is_floating_point() else t

        return map_tensors(args, to_weights), map_tensors(kwargs, to_weights)

    def _after(self, module: nn.Module, args: Any, output: Any) -> Any:
        came_in = self._came_in.pop() if self._came_in else None
        if came_in is None:
            return None
        return _cast(output, self.dtype, came_in)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def kernel_islands(model: nn.Module, policy: PrecisionPolicy) -> list[str]:
    """The modules of ``model`` that :func:`apply_precision` makes fp32 islands because
    their kind has no kernel in the policy's dtype on the model's device
    (:mod:`memfit.precision.kernels`), beyond the policy's own islands.

    Example::

        kernel_islands(lstm_model, PrecisionPolicy("bf16-mixed"))   # ["rnn"] on AVX2 only
    """
    return [
        name
        for name, module in model.named_modules()
        if policy.is_island(module) and not policy.is_declared_island(module)
    ]


def note_kernel_islands(model: nn.Module, policy: PrecisionPolicy) -> tuple[str, ...]:
    """:func:`kernel_islands`, with a warning (once per process) naming them and why.

    Example::

        engine.settings.kernel_islands = note_kernel_islands(model, policy)
    """
    names = tuple(kernel_islands(model, policy))
    warn_missing(names, kernel_device(model), policy.compute_dtype, policy.mode)
    return names


def apply_precision(model: nn.Module, policy: PrecisionPolicy) -> list[str]:
    """Make the policy's fp32 islands run in fp32; return their qualified names.

    Layer kinds with no kernel in the policy's dtype on the model's device (an LSTM in
    bf16 on a CPU without AVX-512: :mod:`memfit.precision.kernels`) are islands too, so
    the model trains instead of failing inside torch (:func:`kernel_islands` names them).

    In the ``*-master`` modes and ``bf16-sr``, parameters outside the islands are cast to
    the compute dtype (:class:`~memfit.precision.master.MasterWeights` does this with an
    optimizer; calling it alone is for planning and inference), and the model's plain calls (no autocast) cast
    floating inputs to that dtype and floating outputs back (see the module docstring).
    Idempotent.
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
    if policy.low_precision_weights:
        island_params = {id(p) for n in islands for p in model.get_submodule(n).parameters()}
        with torch.no_grad():
            for param in model.parameters():
                if id(param) not in island_params and param.is_floating_point():
                    if param.dtype != policy.compute_dtype:
                        param.data = param.data.to(policy.compute_dtype)
        if _INPUT_CAST not in model.__dict__:
            model.__dict__[_INPUT_CAST] = _InputCast(model, policy.compute_dtype)
    return islands


def remove_precision(model: nn.Module) -> None:
    """Restore the islands' original forwards and remove the plain-call input cast
    (weights keep their current dtype)."""
    _remove_input_cast(model)
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            module.__dict__.pop("forward", None)


def _remove_input_cast(model: nn.Module) -> None:
    cast = model.__dict__.pop(_INPUT_CAST, None)
    if cast is not None:
        cast.remove()


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
    had_input_cast = _INPUT_CAST in model.__dict__
    originals = [(p, p.data) for p in model.parameters()]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items()]
    islands = apply_precision(model, policy)
    try:
        yield islands
    finally:
        if not had_input_cast:
            _remove_input_cast(model)
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
