"""Does each unit do the same when its forward runs again? The recompute-safety probe.

Checkpointing runs a unit's forward a second time in backward and needs it to do exactly
what it did the first time. State kept between calls breaks that: a key/value cache (a
Hugging Face decoder called with ``use_cache=True`` appends every layer's keys to a cache
object it passes down), a counter, a list a forward appends to. The rerun then runs other
ops on other shapes, and torch either fails in backward ("A different number of tensors
was saved during the original forward and recomputation", or selective checkpoint's "...
not found in storage") or, worse, rebuilds something else without a word.

The probe runs the forward once without autograd, recording each unit call's inputs, its
outputs and the ops it ran (aten op, output shapes and dtypes, and which tensors each op
read and made), then runs each call again on its own inputs, under the same autocast state
and random state, and compares two things:

* the ops on the unit's data: those that read the call's input tensors, the model's
  parameters or buffers, or anything made from them. Ops on constants alone are not
  compared: ``torch.tensor(...)`` (``aten.lift_fresh``), a Python scalar cast to a tensor,
  a mask built from shapes, a view of any of these. A rerun may build them again or find
  them cached from the first run (a lazily built causal mask), and neither changes what a
  rebuild computes from the data; where a constant does change it (a cache's length, a
  counter's value), an op on the data runs on another shape, or an output differs;
* the unit's outputs: the same tensors, shapes and dtypes, and the same values (bitwise
  on CPU; up to rounding elsewhere, where kernels may add in any order).

A unit whose rerun differs, or fails, is returned with the first difference, so the
planner can leave it out with a reason instead of crashing in backward. Buffers and the
random state are restored afterwards: the probe leaves the model as it found it.

Example::

    unstable = unstable_units(model, lambda: model(**batch), ["model.layers.0", ...])
    # {"model.layers.0": "its forward does other work when run again (...)"}
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.allocator import allocator_peak, storage_sizes
from memfit.nested import map_tensors, tensors

OpRecord = tuple[str, tuple[tuple[tuple[int, ...], str], ...]]
"""One op: its name and the (shape, dtype) of each tensor it returned."""


@dataclass(frozen=True)
class _Op:
    """One op run, with the tensors it read and made (as :class:`_Tokens` numbers)."""

    record: OpRecord
    reads: tuple[int, ...]
    made: tuple[int, ...]


class _Tokens:
    """A number per tensor object, the same for as long as the object lives.

    ``id()`` alone is reused once an object dies; a weak reference tells a live tensor
    from a new one at a dead one's address, without keeping any tensor alive, and drops
    the entry when its tensor dies (a forward makes many).
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._next = 0

    def __call__(self, t: torch.Tensor) -> int:
        key = id(t)
        entry = self._known.get(key)
        if entry is not None and entry[0]() is t:
            return entry[1]
        self._next += 1
        self._known[key] = (weakref.ref(t, functools.partial(self._forget, key)), self._next)
        return self._next

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        entry = self._known.get(key)
        if entry is not None and entry[0] is ref:  # not a newer tensor's at the same id
            del self._known[key]

    def of(self, obj: Any) -> set[int]:
        """The numbers of every tensor in ``obj`` (nested containers walked)."""
        return {self(t) for t in tensors(obj)}


class _OpLog(TorchDispatchMode):
    """Appends every aten op run under it: outputs' shapes and dtypes, tensors read and made."""

    def __init__(self, ops: list[_Op], tokens: _Tokens) -> None:
        super().__init__()
        self.ops = ops
        self.tokens = tokens
        self.paused = False  # while the probe's own hooks copy a unit's inputs and outputs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        made = tensors(out)
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in made)
        self.ops.append(
            _Op(
                record=(str(func), shapes),
                reads=tuple(self.tokens(t) for t in tensors((args, kwargs))),
                made=tuple(self.tokens(t) for t in made),
            )
        )
        return out


def _on_data(ops: Iterable[_Op], data: set[int]) -> list[OpRecord]:
    """The ops that read ``data`` (a unit's inputs and the model's weights) or anything an
    op made from it, in the order they ran: the work a rebuild must repeat exactly.

    An op that read constants alone (a tensor made from Python values, a factory such as
    ``torch.ones``, a tensor no op on the data made, or a view of one) is left out. An op
    that writes the data into a constant in place (``cache.copy_(keys)``) makes it data.
    """
    data = set(data)
    out: list[OpRecord] = []
    for op in ops:
        if any(t in data for t in op.reads):
            data.update(op.made)
            out.append(op.record)
    return out


