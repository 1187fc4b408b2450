"""Measure the peak memory of a training step, by kind and by dtype.

``measure(fn)`` runs ``fn()`` once and reports the peak of live tensor memory on one device
while it ran, counting tensors that were already alive when it started (parameters,
gradients, optimizer state). The peak is split five ways, as the planner thinks of memory:

- ``params``: the model's parameters and buffers (including low-precision working weights);
- ``grads``: tensors that serve as the ``.grad`` of a parameter (including fp32 master grads);
- ``optimizer``: optimizer state, and fp32 master copies of weights held by the optimizer
  (they exist only for the optimizer, so they are its memory, not the model's);
- ``activations``: tensors autograd saved for backward, and activations recomputed in
  backward by checkpointing (when not one of the above);
- ``temp``: everything else (the batch when nothing saves it, the loss, gradients of
  activations, optimizer temporaries).

How: tensor *storages* are tracked (views share a storage and count once). A dispatch mode
sees every op's inputs and outputs; a weak reference on each storage learns when it dies,
including storages freed by autograd's C++ side; saved-tensor hooks tell which storages
autograd saves; parameter and optimizer hooks tell which are gradients and state. Roles are
settled at the end and the log of allocations and frees is replayed once, so the split at
the peak uses everything learnt. On CUDA the total is the caching allocator's own
``max_memory_allocated``; the tracker splits it, and what the tracker cannot see (library
workspaces, allocator blocks larger than asked for) is counted as ``temp``.

Limits: live bytes are sampled after each op, so scratch memory inside one kernel is not
seen (``torch.distributed._tools.mem_tracker.MemTracker`` samples the same way, and agrees
to the byte on the tests' steps). Regions compiled with ``torch.compile`` allocate outside
the dispatcher and are not seen op by op (on CUDA the allocator total stays exact). A
storage resized outside any op (``untyped_storage().resize_``) is seen at its next op.
Saved-tensor hooks that ``fn`` installs itself (offloading) take precedence over the
tracker's, so what they save counts as ``temp``.

Example::

    report = measure(lambda: train_step(batch), model=model, optimizer=optimizer)
    print(report.summary())
    report.peak_bytes, report.by_kind["activations"], report.by_dtype["torch.bfloat16"]
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import ConfigError
from memfit.nested import tensors
from memfit.units import format_bytes

__all__ = ["KINDS", "MemoryReport", "measure"]

KINDS: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "temp")
"""The kinds ``MemoryReport.by_kind`` always has, in display order."""

# A storage can play several roles (a weight that a matmul saves for backward is also an
# activation); it is counted once, as the role that comes first here.
_PARAMS, _GRADS, _OPTIMIZER, _ACTIVATIONS, _TEMP = range(5)

# The CUDA caching allocator hands out blocks in multiples of 512 bytes; rounding tracked sizes
# the same way makes the tracker agree with ``memory_allocated``.
_CUDA_BLOCK = 512
# The trackers of the measure() calls now running, innermost last (tracked_bytes).
_RUNNING: list[_StorageTracker] = []

_LOW_PRECISION_DTYPES = frozenset(
    str(value)
    for value in vars(torch).values()
    if isinstance(value, torch.dtype) and value.is_floating_point and value.itemsize <= 2
)


@dataclass
class MemoryReport:
    """What ``measure`` found. Byte counts are tensor storage bytes on ``device``.

    Example::

        report = measure(step, model=model, optimizer=opt)
        assert sum(report.by_kind.values()) == report.peak_bytes
    """

    peak_bytes: int
    """Peak of live tensor bytes on the device while ``fn`` ran (pre-existing tensors included)."""
    by_kind: dict[str, int]
    """Bytes of each kind in ``KINDS`` at the moment of the peak; sums to ``peak_bytes``."""
    by_dtype: dict[str, int]
    """Bytes per ``str(dtype)`` at the moment of the peak; sums to ``peak_bytes``. On CUDA an
    ``"untracked"`` entry holds allocator bytes no tracked tensor accounts for."""
    peak_by_kind: dict[str, int]
    """Each kind's own maximum over the run (these maxima may occur at different moments)."""
    device: torch.device
    """The device measured."""
    start_bytes: int
    """Live bytes when ``fn`` started (what ``measure`` counted as already there)."""
    end_bytes: int
    """Live bytes when ``fn`` returned (including what it returned)."""
    tracked_peak_bytes: int
    """The storage tracker's own peak; equals ``peak_bytes`` except on CUDA."""
    method: str
    """``"tracker"`` (storage lifetimes) or ``"cuda-allocator"`` (allocator peak, tracker split)."""
    result: Any = field(default=None, repr=False, compare=False)
    """What ``fn`` returned."""

    @property
    def low_precision_share(self) -> float:
        """Fraction of the peak held in 16-bit (or smaller) floating-point tensors."""
        if self.peak_bytes <= 0:
            return 0.0
        low = sum(n for d, n in self.by_dtype.items() if d in _LOW_PRECISION_DTYPES)
        return low / self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field except ``result``."""
        return {
            "peak_bytes": self.peak_bytes,
            "by_kind": dict(self.by_kind),
            "by_dtype": dict(self.by_dtype),
            "peak_by_kind": dict(self.peak_by_kind),
            "device": str(self.device),
            "start_bytes": self.start_bytes,
            "end_bytes": self.end_bytes,
            "tracked_peak_bytes": self.tracked_peak_bytes,
            "method": self.method,
            "low_precision_share": self.low_precision_share,
        }

    def summary(self) -> str:
        """A short table: the peak, each kind at the peak and at its own maximum, the dtypes."""
        peak = self.peak_bytes
        width = max(len(k) for k in (*KINDS, *self.by_dtype, "total"))

        def share(n: int) -> str:
            return f"{100.0 * n / peak:5.1f}%" if peak > 0 else "    -"

        lines = [
            f"peak memory on {self.device}: {format_bytes(peak)} "
            f"(at start {format_bytes(self.start_bytes)}, at end {format_bytes(self.end_bytes)})",
            f"  {'kind':<{width}}  {'at peak':>12}  {'share':>6}  {'own max':>12}",
        ]
        for kind in KINDS:
            n = self.by_kind[kind]
            lines.append(
                f"  {kind:<{width}}  {format_bytes(n):>12}  {share(n):>6}  "
                f"{format_bytes(self.peak_by_kind.get(kind, 0)):>12}"
            )
        lines.append(f"  {'dtype':<{width}}  {'at peak':>12}  {'share':>6}")
        for dtype, n in sorted(self.by_dtype.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {dtype:<{width}}  {format_bytes(n):>12}  {share(n):>6}")
        lines.append(f"  low-precision share of peak: {100.0 * self.low_precision_share:.1f}%")
        return "\n".join(lines)


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers which tracked storage it stands for."""

    __slots__ = ("key", "serial")


