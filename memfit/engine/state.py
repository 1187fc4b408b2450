"""The Engine's saved state: everything needed to continue exactly, and loading it back.

The state holds the settings, the model's state dict, the fp32 masters, the optimizer,
the loss scaler, the LR scheduler, every random generator, the step counters and the
plan. It is written atomically by :func:`memfit.savefile.atomic_save`. In a data-parallel
run rank 0 writes that file (DDP), or every rank its shard of a directory (FSDP2); see
:mod:`memfit.distributed.state_files`.

Two ways back: :meth:`Engine.resume` builds a new Engine over a freshly built model and
optimizer with the saved settings and plan (:func:`read_resume_point`);
:meth:`Engine.load` (:func:`load_state`) loads into an Engine that already exists, whose
settings must then match the saved ones.

Nothing here takes the Engine: it is given the objects it trains
(:class:`TrainingObjects`), its settings and its counters (:class:`StepCounters`), and
returns what the Engine sets on itself (:class:`LoadedState`).

Example::

    objects = TrainingObjects(model, optimizer, LossScaler())
    state = engine_state(objects, EngineSettings(), StepCounters(0, 0, 0), plan=None)
"""

from __future__ import annotations

import random
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.deprecations import warn_renamed
from memfit.distributed.parallel import local_module
from memfit.distributed.state_files import load_weights, rank_rng, read_state, write_state
from memfit.engine.settings import EngineSettings
from memfit.errors import ConfigError
from memfit.precision.master import MasterWeights, holds_master_weights
from memfit.precision.scaler import LossScaler


@dataclass(frozen=True)
class TrainingObjects:
    """The objects an Engine trains, whose state a state file holds (the Engine's own,
    not copies: loading a state loads into them).

    Example::

        TrainingObjects(model, optimizer, LossScaler(), lr_scheduler=scheduler)
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    master: MasterWeights | None = None
    """The fp32 master weights of the ``*-master`` modes (None in the others)."""
    lr_scheduler: Any = None
    parallel_kind: str | None = None
    """``"ddp"``, ``"fsdp"`` (each rank writes its shard) or None on one process."""


@dataclass(frozen=True)
class StepCounters:
    """An Engine's step counters, as saved and loaded.

    Example::

        StepCounters(steps=10, micro_steps=40, applied_steps=9)   # one step was skipped
    """

    steps: int
    """Optimizer steps attempted."""
    micro_steps: int
    """Micro-batches fed."""
    applied_steps: int
    """Optimizer steps applied, not skipped."""


@dataclass(frozen=True)
class LoadedState:
    """What loading a state gives back to the Engine besides the objects it loaded into."""

    counters: StepCounters
    extra: dict[str, Any] = field(default_factory=dict)
    """The ``extra`` dict given to ``save``."""


class ResumePoint(NamedTuple):
    """A state file read for :meth:`Engine.resume`, and the Engine's arguments from it."""

    state: dict[str, Any]
    """The saved state, to load into the new Engine."""
    arguments: dict[str, Any]
    """The Engine's keyword arguments: the saved settings, the checkpoint request and the
    overrides."""


def engine_state(
    objects: TrainingObjects,
    settings: EngineSettings,
    counters: StepCounters,
    plan: Any,
    checkpoint_request: Any = None,
) -> dict[str, Any]:
    """The saved state of an Engine as a plain dict (tensors included, nothing copied).

    ``plan``: the plan the Engine trains under (None before its first step, or without
    one); a Plan given as ``checkpoint_request`` and not yet applied is saved in its place.

    Example::

        state = engine_state(objects, engine.settings, StepCounters(10, 40, 9), engine.plan)
    """
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if plan is None and not isinstance(checkpoint_request, str | None):
        plan = checkpoint_request  # a Plan given, saved before the first step
    # FSDP2's shards are written by torch.distributed.checkpoint, not in this dict.
    sharded = objects.parallel_kind == "fsdp"
    return {
        "settings": asdict(settings),
        # The module inside torch.compile's wrapper: keys without ``_orig_mod.``, so a
        # saved state moves between a compiled and an uncompiled model.
        # Under DDP the wrapped module's: the keys of the plain model.
        "model": None if sharded else local_module(unwrap_compiled(objects.model)).state_dict(),
        "master": objects.master.state_dict() if objects.master is not None else None,
        "optimizer": None if sharded else objects.optimizer.state_dict(),
        "scaler": objects.scaler.state_dict(),
        "lr_scheduler": objects.lr_scheduler.state_dict()
        if objects.lr_scheduler is not None
        else None,
        "rng": rng,
        "counters": {
            "steps": counters.steps,
            "micro_steps": counters.micro_steps,
            "applied_steps": counters.applied_steps,
        },
        "plan": plan.to_json() if plan is not None and hasattr(plan, "to_json") else None,
    }


