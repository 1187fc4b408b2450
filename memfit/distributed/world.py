"""Who this process is in a data-parallel run, and its share of a global batch.

Without an initialized process group the world is one rank (rank 0 of 1), so the same code
runs on one process and under ``torchrun``.

Example::

    world = current_world()
    local = shard_batch(global_batch)      # this rank's rows; ConfigError when uneven
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from memfit.errors import ConfigError
from memfit.nested import map_tensors, tensors

#: The process group timeout memfit uses when it initializes the group itself: a rank
#: that stops answering fails the others after this long instead of hanging them.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


def loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` is imported already, else None.

    No object of a class exists before its module is imported, so an ``isinstance`` check
    against DTensor or FSDP2's module needs no import of its own: that import alone takes
    about a second (``torch.distributed.tensor``), which every ``import memfit`` paid.

    Example::

        dtensor = loaded_class("torch.distributed.tensor", "DTensor")
        if dtensor is not None and isinstance(t, dtensor): ...
    """
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


class World(NamedTuple):
    """This process's place in the run."""

    rank: int
    world_size: int
    backend: str | None
    """The process group's backend (``"gloo"``, ``"nccl"``), None on one process."""

    @property
    def distributed(self) -> bool:
        """Whether more than one rank trains."""
        return self.world_size > 1


def current_world() -> World:
    """The rank and world size of the default process group (0 of 1 without one).

    Example::

        if current_world().rank == 0:
            print("writes the logs")
    """
    if not (dist.is_available() and dist.is_initialized()):
        return World(0, 1, None)
    return World(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def init_from_env(
    backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> World:
    """Initialize the default process group from ``torchrun``'s environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ...) when it is set and no group exists yet; return
    the world. ``backend``: default nccl when CUDA is available, else gloo.

    Example::

        world = init_from_env()            # under torchrun; World(0, 1, None) alone
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return current_world()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    _import_group_defaults()
    dist.init_process_group(backend, timeout=timeout)
    return current_world()


def _import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` before the default group exists.

    Its functions take ``group=group.WORLD`` as a default argument, which Python evaluates
    once, at import. DDP's constructor imports the module (through
    ``torch.distributed._shard``); imported after ``init_process_group``, the defaults hold
    the live group, and ``destroy_process_group`` then cannot free it: gloo's threads keep
    running and the group is torn down while the interpreter shuts down, where a rank of
    ``memfit train --nproc 2`` was seen to abort (SIGABRT, "terminate called without an
    active exception"). Imported first, the defaults are None (the default group at call
    time) and the group is freed when it is destroyed.
    """
    import torch.distributed.nn.functional  # noqa: F401


def check_global_batch(global_batch: int, world_size: int) -> int:
    """The per-rank batch of ``global_batch`` samples over ``world_size`` ranks.

    ConfigError when it does not divide evenly: the ranks' mean gradients would then weigh
    samples unequally. The message lists the valid global batches nearby.

    Example::

        check_global_batch(32, 4)   # 8
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if global_batch < world_size or global_batch % world_size:
        lower = max(world_size, global_batch // world_size * world_size)
        choices = sorted({lower, lower + world_size, 2 * lower})
        raise ConfigError(
            f"a global batch of {global_batch} samples cannot be split evenly over "
            f"{world_size} ranks; use a multiple of {world_size}, e.g. "
            f"{', '.join(map(str, choices))}"
        )
    return global_batch // world_size


def shard_batch(batch: Any, world: World | None = None) -> Any:
    """This rank's contiguous slice of a global batch (every tensor split on dim 0).

    ConfigError when the batch's size is not a multiple of the world size.

    Example::

        local = shard_batch(batch_fn(32, generator=step))   # 16 rows on each of 2 ranks
    """
    world = current_world() if world is None else world
    sizes = {t.shape[0] for t in tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ConfigError(
            f"shard_batch needs tensors of one leading size, got sizes {sorted(sizes)}"
        )
    per_rank = check_global_batch(sizes.pop(), world.world_size)
    start = world.rank * per_rank
    return map_tensors(batch, lambda t: t[start : start + per_rank] if t.dim() > 0 else t)
