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

Every tensor these functions hand to a collective is one this module keeps for the life of
the process (:func:`_held`), never a temporary. A gloo worker thread lets go of a
collective's tensors after the caller has seen it complete, so for a temporary it can be
the last holder; freeing a tensor whose Python object is gone takes the GIL. If the main
thread is destroying the process group then (its last holder gone: a DDP model freed after
``destroy_process_group``), it holds the GIL while it waits for the worker threads to end,
and neither moves: a rank of ``memfit train --nproc 2`` hung at exit so, the worker in the
destructor of a broadcast's work. At the interpreter's shutdown the same worker is stopped
inside that destructor and the process aborts ("terminate called without an active
exception"). A tensor Python still holds is freed by Python, never by the worker.

Example::

    scaler.register_found_inf_hook(all_reduce_max)
    loss = mean_over_ranks(loss)
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from memfit.distributed.world import current_world, loaded_class
from memfit.errors import DistributedError

_FAILED = "memfit/failed/"
_FAILURES = "memfit/failures"


_HELD: dict[tuple[Any, ...], torch.Tensor] = {}


def _held(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: Any = "cpu"
) -> torch.Tensor:
    """The tensor this module keeps for collective ``name`` of that shape, dtype and device,
    made on first use and reused by every later call (the collectives here are synchronous,
    so no two calls share one at once). Kept for the life of the process: see the module's
    notes for why a collective never runs on a temporary."""
    key = (name, shape, dtype, torch.device(device))
    if key not in _HELD:
        _HELD[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _HELD[key]


def _capacity(size: int) -> int:
    """A payload buffer's length for ``size`` bytes: the next power of two (at least 256),
    so a run keeps a few buffers, not one per size."""
    return max(256, 1 << max(0, size - 1).bit_length())


def all_reduce_max(flag: torch.Tensor) -> None:
    """All-reduce ``flag`` in place with MAX (the scaler's found-inf hook).

    Example::

        scaler.register_found_inf_hook(all_reduce_max)
    """
    held = _held("found inf", tuple(flag.shape), flag.dtype, flag.device)
    held.copy_(flag)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    flag.copy_(held)


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
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tuple(bool(f) for f in flags)
    votes = _held("votes", (len(flags),), torch.int32)
    votes.copy_(torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32))
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=_cpu_group())
    return tuple(bool(v) for v in votes.tolist())


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (any picklable object; a no-op on one process): for
    choices each rank could make differently (a name holding the time, a measured speed).

    Example::

        mode = from_rank0(choose_precision(device).mode)
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    group, rank0 = _cpu_group(), dist.get_rank() == 0
    payload = pickle.dumps(value) if rank0 else b""
    size = _held("from_rank0 size", (1,), torch.int64)
    size.fill_(len(payload))
    dist.broadcast(size, src=0, group=group)
    n = int(size.item())
    data = _held("from_rank0 payload", (_capacity(n),), torch.uint8)
    if rank0:
        data[:n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=0, group=group)
    return value if rank0 else pickle.loads(data[:n].numpy().tobytes())


def from_every_rank(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (any picklable object; ``[value]`` on one process):
    each rank writes its pickled value at its own place of one zeroed buffer, and a SUM
    all-reduce on the CPU gives every rank the whole.

    Example::

        rng_by_rank = from_every_rank(torch.get_rng_state())
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    group, rank, world = _cpu_group(), dist.get_rank(), dist.get_world_size()
    payload = pickle.dumps(value)
    sizes = _held("from_every_rank sizes", (world,), torch.int64)
    sizes.zero_()
    sizes[rank] = len(payload)
    dist.all_reduce(sizes, op=dist.ReduceOp.SUM, group=group)
    lengths = [int(n) for n in sizes.tolist()]
    cap = _capacity(max(lengths))
    data = _held("from_every_rank payload", (world * cap,), torch.uint8)
    data.zero_()
    data[rank * cap : rank * cap + len(payload)].copy_(
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    )
    dist.all_reduce(data, op=dist.ReduceOp.SUM, group=group)
    return [
        value if r == rank else pickle.loads(data[r * cap : r * cap + n].numpy().tobytes())
        for r, n in enumerate(lengths)
    ]


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the ranks (a new tensor; SUM then divide: gloo has no AVG).

    Example::

        global_loss = mean_over_ranks(local_loss)
    """
    total = _held("mean", tuple(value.shape), value.dtype, value.device)
    total.copy_(value.detach())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total / dist.get_world_size()


def average_gradients(params: list[torch.Tensor]) -> None:
    """Average the gradients of ``params`` over the ranks in place: for a DDP step whose
    micro-batches all ran under ``no_sync`` (a step that ended early).

    Example::

        average_gradients([p for p in model.parameters() if p.grad is not None])
    """
    # The gradients are held by their parameters, not by the collectives' workers.
    grads = [p.grad for p in params if p.grad is not None]
    for grad in grads:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
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
