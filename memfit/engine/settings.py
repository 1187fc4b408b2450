"""The Engine's settings: what it was made with, checked when it is made, saved in every checkpoint."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.errors import ConfigError


@dataclass
class EngineSettings:
    """The settings an Engine was made with; saved in every checkpoint."""

    precision: str = "bf16-mixed"
    """Precision mode (resolved name)."""
    checkpoint: str = "none"
    """Checkpoint spec: "none", "auto", "full", "uniform:k", "sqrt", or "plan" for a given Plan."""
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


def check_arguments(
    *,
    accumulation_steps: Any,
    clip_grad_norm: Any,
    log_every: Any,
    max_consecutive_skips: Any,
    checkpoint: Any,
) -> None:
    """Raise ConfigError for an Engine argument no training could use, when the Engine is
    made rather than at the first step."""
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ConfigError(f"accumulation_steps must be an int >= 1, got {accumulation_steps}")
    if clip_grad_norm is not None and not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
        raise ConfigError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm}")
    if int(log_every) != log_every or log_every < 1:
        raise ConfigError(f"log_every must be an int >= 1, got {log_every}")
    if max_consecutive_skips < 1:
        raise ConfigError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
    check_checkpoint_request(checkpoint)


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
