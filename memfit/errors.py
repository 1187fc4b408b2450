"""The exceptions memfit raises. Each message says what was wrong and what to do."""

from __future__ import annotations


class MemfitError(Exception):
    """Base class of every error memfit raises on purpose."""


class ConfigError(MemfitError, ValueError):
    """A setting, flag or argument has a value memfit cannot use."""


class ScalerStateError(MemfitError, RuntimeError):
    """LossScaler methods were called in an order that would corrupt the step."""


class NonFiniteError(MemfitError, FloatingPointError):
    """Training produced non-finite values for too many steps in a row."""


class StateFileError(MemfitError, RuntimeError):
    """A saved training state (``Engine.save``) is missing, truncated, tampered with or
    from elsewhere."""


class PlanError(MemfitError, ValueError):
    """An activation-checkpointing plan cannot be made or applied."""


class BudgetError(PlanError):
    """A memory budget cannot be met by any plan."""


class DistributedError(MemfitError, RuntimeError):
    """Another rank of a data-parallel run failed, or the ranks disagree."""


def __getattr__(name: str) -> type[MemfitError]:
    # "checkpoint" names activation checkpointing only; saved state is a state file.
    if name == "CheckpointError":
        from memfit.deprecations import warn_renamed

        warn_renamed("memfit.errors.CheckpointError", "memfit.errors.StateFileError")
        return StateFileError
    raise AttributeError(f"module 'memfit.errors' has no attribute {name!r}")
