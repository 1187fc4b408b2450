"""memfit: make PyTorch training fit in the memory you have, and run faster.

The public names load on first use (PEP 562), so ``import memfit`` and ``memfit --help``
do not pay for torch and the planner until a name is used::

    import memfit                  # light: nothing below is imported yet
    engine = memfit.Engine(...)    # imports memfit.engine (and torch) here
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from memfit.version import __version__

if TYPE_CHECKING:
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

#: Where each public name lives (the module imported on its first use).
_SOURCES: dict[str, str] = {
    **dict.fromkeys(("Capacity", "capacity"), "memfit.capacity"),
    **dict.fromkeys(
        ("Plan", "apply_plan", "find_units", "plan", "remove_plan"), "memfit.checkpoint"
    ),
    "parallelize": "memfit.distributed",
    **dict.fromkeys(("Engine", "evaluate"), "memfit.engine"),
    **dict.fromkeys(
        (
            "BudgetError",
            "CheckpointError",
            "ConfigError",
            "DistributedError",
            "MemfitError",
            "NonFiniteError",
            "PlanError",
            "ScalerStateError",
        ),
        "memfit.errors",
    ),
    **dict.fromkeys(("Estimate", "estimate"), "memfit.estimate"),
    **dict.fromkeys(("MemoryReport", "measure"), "memfit.memory"),
    "MonitorConfig": "memfit.monitor.monitor",
    **dict.fromkeys(
        ("LossScaler", "PrecisionPolicy", "apply_precision", "remove_precision"),
        "memfit.precision",
    ),
    **dict.fromkeys(("TuneResult", "run_advice", "tune"), "memfit.tuning"),
    **dict.fromkeys(("format_bytes", "parse_bytes"), "memfit.units"),
}


def __getattr__(name: str) -> Any:
    # A public name: imported from its module and kept, so the next use is a plain lookup.
    source = _SOURCES.get(name)
    if source is not None:
        value = getattr(importlib.import_module(source), name)
        globals()[name] = value
        return value
    if name.startswith("__"):  # probes such as __wrapped__ or __path__: never a submodule
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    # A submodule (memfit.keras, memfit.checkpoint, ...): imported on first use, as an
    # eager package would have them; memfit.keras is how TensorFlow stays out until asked.
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The memfit module, keeping ``memfit.estimate`` and ``memfit.capacity`` the functions.

    Importing a submodule sets it as an attribute of its package; two submodules share a
    name with the function they define, and the function is the public name.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _SOURCES:
            if value.__name__ == f"{__name__}.{name}":
                value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
