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


class CheckpointError(MemfitError, RuntimeError):
    """A checkpoint file is missing, truncated, tampered with or from elsewhere."""


class PlanError(MemfitError, ValueError):
    """A checkpoint plan cannot be made or applied."""


class BudgetError(PlanError):
    """A memory budget cannot be met by any plan."""


class DistributedError(MemfitError, RuntimeError):
    """Another rank of a data-parallel run failed, or the ranks disagree."""
