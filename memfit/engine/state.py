"""The Engine's checkpoint: everything needed to continue exactly, and loading it back.

The state holds the settings, the model's state dict, the fp32 masters, the optimizer,
the loss scaler, the LR scheduler, every random generator, the step counters and the
plan. It is written atomically by :func:`memfit.savefile.atomic_save`.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

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
    return {
        "settings": asdict(engine.settings),
        "model": engine.model.state_dict(),
        "master": engine.master.state_dict() if engine.master is not None else None,
        "optimizer": engine.optimizer.state_dict(),
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


def saved_plan(state: dict[str, Any]) -> Any:
    """The checkpoint request a saved state resumes with: its Plan, or its saved spec."""
    plan = state.get("plan")
    if plan is None:
        return state["settings"]["checkpoint"]
    from memfit.checkpoint.plan import Plan

    return Plan.from_json(plan)


def load_engine_state(engine: Engine, state: dict[str, Any], path: str | Path) -> None:
    """Load a saved state into ``engine``: weights, masters, optimizer, scaler, scheduler,
    counters, random generators and ``extra``. Raises ConfigError when the checkpoint does
    not fit the model or optimizer."""
    try:
        engine.model.load_state_dict(state["model"])
        if engine.master is not None:
            engine.master.load_state_dict(state["master"])
        engine.optimizer.load_state_dict(state["optimizer"])
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
    rng = state["rng"]
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
