"""Engine state files of data-parallel runs: rank 0's file under DDP, a sharded directory
under FSDP2.

**DDP** (and one process): every rank holds the same weights, so rank 0 writes the one file
(atomically, with its digest, as :func:`memfit.savefile.atomic_save` does) after the ranks'
random generator states were gathered into it; every rank reads and verifies it. The model's
keys are the plain model's (no ``module.``), so such a file also loads on one process.

**FSDP2**: a directory written with ``torch.distributed.checkpoint`` (each rank its shard
of the weights and the optimizer state) plus ``engine.pt`` (settings, scaler, scheduler,
counters, each rank's random generators, the world size and the SHA-256 of every shard
file), written by rank 0 last. The directory is built under ``<name>.tmp`` and renamed into
place, so a crash leaves the previous saved state or the new one. It loads on the same world
size, and on another one where DCP can reshard the tensors (FSDP2's even sharding on dim 0
can); the random generators then restart from rank 0's.

Example::

    write_state(state, "run/ckpt", model, optimizer, "fsdp")
    state = read_state("run/ckpt")
    load_weights(state, "run/ckpt", model, optimizer, "fsdp")
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memfit.distributed.collectives import from_every_rank, from_rank0
from memfit.distributed.parallel import local_module
from memfit.distributed.world import current_world
from memfit.errors import ConfigError, DistributedError, StateFileError
from memfit.precision.optimizer_state import fp32_state_dict
from memfit.savefile import atomic_save, safe_load

META = "engine.pt"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(fn: Callable[[], Any], what: str) -> None:
    """Run ``fn`` on rank 0 and share how it went, in place of a barrier: a rank waiting
    at a barrier for a rank 0 that failed would wait for the group's whole timeout.
    Rank 0 re-raises its own error; every other rank raises DistributedError naming it.
    """
    world = current_world()
    error: str | None = None
    if world.rank == 0:
        try:
            fn()
        except BaseException as exc:
            if not world.distributed:
                raise
            error = f"{type(exc).__name__}: {exc}"[:2000]
            with contextlib.suppress(Exception):  # a peer gone too: rank 0's error is the news
                from_rank0(error)
            raise
    if world.distributed:
        error = from_rank0(error)
    if error is not None and world.rank != 0:
        raise DistributedError(
            f"rank 0 failed to {what} ({error}); rank {world.rank} stopped with it. Fix "
            "the error on rank 0 and save again"
        )


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def write_state(
    state: dict[str, Any],
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str | None,
) -> Path:
    """Write an Engine state (its ``model`` and ``optimizer`` entries unset under FSDP2) as
    the module docstring says; every rank calls it. Returns the path.

    Example::

        write_state(engine.state_dict(), "run/last.pt", model, optimizer, "ddp")
    """
    world = current_world()
    path = Path(path)
    if world.distributed:
        state["rng_by_rank"] = from_every_rank(state["rng"])
    state["world_size"] = world.world_size
    state["data_parallel"] = kind
    if kind != "fsdp":
        _on_rank0(lambda: atomic_save(state, path), f"write the state file {path}")
        return path
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{path} is a file; an FSDP2 saved state is a directory: give a path without "
            "a file there (e.g. run/state)"
        )
    tmp = path.with_name(path.name + ".tmp")
    if world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
        _barrier()
        if world.rank == 0:
            state["shards"] = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
            atomic_save(state, tmp / META)
    except BaseException:
        if world.rank == 0:  # a failed save leaves the previous saved state and nothing else
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def replace() -> None:
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        moved = False
        try:
            if path.exists():
                path.rename(old)
                moved = True
            tmp.rename(path)
        except BaseException as exc:
            # The previous saved state goes back where it was, and the new one away.
            shutil.rmtree(tmp, ignore_errors=True)
            if moved and not path.exists():
                try:
                    old.rename(path)
                except OSError:
                    raise StateFileError(
                        f"could not put the new saved state in place at {path} ({exc}), nor "
                        f"the previous one back: it is at {old}; rename it to {path} to "
                        "resume from it"
                    ) from exc
            raise
        shutil.rmtree(old, ignore_errors=True)

    _on_rank0(replace, f"put the saved state in place at {path}")
    return path


def read_state(path: str | Path) -> dict[str, Any]:
    """The Engine state of a state file or directory, verified (digests of the file,
    or of ``engine.pt`` and every shard). StateFileError when something differs.

    Example::

        state = read_state("run/ckpt")
        state["world_size"]
    """
    path = Path(path)
    if not path.is_dir():
        return safe_load(path)
    meta = path / META
    if not meta.exists():
        raise StateFileError(f"{path} is a directory without {META}: not a memfit saved state")
    state = safe_load(meta)
    for name, digest in state.get("shards", {}).items():
        shard = path / name
        if not shard.exists() or _sha256(shard) != digest:
            raise StateFileError(
                f"shard {shard} of saved state {path} is missing or changed since it was "
                "written; resume from another saved state"
            )
    return state


def load_weights(
    state: dict[str, Any],
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: str | None,
) -> None:
    """Load the weights and optimizer state of ``state`` (read from ``path``) into this
    rank's model and optimizer. ConfigError when the saved state's kind or world size cannot
    load here, naming both sizes.

    Example::

        load_weights(read_state(path), path, model, optimizer, "fsdp")
    """
    world = current_world()
    saved_size = int(state.get("world_size", 1))
    sharded = state.get("data_parallel") == "fsdp"
    if sharded != (kind == "fsdp"):
        saved = (
            f"sharded by FSDP2 on {saved_size} rank(s)"
            if sharded
            else (f"as one file on {saved_size} rank(s)")
        )
        here = "FSDP2" if kind == "fsdp" else (kind or "no data parallelism")
        raise ConfigError(
            f"saved state {path} was written {saved}, but this Engine runs {here} on "
            f"{world.world_size} rank(s); resume it with "
            f"{'data_parallel=fsdp' if sharded else 'DDP or one process'} (an FSDP2 "
            "directory converts to one file with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save)"
        )
    if not sharded:
        local_module(model).load_state_dict(state["model"])
        # Saved with 8-bit or bf16 state, resumed with torch's own: its moments decoded.
        optimizer.load_state_dict(fp32_state_dict(optimizer, state["optimizer"]))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    target = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(target, checkpoint_id=str(path))
    except Exception as exc:  # DCP raises its own CheckpointException
        raise ConfigError(
            f"saved state {path} (written on {saved_size} rank(s)) does not load on "
            f"{world.world_size} rank(s) ({str(exc)[:400]}); resume it on {saved_size} "
            "rank(s)"
        ) from exc
    set_state_dict(
        model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
    )


def rank_rng(state: dict[str, Any]) -> dict[str, Any]:
    """This rank's saved random generator states (rank 0's when the world size changed).

    Example::

        torch.set_rng_state(rank_rng(state)["torch"])
    """
    world = current_world()
    by_rank = state.get("rng_by_rank")
    if by_rank and len(by_rank) == world.world_size:
        return by_rank[world.rank]
    return state["rng"]