def save_state(objects: TrainingObjects, state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` (:func:`engine_state` with ``extra``): atomically to one file, by
    rank 0 in a data-parallel run, or sharded into a directory under FSDP2.

    Example::

        save_state(objects, {**engine_state(...), "extra": {}}, "run/last.pt")
    """
    return write_state(state, path, objects.model, objects.optimizer, objects.parallel_kind)


def read_resume_point(
    path: str | Path, optimizer: torch.optim.Optimizer, overrides: dict[str, Any]
) -> ResumePoint:
    """The state file at ``path`` and the Engine arguments :meth:`Engine.resume` builds
    with: the saved settings, the ``checkpoint`` request (:func:`saved_plan`) and
    ``overrides`` over them. (A ``memfit train --resume`` run directory's own settings are
    :func:`memfit.cli.start.resume_settings`'s.)

    Example::

        state, arguments = read_resume_point("run/last.pt", optimizer, {"log_every": 5})
    """
    check_fresh_optimizer(optimizer)
    state = read_state(path)
    settings = dict(state["settings"])
    settings.pop("checkpoint")
    settings.pop("kernel_islands", None)  # this machine's, found when the Engine is made
    request = (
        overrides.pop("checkpoint") if "checkpoint" in overrides else saved_plan(state, overrides)
    )
    if isinstance(request, str) and request == "none" and "memory_budget" not in overrides:
        # Saved before a budget implied planning: that run ignored its budget.
        settings["memory_budget"] = None
    settings.update(overrides)
    settings["checkpoint"] = request
    return ResumePoint(state, settings)


def saved_plan(state: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    """The checkpoint request a saved state resumes with: its Plan, or its saved spec.

    A saved plan was made for the saved budget and accumulation: when ``overrides``
    changes either (and gives no ``checkpoint``), the run is planned again with its saved
    strategy, with a warning; a plan the user gave by hand cannot be, which is a
    ConfigError saying to pass ``checkpoint=``."""
    plan = state.get("plan")
    spec = state["settings"]["checkpoint"]
    if plan is None:
        return spec
    changed = [
        k
        for k in ("memory_budget", "accumulation_steps")
        if k in (overrides or {}) and overrides[k] != state["settings"].get(k)
    ]
    if changed:
        what = " and ".join(f"{k}={overrides[k]!r}" for k in changed)
        if spec == "plan":
            raise ConfigError(
                f"the saved state's plan was given by hand for the saved settings; with {what} "
                "pass checkpoint= (a Plan for them, or 'auto' to plan again)"
            )
        warnings.warn(
            f"resuming with {what}: the saved plan was made for the saved settings, so the "
            f"run is planned again ({spec!r}) on its first step",
            stacklevel=4,
        )
        return spec
    from memfit.checkpoint.plan import Plan

    return Plan.from_json(plan)


#: Settings an Engine loading a saved state must share with the run that saved it: they
#: decide what one step computes. The others (clipping, logging, budget) are the live ones.
MATCHING_SETTINGS = ("precision", "accumulation_steps")


def check_fresh_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ConfigError when ``optimizer`` already belongs to an Engine that keeps fp32
    master weights: a second Engine cannot make masters of masters."""
    if holds_master_weights(optimizer):
        raise ConfigError(
            "this optimizer already belongs to an Engine (it holds memfit's fp32 master "
            "weights); to continue that Engine from a saved state call engine.load(path), or "
            "build the model and optimizer afresh, as for the saved run, for Engine.resume"
        )


def check_settings(settings: EngineSettings, state: dict[str, Any], path: str | Path) -> None:
    """Raise ConfigError naming the first setting in :data:`MATCHING_SETTINGS` that differs
    between an Engine's ``settings`` and the saved state."""
    saved = state["settings"]
    for name in MATCHING_SETTINGS:
        live = getattr(settings, name)
        if saved[name] != live:
            raise ConfigError(
                f"saved state {path} was saved with {name}={saved[name]!r} but this Engine has "
                f"{name}={live!r}; make the Engine with {name}={saved[name]!r} to load it, or "
                f"use Engine.resume(path, model, optimizer, {name}=...) with a fresh model and "
                "optimizer to continue with another value"
            )


def load_state(objects: TrainingObjects, settings: EngineSettings, path: str | Path) -> LoadedState:
    """Load the state file at ``path`` into the objects an Engine trains as they are: the
    continuation is the one :meth:`Engine.resume` gives, bit for bit. Returns the counters
    and ``extra`` for the Engine to take.

    The Engine's own checkpoint plan (or the plan it has yet to make) is kept: a plan
    chooses what is recomputed, not what is computed, so the saved plan, if another, would
    change the memory and the speed but not one value. Gradients of a step in progress are
    dropped.

    Example::

        loaded = load_state(objects, engine.settings, "run/good.pt")
        loaded.counters.steps
    """
    state = read_state(path)
    check_settings(settings, state, path)
    objects.optimizer.zero_grad(set_to_none=True)
    objects.model.zero_grad(set_to_none=True)
    objects.scaler.discard_step()
    return load_engine_state(objects, settings, state, path)


def load_engine_state(
    objects: TrainingObjects, settings: EngineSettings, state: dict[str, Any], path: str | Path
) -> LoadedState:
    """Load a saved state into the objects an Engine trains: weights, masters, optimizer,
    scaler, scheduler and the random generators; return the counters and ``extra``.
    Raises ConfigError when the state does not fit the model or optimizer.

    Example::

        loaded = load_engine_state(objects, engine.settings, read_state(path), path)
    """
    saved = state["settings"]["precision"]
    if (state["master"] is None) != (objects.master is None):
        raise ConfigError(
            f"saved state {path} was saved with precision={saved!r}, which "
            f"{'keeps' if state['master'] is not None else 'keeps no'} fp32 master weights, "
            f"but this Engine has precision={settings.precision!r}; use a precision "
            f"that {'keeps' if state['master'] is not None else 'keeps no'} masters, e.g. "
            f"{saved!r}"
        )
    try:
        load_weights(
            state, path, unwrap_compiled(objects.model), objects.optimizer, objects.parallel_kind
        )
        if objects.master is not None:
            objects.master.load_state_dict(state["master"])
    except ConfigError:
        raise
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"saved state {path} does not fit this model/optimizer ({exc}); build them the "
            "same way as for the saved run"
        ) from exc
    objects.scaler.load_state_dict(state["scaler"])
    if objects.lr_scheduler is not None and state["lr_scheduler"] is not None:
        objects.lr_scheduler.load_state_dict(state["lr_scheduler"])
    elif state["lr_scheduler"] is not None:
        warnings.warn(
            f"saved state {path} holds LR scheduler state but no lr_scheduler was given; "
            "pass lr_scheduler= to continue the schedule",
            stacklevel=3,
        )
    counters = state["counters"]
    rng = rank_rng(state)
    torch.set_rng_state(rng["torch"])
    random.setstate(_to_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return LoadedState(
        StepCounters(
            steps=int(counters["steps"]),
            micro_steps=int(counters["micro_steps"]),
            applied_steps=int(counters["applied_steps"]),
        ),
        state.get("extra", {}),
    )


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _to_tuple(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def __getattr__(name: str) -> Any:
    # Renamed: the run directory's settings of ``memfit train --resume`` are another thing.
    if name == "resume_settings":
        warn_renamed("memfit.engine.state.resume_settings", "memfit.engine.state.read_resume_point")
        return read_resume_point
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
