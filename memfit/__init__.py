"""memfit: make PyTorch training fit in the memory you have, and run faster."""

from memfit.engine import Engine
from memfit.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    MemfitError,
    NonFiniteError,
    PlanError,
    ScalerStateError,
)
from memfit.memory import MemoryReport, measure
from memfit.precision import LossScaler, PrecisionPolicy, apply_precision, remove_precision
from memfit.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "LossScaler",
    "MemoryReport",
    "MemfitError",
    "NonFiniteError",
    "PlanError",
    "PrecisionPolicy",
    "ScalerStateError",
    "apply_precision",
    "format_bytes",
    "measure",
    "parse_bytes",
    "remove_precision",
]
