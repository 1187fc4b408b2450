"""Does each unit do the same when its forward runs again? The recompute-safety probe.

Checkpointing runs a unit's forward a second time in backward and needs it to do exactly
what it did the first time. State kept between calls breaks that: a key/value cache (a
Hugging Face decoder called with ``use_cache=True`` appends every layer's keys to a cache
object it passes down), a counter, a list a forward appends to. The rerun then runs other
ops on other shapes, and torch either fails in backward ("A different number of tensors
was saved during the original forward and recomputation", or selective checkpoint's "...
not found in storage") or, worse, rebuilds something else without a word.

The probe runs the forward once without autograd, recording each unit call's inputs and
the ops it ran (aten op, output shapes and dtypes), then runs each call again on its own
inputs, under the same autocast state and random state, and compares. A unit whose rerun
differs, or fails, is returned with the first difference, so the planner can leave it out
with a reason instead of crashing in backward. Buffers and the random state are restored
afterwards: the probe leaves the model as it found it.

Example::

    unstable = unstable_units(model, lambda: model(**batch), ["model.layers.0", ...])
    # {"model.layers.0": "its forward does other work when run again (...)"}
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.allocator import allocator_peak
from memfit.nested import map_tensors, tensors

OpRecord = tuple[str, tuple[tuple[tuple[int, ...], str], ...]]
"""One op: its name and the (shape, dtype) of each tensor it returned."""


class _OpLog(TorchDispatchMode):
    """Appends every aten op run under it, with its outputs' shapes and dtypes."""

    def __init__(self, ops: list[OpRecord]) -> None:
        super().__init__()
        self.ops = ops
        self.paused = False  # while the probe's own hooks copy a unit's inputs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in tensors(out))
        self.ops.append((str(func), shapes))
        return out


@dataclass
class _Call:
    """One call of a unit in the recorded forward."""

    name: str
    module: nn.Module
    args: Any
    kwargs: dict[str, Any]
    autocast: tuple[str, bool, torch.dtype]
    rng: torch.Tensor
    start: int
    end: int = -1


@dataclass
class _Recording:
    ops: list[OpRecord] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    open: list[_Call] = field(default_factory=list)
    active: bool = True


def _device_type(module: nn.Module, args: Any, kwargs: Any) -> str:
    for t in (*tensors((args, kwargs)), *module.parameters()):
        return t.device.type
    return "cpu"


def _autocast(device: str, dtype: torch.dtype, enabled: bool) -> Any:
    # No weight-cast cache: a cast cached by the first run would be missing from the rerun.
    return torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False)


def _cache_hint(kwargs: dict[str, Any], args: Any) -> str:
    """A remedy when the state is a Hugging Face cache object passed to the unit."""
    for value in (*kwargs.values(), *(args if isinstance(args, tuple) else ())):
        if "Cache" in type(value).__name__:
            return (
                f"; it is given a {type(value).__name__} (a key/value cache): call the model "
                "with use_cache=False while training, as Hugging Face's own gradient "
                "checkpointing does"
            )
    return ""


def _difference(first: list[OpRecord], again: list[OpRecord]) -> str:
    for i, (a, b) in enumerate(zip(first, again)):
        if a != b:
            return f"op {i} was {a[0]} {list(a[1])}, then {b[0]} {list(b[1])}"
    return f"it ran {len(first)} ops, then {len(again)}"


@contextlib.contextmanager
def _restored_buffers(model: nn.Module) -> Iterator[None]:
    """Inside the block, buffers may change; afterwards they hold their values again."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                if buffer.shape == value.shape:
                    buffer.copy_(value)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found, per unit."""

    unstable: dict[str, str]
    """Units whose forward does other work when run again, each with the reason."""
    forward_workspace: dict[str, int]
    """For the others (on CPU): the most one op of the unit's forward, run again with
    autograd on as a rebuild runs it, held inside itself beyond every tensor (a kernel's
    own workspace, :attr:`memfit.allocator.AllocatorPeak.op_workspace_bytes`)."""


def unstable_units(
    model: nn.Module,
    run_forward: Callable[[], Any],
    names: Sequence[str],
    autocast: tuple[str, torch.dtype, bool] = ("cpu", torch.bfloat16, False),
) -> dict[str, str]:
    """The units of :func:`probe_units` whose forward does other work when run again."""
    return probe_units(model, run_forward, names, autocast).unstable


