"""The Engine's settings: what it was made with, checked when it is made, saved with every training state."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.precision.optimizer_state import check_optimizer_state
from memfit.units import device_memory_bytes


@dataclass
class EngineSettings:
    """The settings an Engine was made with; saved with every training state."""

    precision: str = "auto"
    """Precision mode (resolved name; ``"auto"`` until the first micro-batch chose one)."""
    checkpoint: str = "none"
    """Activation checkpointing: "none", "auto", "full", "uniform:k", "sqrt", or "plan" for a given Plan."""
    memory_budget: int | None = None
    """Peak memory budget of a whole step in bytes, for planning; None = no budget."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    clip_grad_norm: float | None = None
    """Clip the unscaled gradients' total norm to this value; None = no clipping."""
    log_every: int = 10
    """Read metrics from the device every this many steps."""
    max_consecutive_skips: int = 50
    """Raise NonFiniteError after this many skipped steps in a row."""
    optimizer_state: str = "fp32"
    """How the optimizer keeps its state: "fp32" (as torch makes it), "bf16" or "8bit"
    (:mod:`memfit.precision.optimizer_state`)."""
    release_gradients: bool = False
    """Each update applied as its gradient is made in backward (:mod:`memfit.engine.release`);
    ``"auto"`` given to the Engine is resolved to where it is legal."""
    activation_storage: tuple[str, ...] = ("keep", "recompute")
    """What a plan may do with a kept unit's saved tensors (``"bf16"``, ``"fp8"``,
    ``"offload"`` beside keep and recompute: :mod:`memfit.checkpoint.storage_stage`)."""
    kernel_islands: tuple[str, ...] = ()
    """Modules trained as fp32 islands because their kind has no kernel in the precision's
    dtype on this device (an LSTM in bf16 on an AVX2-only CPU): found on the machine that
    trains, so a run resumed elsewhere finds them anew (not an Engine argument)."""


def check_arguments(
    *,
    accumulation_steps: Any,
    clip_grad_norm: Any,
    log_every: Any,
    max_consecutive_skips: Any,
    checkpoint: Any,
    memory_budget: Any,
    optimizer_state: Any = "fp32",
) -> None:
    """Raise ConfigError for an Engine argument no training could use, when the Engine is
    made rather than at the first step."""
    check_optimizer_state(optimizer_state)
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    if clip_grad_norm is not None and not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
        raise ConfigError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm}")
    if int(log_every) != log_every or log_every < 1:
        raise ConfigError(f"log_every must be an int >= 1, got {log_every}")
    if max_consecutive_skips < 1:
        raise ConfigError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
    if checkpoint is not None:  # not given: resolve_checkpoint picks it
        check_checkpoint_request(checkpoint)
    if isinstance(checkpoint, str) and checkpoint == "none" and memory_budget is not None:
        raise ConfigError(
            f"memory_budget={memory_budget!r} would be ignored with checkpoint='none': the "
            "budget is what checkpoint plans are made under. Leave checkpoint= out (a budget "
            "implies checkpoint='auto') or drop memory_budget"
        )


def resolve_checkpoint(checkpoint: Any, memory_budget: Any) -> Any:
    """The checkpoint request: ``checkpoint`` as given; when it was not given (None),
    ``"auto"`` with a ``memory_budget`` and ``"none"`` without.

    Example::

        resolve_checkpoint(None, "2GiB")  # "auto"
    """
    if checkpoint is None:
        return "none" if memory_budget is None else "auto"
    return checkpoint


def default_memory_budget(device: torch.device) -> int:
    """The budget planning uses when none was given: 90% of ``device``'s memory, leaving
    the rest to what the allocator and the libraries hold besides the step.

    Example::

        default_memory_budget(torch.device("cuda"))  # 0.9 x the GPU's memory, in bytes
    """
    return int(0.9 * device_memory_bytes(device))


def unit_names(model: nn.Module, units: Sequence[str | nn.Module] | None) -> list[str] | None:
    """The qualified names of ``units`` (names or submodules of ``model``), checked now
    rather than when the first step plans; None stays None (memfit finds the units).

    Example::

        unit_names(model, [model.encoder, "decoder.layers.0"])  # ["encoder", "decoder.layers.0"]
    """
    if units is None:
        return None
    if isinstance(units, (str, nn.Module)):
        units = [units]
    modules = dict(model.named_modules())
    by_id = {id(m): name for name, m in modules.items()}
    names: list[str] = []
    for unit in units:
        if isinstance(unit, nn.Module):
            if id(unit) not in by_id:
                raise ConfigError(
                    f"units= holds a {type(unit).__name__} that is not a submodule of the "
                    f"model ({type(model).__name__}); pass the model's own modules or their "
                    "names as model.named_modules() lists them"
                )
            name = by_id[id(unit)]
        elif isinstance(unit, str):
            name = unit
        else:
            raise ConfigError(
                f"units= takes module names or modules, got {type(unit).__name__}: {unit!r}"
            )
        if name not in modules:
            close = difflib.get_close_matches(name, list(modules), n=3)
            valid = [n for n in modules if n][:5]
            hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
            raise ConfigError(
                f"units= names {name!r}, which is not a submodule of {type(model).__name__}; "
                f"{hint}valid names include {', '.join(map(repr, valid))} "
                "(model.named_modules() lists them all; memfit.checkpoint.find_units(model) shows the "
                "units memfit finds itself)"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ConfigError("units= is empty; name the modules to plan, or leave units= out")
    return names


def check_checkpoint_request(checkpoint: Any) -> None:
    """A misspelt strategy fails when the Engine is made, not at the first step."""
    if isinstance(checkpoint, str):
        if checkpoint not in ("none", "auto"):
            from memfit.checkpoint.solvers import parse_strategy

            parse_strategy(checkpoint)
    elif not (hasattr(checkpoint, "decisions") and hasattr(checkpoint, "segments")):
        raise ConfigError(
            "checkpoint= takes a Plan or one of 'none', 'auto', 'optimal', 'full', "
            f"'uniform:k', 'sqrt'; got {type(checkpoint).__name__}"
        )