@dataclass(frozen=True)
class _RngState:
    """The CPU generator's state and that of each CUDA device the model is on: a rerun
    draws what its call drew (dropout on the GPU draws from the device's generator)."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]

    @staticmethod
    def now(cuda: Sequence[int]) -> _RngState:
        return _RngState(
            torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in cuda)
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)


def _cuda_devices(model: nn.Module) -> list[int]:
    """The CUDA devices the model's parameters are on, and the current one."""
    devices = {p.device.index for p in model.parameters() if p.device.type == "cuda"}
    if torch.cuda.is_available():
        devices.add(torch.cuda.current_device())
    return sorted(d for d in devices if d is not None)


@dataclass
class _Call:
    """One call of a unit in the recorded forward."""

    name: str
    module: nn.Module
    args: Any
    kwargs: dict[str, Any]
    autocast: tuple[str, bool, torch.dtype]
    rng: _RngState
    data: set[int]
    """The numbers (:class:`_Tokens`) of its input tensors in the recorded forward."""
    start: int
    end: int = -1
    outputs: list[torch.Tensor] = field(default_factory=list)
    """Copies of the tensors it returned, as they were when it returned them."""


@dataclass
class _Recording:
    ops: list[_Op] = field(default_factory=list)
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
            return (
                f"op {i} on its inputs and weights was {a[0]} {list(a[1])}, "
                f"then {b[0]} {list(b[1])}"
            )
    return f"it ran {len(first)} ops on its inputs and weights, then {len(again)}"


def _same_values(first: torch.Tensor, again: torch.Tensor) -> bool:
    """Bitwise equal on CPU (NaN where NaN was); elsewhere equal up to rounding in the
    dtype (torch.testing's tolerances): a GPU kernel may add in another order each run."""
    try:
        if first.device.type == "cpu":
            if torch.equal(first, again):
                return True
            nan = first.isnan() & again.isnan() if first.is_floating_point() else None
            return nan is not None and bool(((first == again) | nan).all())
        torch.testing.assert_close(again, first, equal_nan=True)
    except AssertionError:
        return False
    except (RuntimeError, TypeError):  # a layout neither compares (sparse): the ops decide
        return True
    return True


def _output_difference(first: list[torch.Tensor], again: list[torch.Tensor]) -> str | None:
    """How the rerun's outputs differ from the first run's, or None where they do not."""
    if len(first) != len(again):
        return f"it returned {len(first)} tensors, then {len(again)}"
    for i, (a, b) in enumerate(zip(first, again)):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            return f"output {i} was {tuple(a.shape)} {a.dtype}, then {tuple(b.shape)} {b.dtype}"
        if not _same_values(a, b):
            return f"output {i} ({tuple(a.shape)} {a.dtype}) has other values"
    return None


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
    backward_workspace: dict[str, int] = field(default_factory=dict)
    """For the same units: how far what the ops of that rerun's backward held inside
    themselves beyond every tensor raised its peak (a convolution's unfolded input, an
    attention kernel's fp32 accumulators; what a rebuild's backward may hold that no
    dispatch-level count sees; :attr:`memfit.allocator.AllocatorPeak.peak_op_workspace_bytes`)."""
    rebuild_forward: dict[str, int] = field(default_factory=dict)
    """For the same units: the most that rerun's forward held, up to its last op that saves
    a tensor for backward (where a rebuild that stops early stops), above all the tensors
    it allocated and saved: the outputs of its ops that nothing saves but a later op reads
    (a layer's output beside its LayerNorm's saved input, a dropout's output until the
    residual add), and the kernels' scratch at that moment."""


def unstable_units(
    model: nn.Module,
    run_forward: Callable[[], Any],
    names: Sequence[str],
    autocast: tuple[str, torch.dtype, bool] = ("cpu", torch.bfloat16, False),
) -> dict[str, str]:
    """The units of :func:`probe_units` whose forward does other work when run again.

    Example::

        unstable_units(model, lambda: model(input_ids=ids), ["transformer.h.0"])
        # {} with use_cache=False; with a cache: {"transformer.h.0": "... (op 11 on its
        # inputs and weights was aten.cat.default [((4, 2, 64, 16), ...)], then
        # aten.cat.default [((4, 2, 128, 16), ...)]) ...; it is given a DynamicCache ..."}
    """
    return probe_units(model, run_forward, names, autocast).unstable


