"""The Engine's checkpoint: everything needed to continue exactly, and loading it back.

The state holds the settings, the model's state dict, the fp32 masters, the optimizer,
the loss scaler, the LR scheduler, every random generator, the step counters and the
plan. It is written atomically by :func:`memfit.savefile.atomic_save`. In a data-parallel
run rank 0 writes that file (DDP), or every rank its shard of a directory (FSDP2); see
:mod:`memfit.distributed.checkpoint`.

Two ways back: :meth:`Engine.resume` builds a new Engine over a freshly built model and
optimizer with the saved settings and plan; :meth:`Engine.load` (:func:`load_checkpoint`)
loads into an Engine that already exists, whose settings must then match the saved ones.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memfit.checkpoint.compiled import unwrap_compiled
from memfit.distributed.checkpoint import load_weights, rank_rng, read_checkpoint, save_checkpoint
from memfit.distributed.parallel import local_module
from memfit.errors import ConfigError

if TYPE_CHECKING:
    from memfit.engine.core import Engine


def engine_state(engine: Engine) -> dict[str, Any]:
    """The checkpoint of ``engine`` as a plain dict (tensors included, nothing copied)."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _python_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    plan = engine.plan
    if plan is None and not isinstance(engine._checkpoint_request, str | None):
        plan = engine._checkpoint_request  # a Plan given, saved before the first step
    # FSDP2's shards are written by torch.distributed.checkpoint, not in this dict.
    sharded = engine.parallel is not None and engine.parallel.kind == "fsdp"
    return {
        "settings": asdict(engine.settings),
        # The module inside torch.compile's wrapper: keys without ``_orig_mod.``, so a
        # checkpoint moves between a compiled and an uncompiled model.
        # Under DDP the wrapped module's: the keys of the plain model.
        "model": None if sharded else local_module(unwrap_compiled(engine.model)).state_dict(),
        "master": engine.master.state_dict() if engine.master is not None else None,
        "optimizer": None if sharded else engine.optimizer.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict()
        if engine.lr_scheduler is not None
        else None,
        "rng": rng,
        "counters": {
            "steps": engine.steps,
            "micro_steps": engine.micro_steps,
            "applied_steps": engine.applied_steps,
        },
        "plan": plan.to_json() if plan is not None and hasattr(plan, "to_json") else None,
    }


def save_state(engine: Engine, state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` (:func:`engine_state` with ``extra``) for ``engine``: atomically to
    one file, by rank 0 in a data-parallel run, or sharded into a directory under FSDP2."""
    kind = engine.parallel.kind if engine.parallel is not None else None
    return save_checkpoint(state, path, engine.model, engine.optimizer, kind)


def resume_settings(
    path: str | Path, optimizer: torch.optim.Optimizer, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint at ``path`` and the Engine settings :meth:`Engine.resume` builds
    with: the saved ones, the ``checkpoint`` request (:func:`saved_plan`), ``overrides``."""
    check_fresh_optimizer(optimizer)
    state = read_checkpoint(path)
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
    return state, settings


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
                f"the checkpoint's plan was given by hand for the saved settings; with {what} "
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


#: Settings an Engine loading a checkpoint must share with the run that saved it: they
#: decide what one step computes. The others (clipping, logging, budget) are the live ones.
MATCHING_SETTINGS = ("precision", "accumulation_steps")


def check_fresh_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ConfigError when ``optimizer`` already belongs to an Engine that keeps fp32
    master weights: a second Engine cannot make masters of masters."""
    if any(
        getattr(p, "_memfit_master", False) for g in optimizer.param_groups for p in g["params"]
    ):
        raise ConfigError(
            "this optimizer already belongs to an Engine (it holds memfit's fp32 master "
            "weights); to continue that Engine from a checkpoint call engine.load(path), or "
            "build the model and optimizer afresh, as for the saved run, for Engine.resume"
        )


def check_settings(engine: Engine, state: dict[str, Any], path: str | Path) -> None:
    """Raise ConfigError naming the first setting in :data:`MATCHING_SETTINGS` that differs
    between ``engine`` and the checkpoint."""
    saved = state["settings"]
    for name in MATCHING_SETTINGS:
        live = getattr(engine.settings, name)
        if saved[name] != live:
            raise ConfigError(
                f"checkpoint {path} was saved with {name}={saved[name]!r} but this Engine has "
                f"{name}={live!r}; make the Engine with {name}={saved[name]!r} to load it, or "
                f"use Engine.resume(path, model, optimizer, {name}=...) with a fresh model and "
                "optimizer to continue with another value"
            )


def load_checkpoint(engine: Engine, path: str | Path) -> None:
    """Load the checkpoint at ``path`` into ``engine`` as it is: the continuation is the one
    :meth:`Engine.resume` gives, bit for bit.

    The Engine's own checkpoint plan (or the plan it has yet to make) is kept: a plan
    chooses what is recomputed, not what is computed, so the saved plan, if another, would
    change the memory and the speed but not one value. Gradients of a step in progress are
    dropped.
    """
    state = read_checkpoint(path)
    check_settings(engine, state, path)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.model.zero_grad(set_to_none=True)
    engine.scaler.discard_step()
    load_engine_state(engine, state, path)


def load_engine_state(engine: Engine, state: dict[str, Any], path: str | Path) -> None:
    """Load a saved state into ``engine``: weights, masters, optimizer, scaler, scheduler,
    counters, random generators and ``extra``. Raises ConfigError when the checkpoint does
    not fit the model or optimizer."""
    saved = state["settings"]["precision"]
    if (state["master"] is None) != (engine.master is None):
        raise ConfigError(
            f"checkpoint {path} was saved with precision={saved!r}, which "
            f"{'keeps' if state['master'] is not None else 'keeps no'} fp32 master weights, "
            f"but this Engine has precision={engine.settings.precision!r}; use a precision "
            f"that {'keeps' if state['master'] is not None else 'keeps no'} masters, e.g. "
            f"{saved!r}"
        )
    kind = engine.parallel.kind if engine.parallel is not None else None
    try:
        load_weights(state, path, unwrap_compiled(engine.model), engine.optimizer, kind)
        if engine.master is not None:
            engine.master.load_state_dict(state["master"])
    except ConfigError:
        raise
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"checkpoint {path} does not fit this model/optimizer ({exc}); build them the "
            "same way as for the saved run"
        ) from exc
    engine.scaler.load_state_dict(state["scaler"])
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    elif state["lr_scheduler"] is not None:
        warnings.warn(
            f"checkpoint {path} holds LR scheduler state but no lr_scheduler was given; "
            "pass lr_scheduler= to continue the schedule",
            stacklevel=3,
        )
    counters = state["counters"]
    engine.steps = int(counters["steps"])
    engine.micro_steps = int(counters["micro_steps"])
    engine._applied_steps.fill_(int(counters["applied_steps"]))
    engine._last_loss = None
    engine._grad_norm = None
    rng = rank_rng(state)
    torch.set_rng_state(rng["torch"])
    random.setstate(_to_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    engine.extra = state.get("extra", {})


def _python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _to_tuple(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