def probe_units(
    model: nn.Module,
    run_forward: Callable[[], Any],
    names: Sequence[str],
    autocast: tuple[str, torch.dtype, bool] = ("cpu", torch.bfloat16, False),
    workspace: bool = False,
) -> ProbeResult:
    """Units among ``names`` (qualified names in ``model``, not ``""``) whose forward does
    not do the same when run again on the same inputs, each with the reason.

    ``run_forward()`` runs the model's forward as training does; ``autocast`` is the
    training precision's ``(device type, dtype, enabled)``, run without autocast's weight
    cache so that every run casts for itself.

    Example::

        bad = unstable_units(model, lambda: model(x), ["blocks.0", "blocks.1"],
                             autocast=("cpu", torch.bfloat16, True))
    """
    modules = {n: model.get_submodule(n) for n in names if n}
    if not modules or any(p.device.type == "meta" for p in model.parameters()):
        return ProbeResult({}, {})
    rec = _Recording()
    log = _OpLog(rec.ops)

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if not rec.active:
                return
            device = _device_type(module, args, kwargs)
            # The copy's own ops belong to no unit: a parent's rerun makes no copies.
            log.paused = True
            try:
                copy = map_tensors((args, kwargs), lambda t: t.detach().clone())
            finally:
                log.paused = False
            call = _Call(
                name=name,
                module=module,
                args=copy[0],
                kwargs=copy[1],
                autocast=(
                    device,
                    torch.is_autocast_enabled(device),
                    torch.get_autocast_dtype(device),
                ),
                rng=torch.get_rng_state(),
                start=len(rec.ops),
            )
            rec.calls.append(call)
            rec.open.append(call)

        return hook

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if rec.active and rec.open:
            rec.open.pop().end = len(rec.ops)

    handles = []
    for name, module in modules.items():
        # First of its pre-hooks: others' ops (weight_norm's) belong to no rerun of forward.
        handles.append(
            module.register_forward_pre_hook(before(name), with_kwargs=True, prepend=True)
        )
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    reasons: dict[str, str] = {}
    workspaces: dict[str, int] = {}
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=cuda), _restored_buffers(model), torch.no_grad():
            with _autocast(*autocast), log:
                run_forward()
            rec.active = False
            for call in rec.calls:
                if call.name in reasons or call.end < 0:
                    continue
                again: list[OpRecord] = []
                torch.set_rng_state(call.rng)
                device, enabled, dtype = call.autocast
                try:
                    with _autocast(device, dtype, enabled), _OpLog(again):
                        call.module(*call.args, **call.kwargs)
                except Exception as exc:  # a rerun that fails is as unsafe as one that differs
                    reasons[call.name] = (
                        f"its forward fails when run again ({type(exc).__name__}: {exc})"
                        f"{_cache_hint(call.kwargs, call.args)}"
                    )
                    continue
                first = rec.ops[call.start : call.end]
                if again != first:
                    reasons[call.name] = (
                        "its forward does other work when run again on the same inputs "
                        f"({_difference(first, again)}): it keeps state between calls, so a "
                        f"recompute would not rebuild what forward saved{_cache_hint(call.kwargs, call.args)}"
                    )
            if workspace:  # buffers and the random state are restored after these too
                workspaces = _forward_workspaces(model, rec.calls, reasons)
    finally:
        for handle in handles:
            handle.remove()
    return ProbeResult(reasons, workspaces)


def _rerun_with_grad(
    module: nn.Module, args: Any, kwargs: Any, dtype: torch.dtype, enabled: bool
) -> None:
    with torch.enable_grad(), _autocast("cpu", dtype, enabled):  # as a rebuild runs it
        module(*args, **kwargs)


def _forward_workspaces(
    model: nn.Module, calls: list[_Call], unstable: dict[str, str]
) -> dict[str, int]:
    """Each stable CPU unit's forward run again with autograd on, under the allocator."""

    out: dict[str, int] = {}
    params = list(model.parameters())
    grads = [p.grad for p in params]  # kept as they were, whatever a rerun does
    try:
        _workspaces_of(calls, unstable, out)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return out


def _workspaces_of(calls: list[_Call], unstable: dict[str, str], out: dict[str, int]) -> None:
    for call in calls:
        device = call.autocast[0]
        if call.name in unstable or call.end < 0 or device != "cpu":
            continue
        torch.set_rng_state(call.rng)
        _, enabled, dtype = call.autocast
        args, kwargs = map_tensors(
            (call.args, call.kwargs),
            lambda t: t.requires_grad_(True) if t.is_floating_point() else t,
        )

        try:
            rerun = functools.partial(_rerun_with_grad, call.module, args, kwargs, dtype, enabled)
            peak = allocator_peak(rerun, device="cpu")
        except Exception:  # the stability pass ran it; a failure here only loses the term
            continue
        out[call.name] = max(out.get(call.name, 0), peak.op_workspace_bytes)
