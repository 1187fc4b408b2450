"""The peak memory of a piece of work as the allocator saw it: the oracle for predictions.

``memfit.measure`` tracks tensor storages at the dispatcher, which tells memory apart by
kind (parameters, gradients, activations); it misses what kernels allocate for themselves
(a convolution's workspace, a fused optimizer's scratch). The allocator misses nothing:

* on CUDA, the caching allocator's statistics (``torch.cuda.max_memory_allocated`` after a
  reset of the peak);
* on CPU, ``torch.profiler`` with ``profile_memory=True``, which records every allocation
  and free with its size; the peak is the highest running sum over the work.

Both count from what was allocated when the work started. On CPU the profiler cannot see
that, so the caller names the tensors alive at the start (``live``: parameters, optimizer
state, the batch) and their storages are added once each; storages the work frees without
having allocated them were alive at the start too, and are added as well. Inside a profiler that is
already running (the user's own ``torch.profiler.profile()``), starting another would end
it: there the storage tracker measures instead.

Frees are matched to allocations by address. The profiler reports the free of memory
allocated before it started only where a profiler saw that memory allocated (a step measured
after an unmeasured warm-up sees none of the last step's gradients go: run the warm-up
under ``allocator_peak`` too), and sizes it by a table the CPU allocator keeps while any
profiler runs: an address
freed while none runs keeps its old entry, so a later block there, allocated while none
runs and freed inside the work, is reported with the old block's size. Whether that
happens depends on the process's history: once, in one test process of many, the
planner's measured step read at least 23 KiB below the same plan's step in training,
where every other process matched it within 8 bytes. So a free of a storage named in
``live`` counts that storage's own size, and with ``live_complete`` a free of anything
else the work did not allocate is not counted.

Example::

    peak = allocator_peak(lambda: engine.train_step(batch, loss_fn),
                          live=[*model.parameters(), *optimizer_tensors(optimizer), batch])
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch._C._profiler import _ExtraFields_Allocation as _Allocation

from memfit.nested import tensors


@dataclass(frozen=True)
class AllocatorPeak:
    """The peak of a piece of work, in bytes, and what it was measured from."""

    peak_bytes: int
    """The highest memory allocated at once: ``start_bytes`` plus the highest rise."""
    start_bytes: int
    """What was allocated when the work started (CPU: the ``live`` tensors' storages)."""
    result: Any = None
    """What the work returned."""
    op_workspace_bytes: int = 0
    """The most any one op allocated and freed again inside itself, above what was
    allocated when it began and when it ended: a kernel's own workspace (CPU only; 0 on
    CUDA, where the allocator's statistics do not say which op allocated what)."""
    peak_op_workspace_bytes: int = 0
    """How far op workspaces raised the peak: the highest level less the highest level
    between top-level ops (where every op's own scratch is freed and only tensors remain,
    what a storage tracker sees). An op's large scratch at a moment when little else is
    alive does not count (CPU only; 0 on CUDA)."""
    end_bytes: int | None = None
    """What was allocated when the work ended (what its result keeps alive included; CPU
    only, None elsewhere)."""
    timeline: Timeline | None = None
    """The level after every allocation and free, and the work's marks (CPU, when asked
    for with ``timeline=True``)."""


@dataclass(frozen=True)
class Timeline:
    """What was allocated over a piece of work, event by event, with the times of the marks
    the work made (``torch.profiler.record_function(name)`` ranges whose name starts with
    ``memfit::``), all on the profiler's clock.

    Example::

        t = allocator_peak(step, live=params, timeline=True).timeline
        t.highest(0, t.marks["memfit::unit_begin"][0])   # the most held before it
    """

    times: list[int]
    """When each allocation or free happened (ns)."""
    levels: list[int]
    """Bytes allocated after it, above :attr:`AllocatorPeak.start_bytes`."""
    marks: dict[str, list[int]]
    """Each mark's start times (ns), in order."""

    def highest(self, begin_ns: float, end_ns: float) -> int:
        """The most allocated above the start between two times (the level at ``begin_ns``
        counts: it was held then); 0 before anything was allocated."""
        i = bisect.bisect_right(self.times, begin_ns)
        j = bisect.bisect_right(self.times, end_ns)
        at_begin = self.levels[i - 1] if i else 0
        return max([at_begin, *self.levels[i:j]])


def storage_bytes(objects: Iterable[Any]) -> int:
    """Bytes of the memory behind the tensors in ``objects`` (nested structures of them),
    each storage once; a sparse tensor's are its indices' and values'.

    Example::

        storage_bytes([p.grad for p in model.parameters()])
    """
    return sum(storage_sizes(objects).values())


def storage_sizes(objects: Iterable[Any]) -> dict[int, int]:
    """The memory behind the tensors in ``objects``: bytes by the address the allocator
    handed out (each storage once; empty storages left out, and tensors with no storage of
    their own, a subclass that only wraps others).

    >>> t = torch.zeros(4)
    >>> storage_sizes([t, t[1:]]) == {t.untyped_storage().data_ptr(): 16}
    True
    """
    sizes: dict[int, int] = {}
    for t in tensors(list(objects)):
        parts = [t._indices(), t._values()] if t.layout == torch.sparse_coo else [t]
        for part in parts:
            try:
                storage = part.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if storage.nbytes() > 0:
                sizes.setdefault(storage.data_ptr(), storage.nbytes())
    return sizes


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null for a moment (only around the profiler's own
    start and stop, never around the work, whose warnings and errors stay visible)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters and every tensor of its state (fp32 masters included,
    since in the ``*-master`` modes they are the optimizer's parameters)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [*params, *tensors(list(optimizer.state.values()))]


@contextlib.contextmanager
def collection_paused(collect_first: bool = True) -> Iterator[None]:
    """No automatic run of Python's cycle collector inside the block (and one run before
    it with ``collect_first``): garbage of earlier work (tensors in reference cycles)
    freed during a measurement would read as a change of the level the work made, at
    random.

    Example::

        with collection_paused():
            before = meter.current(); run_step(); peak = meter.peak()
    """
    collecting = gc.isenabled()
    if collect_first:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def release_kernel_workspaces(device: str | torch.device) -> None:
    """Free the workspaces cuBLAS keeps on ``device`` (one per handle and stream, made at
    a handle's first matmul and held from then on: 32 MiB each on a Hopper GPU, one for
    the thread that runs forward and one for autograd's thread that runs backward), so
    that the next measured run allocates them again and its rise counts them. They are
    memory a training step holds that no tensor shows. Nothing on CPU, or where this
    torch cannot free them.

    Example::

        release_kernel_workspaces("cuda")
        peak = allocator_peak(step, device="cuda")  # its rise holds the workspaces
    """
    device = torch.device(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type != "cuda" or clear is None:
        return
    torch.cuda.synchronize(device)
    clear()


def allocator_peak(
    fn: Callable[[], Any],
    live: Iterable[Any] = (),
    device: str | torch.device = "cpu",
    timeline: bool = False,
    live_complete: bool = False,
) -> AllocatorPeak:
    """Run ``fn()`` and return its peak memory on ``device`` as the allocator saw it.

    ``live``: tensors (or nested structures of them) alive when ``fn`` starts; on CPU
    their storages are the starting point. On CUDA the allocator knows it itself.
    ``timeline``: keep every level and the work's ``memfit::`` marks (CPU only;
    :class:`Timeline`). ``live_complete``: ``live`` holds everything alive that the work
    frees (the last step's gradients included), so a free of memory that the work did not
    allocate and ``live`` does not name is not counted at all (CPU; by default it is taken
    as memory ``live`` left out, alive from the start until that free, with the size the
    profiler gives it: see the module's notes).

    Example::

        peak = allocator_peak(step, live=[*model.parameters(), batch]).peak_bytes
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return AllocatorPeak(int(torch.cuda.max_memory_allocated(device)), int(start), result)
    named = storage_sizes(live)
    start = sum(named.values())
    # Not held through the work: a tensor it frees (gradients zero_grad sets to None) must
    # be free to go (a caller naming them inline, ``live=[...]``, holds no other reference).
    live = ()
    if torch.autograd.profiler._is_profiler_enabled:
        # A profiler is running already (the user's, or an outer measurement): starting
        # another would end it. The storage tracker measures instead (kernels' own
        # workspaces unseen), and the caller's profile is left alone.
        from memfit.memory import measure

        report = measure(fn, device=device)
        return AllocatorPeak(int(report.peak_bytes), int(report.start_bytes), report.result)
    activities = [torch.profiler.ProfilerActivity.CPU]
    prof = torch.profiler.profile(activities=activities, profile_memory=True)
    # Garbage the cycle collector would free inside the window was allocated before it,
    # so its frees would read as memory the work found alive (the lowest level below),
    # raising the start and the peak by the garbage's size, at random: a 2.5 MiB tensor of
    # an earlier test once did. No automatic collection runs inside the window (one run
    # before it would cost a quarter of a second in a large process, at every call).
    with collection_paused(collect_first=False):
        with _quiet_stderr():  # the profiler's C++ side announces its start and stop there
            prof.__enter__()
        try:
            result = fn()
        finally:
            with _quiet_stderr():
                prof.__exit__(None, None, None)
    events = list(_flat(prof.profiler.kineto_results.experimental_event_tree()))
    events.sort(key=lambda e: e.start_time_ns)  # stable: a parent before its children
    allocations = [
        Allocation(e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size)
        for e in events
        if isinstance(e.extra_fields, _Allocation) and e.extra_fields.device.type == "cpu"
    ]
    walked = levels_of(allocations, named, live_complete)
    ops = [(e.start_time_ns, e.end_time_ns) for e in events if e.name.startswith("aten::")]
    marks: dict[str, list[int]] = {}
    if timeline:
        for e in events:
            if e.name.startswith("memfit::"):
                marks.setdefault(e.name, []).append(e.start_time_ns)
    times, levels = walked.times, walked.levels
    # Bytes freed that the work never allocated nor ``live`` named were alive when it
    # started (last step's gradients that ``zero_grad`` frees): the start was at least that
    # much higher, and so was every level after it.
    start += walked.unnamed_bytes
    return AllocatorPeak(
        start + walked.highest,
        start,
        result,
        _op_workspace(times, levels, ops),
        _peak_op_workspace(times, levels, ops, walked.highest),
        start + walked.end,
        Timeline(times, levels, marks) if timeline else None,
    )


class Allocation(NamedTuple):
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) the profiler reported."""

    time_ns: int
    ptr: int
    nbytes: int


@dataclass(frozen=True)
class Levels:
    """What was allocated over a piece of work, above its start (:func:`levels_of`)."""

    times: list[int]
    """When each counted allocation or free happened (ns)."""
    levels: list[int]
    """The level after each."""
    highest: int
    """The highest level (0: the start)."""
    end: int
    """The level at the end."""
    unnamed_bytes: int
    """The least memory alive at the start beyond the named storages that the frees
    show: what the lowest level went below 0 by, frees of named storages not counted."""


def levels_of(
    allocations: Iterable[Allocation], named: dict[int, int], live_complete: bool = False
) -> Levels:
    """The levels of a piece of work from its allocations and frees, in order. A free is
    matched by address to what the work allocated, else to a storage in ``named`` (bytes
    by address, alive at the start), each counted at its own size; any other free counts
    the size the profiler gave it, or with ``live_complete`` is left out.

    >>> a = [Allocation(0, 8, 100), Allocation(1, 64, -50), Allocation(2, 8, -100)]
    >>> levels_of(a, {64: 30}).levels, levels_of(a, {64: 30}).unnamed_bytes
    ([100, 70, -30], 0)
    >>> levels_of(a, {}).levels, levels_of(a, {}).unnamed_bytes
    ([100, 50, -50], 50)
    """
    named = dict(named)
    sizes: dict[int, int] = {}  # what the work allocated and has not freed, by address
    times: list[int] = []
    levels: list[int] = []
    running = highest = lowest = 0
    named_freed = 0  # of the named bytes: counted in the start, never below it
    for event in allocations:
        if event.nbytes > 0:
            sizes[event.ptr] = event.nbytes
            running += event.nbytes
        elif event.ptr in sizes:
            running -= sizes.pop(event.ptr)
        elif event.ptr in named:
            # A named storage, freed: its own size, whatever the profiler says.
            freed = named.pop(event.ptr)
            running -= freed
            named_freed += freed
        elif live_complete:
            continue  # everything alive that the work frees is named: not counted
        else:
            # Memory alive at the start that was not named, at the profiler's size for it
            # (which may be an earlier block's at that address: the module's notes).
            running += event.nbytes
        highest = max(highest, running)
        lowest = min(lowest, running + named_freed)
        times.append(event.time_ns)
        levels.append(running)
    return Levels(times, levels, highest, running, -lowest)


def _flat(events: Iterable[Any]) -> Iterator[Any]:
    """The profiler's event tree, depth first."""
    for event in events:
        yield event
        yield from _flat(event.children)


def _peak_op_workspace(
    times: list[int], levels: list[int], ops: list[tuple[int, int]], highest: int
) -> int:
    """``highest`` less the highest level between top-level ops: before each begins, after
    each ends, and at every allocation or free outside them.

    >>> # an op (times 1..4) with 50 bytes of scratch above its 100-byte output
    >>> _peak_op_workspace([1, 2, 3, 6], [100, 150, 100, 0], [(1, 4)], 150)
    50
    """
    outer: list[tuple[int, int]] = []
    for begin, end in sorted(ops):  # a parent before its children: those inside are dropped
        if outer and begin <= outer[-1][1]:
            continue
        outer.append((begin, end))
    between = 0
    inside = [False] * len(times)
    for begin, end in outer:
        i, j = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        between = max(between, levels[i - 1] if i else 0, levels[j - 1] if j else 0)
        for k in range(i, j):
            inside[k] = True
    for k, level in enumerate(levels):
        if not inside[k]:
            between = max(between, level)
    return max(0, highest - between)


def _op_workspace(times: list[int], levels: list[int], ops: list[tuple[int, int]]) -> int:
    """The most memory one op held inside itself above both its ends' levels."""
    most = 0
    for begin, end in ops:
        i, j = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
        if j <= i:
            continue
        ends = max(levels[i - 1] if i else 0, levels[j - 1])
        most = max(most, max(levels[i:j]) - ends)
    return most
