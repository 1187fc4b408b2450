"""memfit: make PyTorch training fit in the memory you have, and run faster."""

from memfit.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    MemfitError,
    NonFiniteError,
    PlanError,
    ScalerStateError,
)
from memfit.precision.policy import PrecisionPolicy
from memfit.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "CheckpointError",
    "ConfigError",
    "MemfitError",
    "NonFiniteError",
    "PlanError",
    "PrecisionPolicy",
    "ScalerStateError",
    "format_bytes",
    "parse_bytes",
]