def probe_units(
    model: nn.Module,
    run_forward: Callable[[], Any],
    names: Sequence[str],
    autocast: tuple[str, torch.dtype, bool] = ("cpu", torch.bfloat16, False),
    workspace: bool = False,
) -> ProbeResult:
    """Units among ``names`` (qualified names in ``model``, not ``""``) whose forward does
    not do the same when run again on the same inputs, each with the reason: other ops on
    its data (its input tensors, the model's weights and buffers, what ops make of them),
    other shapes or dtypes there, or other outputs. Ops on constants alone are not
    compared (a rerun may rebuild a mask, or find it cached, and compute the same).

    ``run_forward()`` runs the model's forward as training does; ``autocast`` is the
    training precision's ``(device type, dtype, enabled)``, run without autocast's weight
    cache so that every run casts for itself.

    Example::

        bad = unstable_units(model, lambda: model(x), ["blocks.0", "blocks.1"],
                             autocast=("cpu", torch.bfloat16, True))
    """
    modules = {n: model.get_submodule(n) for n in names if n}
    if not modules or any(p.device.type == "meta" for p in model.parameters()):
        return ProbeResult({}, {}, {})
    rec = _Recording()
    tokens = _Tokens()
    rebuilds: dict[str, int] = {}
    log = _OpLog(rec.ops, tokens)
    cuda = _cuda_devices(model)
    handles = _record_calls(modules, rec, log, cuda)
    reasons: dict[str, str] = {}
    workspaces: dict[str, int] = {}
    backward_workspaces: dict[str, int] = {}
    try:
        with torch.random.fork_rng(devices=cuda), _restored_buffers(model), torch.no_grad():
            weights = tokens.of([*model.parameters(), *model.buffers()])
            with _autocast(*autocast), log:
                run_forward()
            rec.active = False
            for call in rec.calls:
                if call.name in reasons or call.end < 0:
                    continue
                why = _rerun_difference(call, rec.ops[call.start : call.end], tokens, weights)
                if why is not None:
                    reasons[call.name] = why
            if workspace:  # buffers and the random state are restored after these too
                workspaces, backward_workspaces, rebuilds = _workspaces(model, rec.calls, reasons)
    finally:
        for handle in handles:
            handle.remove()
    return ProbeResult(reasons, workspaces, backward_workspaces, rebuilds)


