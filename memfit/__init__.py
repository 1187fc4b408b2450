"""memfit: make PyTorch training fit in the memory you have, and run faster."""

from memfit.capacity import Capacity, capacity
from memfit.checkpoint import Plan, apply_plan, find_units, plan, remove_plan
from memfit.distributed import parallelize
from memfit.engine import Engine, evaluate
from memfit.errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    DistributedError,
    MemfitError,
    NonFiniteError,
    PlanError,
    ScalerStateError,
)
from memfit.estimate import Estimate, estimate
from memfit.memory import MemoryReport, measure
from memfit.monitor.monitor import MonitorConfig
from memfit.precision import LossScaler, PrecisionPolicy, apply_precision, remove_precision
from memfit.tuning import TuneResult, run_advice, tune
from memfit.units import format_bytes, parse_bytes
from memfit.version import __version__

__all__ = [
    "__version__",
    "BudgetError",
    "Capacity",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "Engine",
    "Estimate",
    "LossScaler",
    "MemoryReport",
    "MonitorConfig",
    "MemfitError",
    "NonFiniteError",
    "Plan",
    "PlanError",
    "PrecisionPolicy",
    "ScalerStateError",
    "TuneResult",
    "apply_plan",
    "apply_precision",
    "capacity",
    "estimate",
    "evaluate",
    "find_units",
    "format_bytes",
    "measure",
    "parallelize",
    "plan",
    "remove_plan",
    "parse_bytes",
    "remove_precision",
    "run_advice",
    "tune",
]


def __getattr__(name: str) -> object:
    # memfit.keras (the Keras front end, extra memfit[keras]) on first use, so that
    # `import memfit` never imports TensorFlow or Keras.
    if name == "keras":
        import importlib

        return importlib.import_module("memfit.keras")
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
