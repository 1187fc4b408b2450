"""The few collectives the Engine adds to a data-parallel step, and failure propagation.

Per optimizer step: the found-inf flag is all-reduced with MAX before the step (every rank
skips the same steps, also where only one rank's gradient shard overflowed), the step's
loss is averaged over the ranks (the global mean), and with clipping the gradient norm is
that of the whole model (DTensor shards reduced). None of them reads a value on the host.

:func:`any_rank` ORs a few flags over the ranks on the CPU, for decisions every rank must
make alike (stopping on a signal, saving on a timer: :mod:`memfit.engine.preemption`).

When a rank fails (a bad batch, a loss_fn that raises), it writes what failed to the process
group's store before it re-raises; the other ranks, whose next collective then fails or
times out, read it and raise :class:`~memfit.errors.DistributedError` naming that rank.

Each collective here returns only once the process group's worker has let go of its
tensors (:func:`_settled`). A gloo worker thread drops its reference to a collective's
tensors after the caller has seen the collective complete, and (torch 2.13, as measured)
dropping any reference to a tensor that has a Python object takes the GIL. If the main
thread is destroying the process group then (its last holder gone: a DDP model freed after
``destroy_process_group``), it holds the GIL while it waits for the worker threads to end,
and neither moves: a rank of ``memfit train --nproc 2`` hung at exit so, its worker in the
destructor of a broadcast's work. At the interpreter's shutdown a worker waiting for the
GIL is stopped inside that destructor and the process aborts ("terminate called without an
active exception"). Nothing of memfit's is in a worker's hands when its calls return.

Example::

    scaler.register_found_inf_hook(all_reduce_max)
    loss = mean_over_ranks(loss)
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from memfit.distributed.world import current_world, loaded_class
from memfit.errors import DistributedError

_FAILED = "memfit/failed/"
_FAILURES = "memfit/failures"


#: How long a collective waits for the worker to let go of its tensors (it takes
#: microseconds; the bound is against a worker that never does, which then is not waited on).
_SETTLE_SECONDS = 10.0


def _settled(collective: Callable[..., Any], tensor: torch.Tensor, **kwargs: Any) -> None:
    """``collective(tensor, **kwargs)`` (``dist.all_reduce``, ``dist.broadcast``), returned
    from once the worker that ran it has dropped its reference to ``tensor``: while it holds
    one, the tensor's Python object counts one reference more (torch keeps a tensor's Python
    object alive while C++ holds the tensor), and this thread sleeps, giving the worker the
    GIL it needs to drop it. CUDA tensors (NCCL's works, retired by its watchdog) are not
    waited on.

    >>> t = torch.ones(2)
    >>> _settled(lambda x: x.mul_(2), t)
    >>> t
    tensor([2., 2.])
    """
    before = sys.getrefcount(tensor)
    collective(tensor, **kwargs)
    if tensor.device.type != "cpu":
        return
    deadline = time.monotonic() + _SETTLE_SECONDS
    while sys.getrefcount(tensor) > before and time.monotonic() < deadline:
        time.sleep(1e-4)


def all_reduce_max(flag: torch.Tensor) -> None:
    """All-reduce ``flag`` in place with MAX (the scaler's found-inf hook).

    Example::

        scaler.register_found_inf_hook(all_reduce_max)
    """
    _settled(dist.all_reduce, flag, op=dist.ReduceOp.MAX)


_CPU_GROUPS: dict[int, Any] = {}


def _cpu_group() -> Any:
    """A process group whose collectives run on CPU tensors: the default group under gloo,
    else a gloo group beside it (made once, on the first call, which every rank makes at
    the same point), so an agreement never syncs a GPU stream."""
    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    key = id(world)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS.clear()  # a new default group: the old side group belongs to the old one
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over the ranks (one all-reduce MAX of a few integers on the CPU; the
    flags as given on one process): a decision every rank must make the same, such as
    stopping or saving at this step, taken where any rank asks for it. Every rank calls it
    at the same point.

    Example::

        stop, save = any_rank(signal_received, save_due)
    """
    if not current_world().distributed:
        return tuple(bool(f) for f in flags)
    votes = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    _settled(dist.all_reduce, votes, op=dist.ReduceOp.MAX, group=_cpu_group())
    return tuple(bool(v) for v in votes.tolist())


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (any picklable object; a no-op on one process): for
    choices each rank could make differently (a name holding the time, a measured speed).

    Example::

        mode = from_rank0(choose_precision(device).mode)
    """
    world = current_world()
    if not world.distributed:
        return value
    # broadcast_object_list does the same on tensors of its own, which could not be settled.
    group, rank0 = _cpu_group(), world.rank == 0
    payload = pickle.dumps(value) if rank0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    _settled(dist.broadcast, size, src=0, group=group)
    data = _bytes_tensor(payload) if rank0 else torch.empty(int(size), dtype=torch.uint8)
    _settled(dist.broadcast, data, src=0, group=group)
    return value if rank0 else pickle.loads(data.numpy().tobytes())


def from_every_rank(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (any picklable object; ``[value]`` on one process):
    each rank writes its pickled value at its own place of one zeroed buffer, and a SUM
    all-reduce on the CPU gives every rank the whole.

    Example::

        rng_by_rank = from_every_rank(torch.get_rng_state())
    """
    world = current_world()
    if not world.distributed:
        return [value]
    group, rank, size = _cpu_group(), world.rank, world.world_size
    payload = pickle.dumps(value)
    sizes = torch.zeros(size, dtype=torch.int64)
    sizes[rank] = len(payload)
    _settled(dist.all_reduce, sizes, op=dist.ReduceOp.SUM, group=group)
    lengths = [int(n) for n in sizes.tolist()]
    starts = [sum(lengths[:r]) for r in range(size)]
    data = torch.zeros(sum(lengths), dtype=torch.uint8)
    data[starts[rank] : starts[rank] + len(payload)] = _bytes_tensor(payload)
    _settled(dist.all_reduce, data, op=dist.ReduceOp.SUM, group=group)
    return [
        value if r == rank else pickle.loads(data[starts[r] : starts[r] + n].numpy().tobytes())
        for r, n in enumerate(lengths)
    ]


def _bytes_tensor(payload: bytes) -> torch.Tensor:
    """``payload`` as a uint8 tensor of its own (a copy: torch.frombuffer shares memory)."""
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the ranks (a new tensor; SUM then divide: gloo has no AVG).

    Example::

        global_loss = mean_over_ranks(local_loss)
    """
    total = value.detach().clone()
    _settled(dist.all_reduce, total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


def average_gradients(params: list[torch.Tensor]) -> None:
    """Average the gradients of ``params`` over the ranks in place: for a DDP step whose
    micro-batches all ran under ``no_sync`` (a step that ended early).

    Example::

        average_gradients([p for p in model.parameters() if p.grad is not None])
    """
    grads = [p.grad for p in params if p.grad is not None]
    for grad in grads:
        _settled(dist.all_reduce, grad, op=dist.ReduceOp.SUM)
    if grads:
        torch._foreach_div_(grads, float(dist.get_world_size()))


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, as a plain tensor: for DTensor shards (FSDP2)
    the norm of the full gradients, reduced over the ranks.

    Example::

        norm = total_norm([p.grad for p in params if p.grad is not None])
    """
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    dtensor = loaded_class("torch.distributed.tensor", "DTensor")
    if dtensor is not None and isinstance(norm, dtensor):
        norm = norm.full_tensor()
    return norm


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def announce_failure(exc: BaseException) -> None:
    """Write this rank's failure to the process group's store for the other ranks.

    Example::

        except Exception as exc:
            announce_failure(exc)
            raise
    """
    store = _store()
    if store is None:
        return
    rank = current_world().rank
    try:
        store.set(f"{_FAILED}{rank}", f"{type(exc).__name__}: {exc}"[:4000])
        store.add(_FAILURES, 1)
    except (RuntimeError, OSError):
        pass  # the store itself is gone: the other ranks still time out with an error


def failures(wait_seconds: float = 0.0) -> dict[int, str]:
    """What other ranks announced, by rank; polls up to ``wait_seconds`` for a first one.

    Example::

        failures(wait_seconds=2.0)   # {1: "ConfigError: the micro-batch is empty ..."}
    """
    store = _store()
    if store is None:
        return {}
    world = current_world()
    deadline = time.monotonic() + wait_seconds
    try:
        while True:
            if store.add(_FAILURES, 0) > 0:
                break
            if time.monotonic() >= deadline:
                return {}
            time.sleep(0.05)
        found = {}
        for rank in range(world.world_size):
            key = f"{_FAILED}{rank}"
            if rank != world.rank and store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
        return found
    except (RuntimeError, OSError):
        return {}


def _is_communication_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed", "Connection reset", "Timed out", "gloo", "NCCL")
    )


def propagate_failure(exc: BaseException) -> None:
    """Called with the exception a rank's step raised. A failed collective (a peer stopped
    or timed out) becomes DistributedError naming the rank that announced a failure; any
    other exception is this rank's own: it is announced and the caller re-raises it.

    Example::

        except BaseException as exc:
            propagate_failure(exc)
            raise
    """
    if isinstance(exc, DistributedError):
        return
    if not _is_communication_error(exc):
        # This rank's own error (every rank may meet the same one): it is raised as is.
        announce_failure(exc)
        return
    rank = current_world().rank
    others = failures(wait_seconds=5.0)
    if others:
        first = min(others)
        raise DistributedError(
            f"rank {first} failed ({others[first]}); rank {rank} stopped with it. Fix the "
            f"error on rank {first} and start the run again"
        ) from exc
    raise DistributedError(
        f"a collective failed on rank {rank} ({type(exc).__name__}: {str(exc)[:300]}); "
        "another rank stopped or stopped answering within the process group's timeout"
    ) from exc