def _record_calls(
    modules: dict[str, nn.Module], rec: _Recording, log: _OpLog, cuda: Sequence[int]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that record each call of ``modules`` into ``rec`` while ``rec.active``: copies
    of its inputs, its random state (the CPU's and ``cuda`` devices') and autocast state,
    its span of ``log`` and copies of its outputs."""

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
                rng=_RngState.now(cuda),
                data=log.tokens.of((args, kwargs)),
                start=len(rec.ops),
            )
            rec.calls.append(call)
            rec.open.append(call)

        return hook

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not (rec.active and rec.open):
            return
        call = rec.open.pop()
        call.end = len(rec.ops)
        # Copied now: whoever called the unit may change its output in place later.
        log.paused = True
        try:
            call.outputs = [t.detach().clone() for t in tensors(output)]
        finally:
            log.paused = False

    handles = []
    for name, module in modules.items():
        # First of its pre-hooks: others' ops (weight_norm's) belong to no rerun of forward.
        handles.append(
            module.register_forward_pre_hook(before(name), with_kwargs=True, prepend=True)
        )
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    return handles


def _rerun_difference(
    call: _Call, first: list[_Op], tokens: _Tokens, weights: set[int]
) -> str | None:
    """Why ``call`` run again on its own inputs is not what it was (``first``: the ops it
    ran), or None where it is the same: the same ops on its data, the same outputs."""
    again: list[_Op] = []
    call.rng.restore()
    device, enabled, dtype = call.autocast
    hint = _cache_hint(call.kwargs, call.args)
    data = tokens.of((call.args, call.kwargs)) | weights
    try:
        with _autocast(device, dtype, enabled), _OpLog(again, tokens):
            output = call.module(*call.args, **call.kwargs)
    except Exception as exc:  # a rerun that fails is as unsafe as one that differs
        return f"its forward fails when run again ({type(exc).__name__}: {exc}){hint}"
    work, work_again = _on_data(first, call.data | weights), _on_data(again, data)
    if work != work_again:
        found = _difference(work, work_again)
    else:
        found = _output_difference(call.outputs, tensors(output))
        if found is None:
            return None
    return (
        f"its forward does other work when run again on the same inputs ({found}): it "
        f"keeps state between calls, so a recompute would not rebuild what forward "
        f"saved{hint}"
    )


_SAVED = "memfit::probe_saved"


@dataclass
class _SavedByRerun:
    """The storages a rerun saved for backward that were not alive before it (keyed by
    address, with their sizes), and a profiler mark at each save."""

    before: set[int]
    sizes: dict[int, int] = field(default_factory=dict)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function(_SAVED):
            pass  # the mark's time: the saving op's outputs exist by now
        for address, nbytes in storage_sizes([t]).items():
            if address not in self.before:
                self.sizes[address] = nbytes
        return t


def _rerun_with_grad(
    module: nn.Module,
    args: Any,
    kwargs: Any,
    dtype: torch.dtype,
    enabled: bool,
    saved: _SavedByRerun,
) -> Any:
    with (
        torch.enable_grad(),
        _autocast("cpu", dtype, enabled),  # as a rebuild runs it
        torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpacked),
    ):
        return module(*args, **kwargs)  # returned: what it saves stays alive to the end


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


def _workspaces(
    model: nn.Module, calls: list[_Call], unstable: dict[str, str]
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Each stable CPU unit's forward run again with autograd on, then its backward, under
    the allocator: the forward's and the backward's op workspaces, and what the forward
    held above what it saved up to its last save (``ProbeResult.rebuild_forward``), by
    unit."""

    out: dict[str, int] = {}
    back: dict[str, int] = {}
    rebuilds: dict[str, int] = {}
    params = list(model.parameters())
    grads = [p.grad for p in params]  # kept as they were, whatever a rerun does
    weights = set(storage_sizes([*params, *model.buffers()]))
    try:
        _workspaces_of(calls, unstable, weights, out, back, rebuilds)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return out, back, rebuilds


def _workspaces_of(
    calls: list[_Call],
    unstable: dict[str, str],
    weights: set[int],
    out: dict[str, int],
    back: dict[str, int],
    rebuilds: dict[str, int],
) -> None:
    for call in calls:
        device = call.autocast[0]
        if call.name in unstable or call.end < 0 or device != "cpu":
            continue
        call.rng.restore()
        _, enabled, dtype = call.autocast
        args, kwargs = map_tensors(
            (call.args, call.kwargs),
            lambda t: t.requires_grad_(True) if t.is_floating_point() else t,
        )
        inputs = set(storage_sizes([args, kwargs]))
        saved = _SavedByRerun(weights | inputs)
        try:
            rerun = functools.partial(
                _rerun_with_grad, call.module, args, kwargs, dtype, enabled, saved
            )
            peak = allocator_peak(rerun, device="cpu", timeline=True)
        except Exception:  # the stability pass ran it; a failure here only loses the term
            continue
        marks = peak.timeline.marks.get(_SAVED) if peak.timeline is not None else None
        if marks:
            # A rebuild stops after its last save; what it held by then above all it saved.
            # The mark's time is the save's, so the level at it counts the saving op's
            # outputs, which exist by then.
            held = peak.timeline.highest(0, marks[-1]) - sum(saved.sizes.values())
            rebuilds[call.name] = max(rebuilds.get(call.name, 0), held, 0)
        # A kernel's workspace counts only as far as it rose above what the rebuild keeps
        # at its end: a convolution's scratch early in a unit (large where bf16 is
        # emulated) comes before most of what the unit saves exists, not on top of it.
        above_end = peak.peak_bytes - (peak.end_bytes or 0)
        out[call.name] = max(out.get(call.name, 0), min(peak.op_workspace_bytes, above_end))
        roots = [t for t in tensors(peak.result) if t.requires_grad and t.is_floating_point()]
        del peak  # the rerun's graph and output go with ``roots``, before the next rerun
        try:
            backward = _backward_workspace(roots, (args, kwargs))
        except Exception:  # as above: a failure only loses the term
            continue
        finally:
            del roots
        back[call.name] = max(back.get(call.name, 0), backward)


def _backward_workspace(roots: list[torch.Tensor], inputs: Any) -> int:
    """How far what the ops of the backward from ``roots`` (gradients of ones) held inside
    themselves raised its peak; the gradients it leaves on ``inputs`` are dropped (the
    parameters' are restored by the caller)."""
    if not roots:
        return 0
    seeds = [torch.ones_like(t) for t in roots]
    with torch.enable_grad():
        peak = allocator_peak(lambda: torch.autograd.backward(roots, seeds), device="cpu")
    for t in tensors(inputs):
        t.grad = None
    # What the ops' own scratch added to the backward's peak, not the largest scratch:
    # the rebuild's backward moment is its measured peak, where a matmul's packing buffer
    # is usually not (a CLIP layer's 0.25 MiB, on top, over-predicted its least peak 4%).
    return peak.peak_op_workspace_bytes