class _StorageTracker:
    """Lifetimes, sizes and roles of every tensor storage on one device.

    Holds no strong reference to any tensor or storage, so it never changes when memory is
    freed. It records an event log (storage serial, change in bytes); roles are decided at the
    end and the log is replayed once, so a storage's role may be learnt after its allocation
    (a gradient is known to be one only when autograd assigns it).
    """

    def __init__(self, device: torch.device, round_to: int = 1) -> None:
        self.device = device
        self.round_to = round_to
        self.active = True
        self.started = False  # before fn starts, whatever is seen was alive at the start
        self._live: dict[int, _StorageRef] = {}  # id(storage object) -> its weak reference
        self._nbytes: dict[int, int] = {}  # serial -> current (rounded) bytes
        self._dtype: dict[int, str] = {}  # serial -> dtype of the first tensor seen on it
        self._rank: dict[int, int] = {}  # serial -> most important role seen (see _PARAMS)
        self._baseline: list[tuple[int, int]] = []  # storages alive before fn: (serial, bytes)
        # One list of tuples, not two arrays: a free callback may run between any two
        # bytecodes of an append elsewhere, and a single append is atomic.
        self._events: list[tuple[int, int]] = []
        # next() on a count is atomic, should autograd threads track storages concurrently.
        self._serials = itertools.count()

    def _size(self, storage: torch.UntypedStorage) -> int:
        n = storage.nbytes()
        if self.round_to > 1 and n > 0:
            n = -(-n // self.round_to) * self.round_to
        return n

    def _storage(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse, nested, or a wrapper subclass without storage of its own
        if storage.device != self.device:
            return None
        return storage

    def see(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage, tracking it first if it is new.

        A storage first seen once ``fn`` runs counts from that moment: usually it was just
        made by an op; else fn met a tensor it did not make (its input batch, a tensor some
        C++ code made without dispatch) and it counts from its first use.
        """
        if not self.active:
            return None
        storage = self._storage(t)
        if storage is None:
            return None
        ref = self._live.get(id(storage))
        if ref is not None:
            serial = ref.serial
            n = self._size(storage)
            old = self._nbytes[serial]
            if n != old:  # resized in place (resize_, out= ops): only the difference is new
                self._nbytes[serial] = n
                self._events.append((serial, n - old))
            return serial
        serial = next(self._serials)
        ref = _StorageRef(storage, self._on_free)
        ref.key = id(storage)
        ref.serial = serial
        n = self._size(storage)
        self._nbytes[serial] = n
        self._dtype[serial] = str(t.dtype)
        self._live[ref.key] = ref
        if not self.started:
            self._baseline.append((serial, n))
        else:
            self._events.append((serial, n))
        return serial

    def _on_free(self, ref: _StorageRef) -> None:
        # Runs while the storage is being deallocated, before its id can be reused.
        if self._live.get(ref.key) is ref:
            del self._live[ref.key]
            self._events.append((ref.serial, -self._nbytes[ref.serial]))

    def mark(self, t: torch.Tensor | None, rank: int) -> None:
        """Record that ``t``'s storage plays role ``rank`` (tracking it if unknown)."""
        if t is None:
            return
        serial = self.see(t)
        if serial is not None:
            self.mark_serial(serial, rank)

    def mark_serial(self, serial: int, rank: int) -> None:
        if rank < self._rank.get(serial, _TEMP):
            self._rank[serial] = rank

    def live_bytes(self) -> int:
        """The bytes of every storage seen and alive now."""
        # A copy of the values first: a free during the sum would change the dict.
        return sum(self._nbytes[ref.serial] for ref in list(self._live.values()))

    def stop(self) -> None:
        # Dropping the weak references also drops their callbacks: nothing is recorded after.
        self.active = False
        self._live.clear()

    def replay(self) -> tuple[int, dict[str, int], dict[str, int], dict[str, int], int, int]:
        """(peak, by_kind at peak, by_dtype at peak, each kind's max, start bytes, end bytes)."""
        kind_of = {s: self._rank.get(s, _TEMP) for s in self._nbytes}
        per_kind = [0] * len(KINDS)
        per_dtype: dict[str, int] = {}
        total = 0
        for serial, n in self._baseline:
            total += n
            per_kind[kind_of[serial]] += n
            dtype = self._dtype[serial]
            per_dtype[dtype] = per_dtype.get(dtype, 0) + n
        start = total
        peak = total
        peak_kind = list(per_kind)
        peak_dtype = dict(per_dtype)
        kind_max = list(per_kind)
        for serial, delta in self._events:
            total += delta
            kind = kind_of[serial]
            per_kind[kind] += delta
            dtype = self._dtype[serial]
            per_dtype[dtype] = per_dtype.get(dtype, 0) + delta
            if delta > 0:
                if per_kind[kind] > kind_max[kind]:
                    kind_max[kind] = per_kind[kind]
                if total > peak:
                    peak = total
                    peak_kind = list(per_kind)
                    peak_dtype = dict(per_dtype)
        return (
            peak,
            dict(zip(KINDS, peak_kind)),
            {d: n for d, n in peak_dtype.items() if n},
            dict(zip(KINDS, kind_max)),
            start,
            total,
        )


def _is_wrapper(cls: type) -> bool:
    if cls is torch.Tensor or cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return False
    # Fake tensors are handled by their mode below this one and carry their own storages.
    from torch._subclasses.fake_tensor import FakeTensor

    return not issubclass(cls, FakeTensor)


class _TrackingMode(TorchDispatchMode):
    """Shows the tracker every tensor an op reads or writes."""

    # Compiled graphs run higher-order ops (the RNG wrappers of recomputed random ops):
    # each is seen as one op, its inputs and outputs, the ops inside it not one by one.
    supports_higher_order_operators = True

    def __init__(self, tracker: _StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile skips a frame first called under a mode that does not say this,
        # and every later call of it too: a measured first step would leave the model
        # uncompiled for good. Compilation then runs without the mode; its result with it.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Let tensor subclasses (DTensor, quantized wrappers) unwrap first: their inner ops on
        # plain tensors then come back here, where the real storages are.
        if any(_is_wrapper(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        tracker = self.tracker
        # Inputs first: an output that shares an input's storage (a view, an in-place op) is
        # then known and not mistaken for an allocation.
        for t in tensors((args, kwargs)):
            tracker.see(t)
        out = func(*args, **kwargs)
        # Inside backward, ops run with grad mode on only to rebuild activations (checkpoint
        # recomputation, or create_graph): what they make is activation memory, not temp.
        rank = (
            _ACTIVATIONS
            if torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()
            else _TEMP
        )
        for t in tensors(out):
            serial = tracker.see(t)
            if rank != _TEMP and serial is not None:
                tracker.mark_serial(serial, rank)
        return out


def _resolve_device(
    device: torch.device | str | None,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
) -> torch.device:
    if device is None:
        tensors: Iterable[torch.Tensor] = ()
        if model is not None:
            tensors = model.parameters()
        elif optimizer is not None:
            tensors = (p for g in optimizer.param_groups for p in g["params"])
        first = next(iter(tensors), None)
        if first is not None:
            device = first.device
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"cannot measure on {device}: CUDA is not available; pass device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Roles:
    """Finds the tensors alive at the start and learns the roles of those fn makes."""

    def __init__(
        self,
        tracker: _StorageTracker,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        scan_live: bool,
    ) -> None:
        self.tracker = tracker
        self.model_param_ids = None if model is None else {id(p) for p in model.parameters()}
        # Weak references to modules and optimizers only, never to tensors: holding a tensor
        # would keep its memory alive if fn drops it, and a weak reference to a parameter
        # would forbid torch.utils.swap_tensors (used by module.to() on some tensor types).
        self.modules: list[tuple[weakref.ref[nn.Module], bool]] = []  # (module, recurse)
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.handles: list[Any] = []
        params: list[torch.Tensor] = []
        others: list[torch.Tensor] = []
        if model is not None:
            self.modules.append((weakref.ref(model), True))
            params.extend(model.parameters())
        if optimizer is not None:
            self.optimizers.add(optimizer)
        if scan_live:
            # type(), not isinstance: some live objects are deprecation proxies that warn
            # when their __class__ is read.
            for obj in gc.get_objects():
                cls = type(obj)
                if issubclass(cls, nn.Parameter):
                    params.append(obj)
                elif issubclass(cls, torch.Tensor):
                    others.append(obj)
                elif issubclass(cls, nn.Module):
                    self.modules.append((weakref.ref(obj), False))
                elif issubclass(cls, torch.optim.Optimizer):
                    self.optimizers.add(obj)
        for p in params:
            tracker.mark(p, self.param_rank(p))
            tracker.mark(p.grad, _GRADS)
        self.refresh()
        for t in others:
            tracker.see(t)
        # Held only until install() has hooked them, before fn starts.
        self._to_hook = [p for p in params if p.requires_grad and p.is_leaf]

    def param_rank(self, p: torch.Tensor) -> int:
        """A weight the model owns is a parameter; a copy the optimizer owns is its memory."""
        if getattr(p, "_memfit_master", False):
            return _OPTIMIZER
        if self.model_param_ids is None or id(p) in self.model_param_ids:
            return _PARAMS
        return _OPTIMIZER

    def mark_optimizer(self, optimizer: torch.optim.Optimizer, *, state: bool = True) -> None:
        mark = self.tracker.mark
        for group in optimizer.param_groups:
            for p in group["params"]:
                mark(p, self.param_rank(p))
                mark(p.grad, _GRADS)
        if state:
            # Values may be tensors or lists of them (LBFGS keeps its history in lists).
            for value in tensors(list(optimizer.state.values())):
                mark(value, _OPTIMIZER)

    def refresh(self) -> None:
        """Mark every tensor whose role is known now: params, grads, buffers, optimizer state."""
        mark = self.tracker.mark
        for ref, recurse in self.modules:
            module = ref()
            if module is None:
                continue
            for p in module.parameters(recurse=recurse):
                mark(p, self.param_rank(p))
                mark(p.grad, _GRADS)
            for b in module.buffers(recurse=recurse):
                mark(b, _PARAMS)
        for optimizer in list(self.optimizers):
            self.mark_optimizer(optimizer)

    def install(self) -> None:
        """Hooks that learn roles while fn runs, before a tensor may die again."""

        def grad_ready(p: torch.Tensor) -> None:
            self.tracker.mark(p.grad, _GRADS)

        for p in self._to_hook:
            self.handles.append(p.register_post_accumulate_grad_hook(grad_ready))
        self._to_hook = []

        def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # Gradients may be freed right after the step (zero_grad in the same fn).
            self.optimizers.add(optimizer)
            self.mark_optimizer(optimizer, state=False)

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.mark_optimizer(optimizer)  # state is created lazily by the first step

        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.handles.append(register_optimizer_step_pre_hook(before_step))
        self.handles.append(register_optimizer_step_post_hook(after_step))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _track(
    fn: Callable[[], Any],
    device: torch.device,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scan_live: bool,
    round_to: int,
    track_saved: bool = True,
) -> tuple[Any, _StorageTracker]:
    tracker = _StorageTracker(device, round_to)
    roles = _Roles(tracker, model, optimizer, scan_live)

    def pack(t: torch.Tensor) -> torch.Tensor:
        tracker.mark(t, _ACTIVATIONS)
        # The same storage, so nothing is copied or kept longer; detached, because keeping a
        # saved *output* itself would tie it to its own grad_fn in a cycle gc cannot see.
        return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    saved = (
        torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        if track_saved
        else contextlib.nullcontext()
    )
    try:
        roles.install()
        tracker.started = True
        _RUNNING.append(tracker)
        try:
            with saved, _TrackingMode(tracker):
                result = fn()
        except RuntimeError as e:
            if track_saved and "saved tensor hooks" in str(e):
                raise ConfigError(
                    "fn uses a feature that refuses saved-tensor hooks (torch.func transforms, "
                    "disable_saved_tensors_hooks); measure it with track_saved=False, and "
                    "what autograd saves will count as temp instead of activations"
                ) from e
            raise
        roles.refresh()
    finally:
        if _RUNNING and _RUNNING[-1] is tracker:
            _RUNNING.pop()
        roles.remove()
        tracker.stop()
    return result, tracker


def measure(
    fn: Callable[[], Any],
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    scan_live: bool | None = None,
    track_saved: bool = True,
) -> MemoryReport:
    """Run ``fn()`` once and report its peak memory on ``device``, by kind and by dtype.

    The peak counts every tensor alive on the device while ``fn`` ran, including those alive
    before it started. Which ones those are: with ``model``/``optimizer`` given, their
    parameters, buffers, gradients and optimizer state; with neither given (or
    ``scan_live=True``), every live tensor on the device that Python can reach. A tensor
    ``fn`` uses without having made it (a batch made beforehand) counts from its first use.
    ``fn`` runs unchanged: same ops, same saved tensors, bitwise the same results.

    Roles: an optimizer-held tensor that is not one of ``model``'s parameters (an fp32 master
    copy) counts as ``optimizer``. Without ``model``, every ``nn.Parameter`` and every tensor
    an optimizer updates counts as ``params``, except memfit's own master copies (marked
    ``_memfit_master``). Buffers count as ``params``.

    Args:
        fn: the work to measure, typically one whole training step.
        model: the model trained by ``fn``; also picks the device when ``device`` is None.
        optimizer: its optimizer, whose state is counted from the start.
        device: the device to measure; default: the model's, else CUDA if present, else CPU.
        scan_live: look for all live tensors with ``gc`` at the start; default: only when
            neither ``model`` nor ``optimizer`` is given.
        track_saved: learn which tensors autograd saves with saved-tensor hooks; turn off
            for ``fn`` that refuse such hooks (``torch.func`` transforms), and saved tensors
            count as ``temp``.

    On CUDA ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the run (so that
    statistic is reset first) and the tracker splits it by kind; no host sync is added.
    Measuring costs Python work on every op (about 2x a small step's time on CPU): it is for
    profiling a step, not for every step.

    Example::

        def step():
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()

        report = measure(step, model=model, optimizer=optimizer)
        print(report.summary())
    """
    device = _resolve_device(device, model, optimizer)
    if scan_live is None:
        scan_live = model is None and optimizer is None
    if device.type != "cuda":
        result, tracker = _track(fn, device, model, optimizer, scan_live, 1, track_saved)
        return _tracker_report(tracker, device, result)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    result, tracker = _track(fn, device, model, optimizer, scan_live, _CUDA_BLOCK, track_saved)
    # Allocator statistics are host-side counters: reading them does not sync the device.
    peak = torch.cuda.max_memory_allocated(device)
    end = torch.cuda.memory_allocated(device)
    return _tracker_report(tracker, device, result, _AllocatorBytes(start, peak, end))


def tracked_bytes() -> int | None:
    """The bytes of every tensor the innermost running :func:`measure` sees alive at this
    moment (those alive at its start included); None outside ``measure``. For marking a
    moment of the measured work: the allocator's level then, less this, is what kernels
    hold that no tensor shows.

    Example::

        def step():
            loss = model(x).sum()
            at_forward_end.append(tracked_bytes())
            loss.backward()

        measure(step, model=model)
    """
    return _RUNNING[-1].live_bytes() if _RUNNING else None


class _AllocatorBytes(NamedTuple):
    """The CUDA allocator's bytes around a measured run."""

    start: int
    peak: int
    end: int


def _tracker_report(
    tracker: _StorageTracker,
    device: torch.device,
    result: Any,
    allocator: _AllocatorBytes | None = None,
) -> MemoryReport:
    """The report of a tracked run: the tracker's peak split by kind and dtype, or with
    ``allocator`` the allocator's peak, start and end, what the tracker did not see folded
    into ``temp`` (:func:`_add_untracked`)."""
    tracked, by_kind, by_dtype, peak_by_kind, start, end = tracker.replay()
    peak, method = tracked, "tracker"
    if allocator is not None:
        _add_untracked(by_kind, by_dtype, allocator.peak - tracked)
        # What no tensor shows (cuBLAS's workspaces, which live from a handle's first
        # matmul on, and the allocator's rounding) is held at the peak, so each kind's own
        # peak is at least its share there.
        peak_by_kind = {k: max(peak_by_kind.get(k, 0), v) for k, v in by_kind.items()}
        start, peak, end = allocator
        method = "cuda-allocator"
    return MemoryReport(
        peak_bytes=peak,
        by_kind=by_kind,
        by_dtype=by_dtype,
        peak_by_kind=peak_by_kind,
        device=device,
        start_bytes=start,
        end_bytes=end,
        tracked_peak_bytes=tracked,
        method=method,
        result=result,
    )


def _add_untracked(by_kind: dict[str, int], by_dtype: dict[str, int], extra: int) -> None:
    """Fold allocator bytes the tracker did not see into ``temp`` so the kinds sum to the peak."""
    if extra == 0:
        return
    by_dtype["untracked"] = by_dtype.get("untracked", 0) + extra
    if extra > 0:
        by_kind["temp"] += extra
        return
    # The tracker saw more than the allocator (memory from outside it, e.g. DLPack): take the
    # excess from the least structural kinds first.
    deficit = -extra
    for kind in reversed(KINDS):
        take = min(deficit, by_kind[kind])
        by_kind[kind] -= take
        deficit -= take
