"""memfit: make PyTorch training fit in the memory you have, and run faster.

The public names load on first use (PEP 562), so ``import memfit`` and ``memfit --help``
do not pay for torch and the planner until a name is used::

    import memfit                  # light: nothing below is imported yet
    engine = memfit.Engine(...)    # imports memfit.engine (and torch) here

``__all__`` is what a training script uses daily; everything else lives in its module
(``memfit.errors``, ``memfit.precision``, ``memfit.checkpoint``, ``memfit.units``, ...), all
listed in docs/reference.md.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from memfit import deprecations
from memfit.version import __version__

if TYPE_CHECKING:
    from memfit.capacity_view import capacity
    from memfit.checkpoint import Plan, apply_plan, plan, remove_plan
    from memfit.distributed import parallelize
    from memfit.engine import Engine, evaluate
    from memfit.errors import MemfitError
    from memfit.estimator import Estimate, estimate
    from memfit.memory import measure
    from memfit.monitor.monitor import MonitorConfig
    from memfit.precision import PrecisionPolicy
    from memfit.tuning import TuneResult, tune
    from memfit.workload import Workload

__all__ = [
    "__version__",
    "Engine",
    "Estimate",
    "MemfitError",
    "MonitorConfig",
    "Plan",
    "PrecisionPolicy",
    "TuneResult",
    "Workload",
    "apply_plan",
    "capacity",
    "estimate",
    "evaluate",
    "measure",
    "parallelize",
    "plan",
    "remove_plan",
    "tune",
]

#: Where each public name lives (the module imported on its first use).
_SOURCES: dict[str, str] = {
    "capacity": "memfit.capacity_view",
    **dict.fromkeys(("Plan", "apply_plan", "plan", "remove_plan"), "memfit.checkpoint"),
    "parallelize": "memfit.distributed",
    **dict.fromkeys(("Engine", "evaluate"), "memfit.engine"),
    "MemfitError": "memfit.errors",
    **dict.fromkeys(("Estimate", "estimate"), "memfit.estimator"),
    "measure": "memfit.memory",
    "MonitorConfig": "memfit.monitor.monitor",
    "PrecisionPolicy": "memfit.precision",
    **dict.fromkeys(("TuneResult", "tune"), "memfit.tuning"),
    "Workload": "memfit.workload",
}

#: Names that were public here and now live only in their module: each still works as
#: ``memfit.NAME`` for one release, with a DeprecationWarning naming the module.
_MOVED: dict[str, str] = {
    "Capacity": "memfit.capacity_view",
    **dict.fromkeys(
        (
            "BudgetError",
            "ConfigError",
            "DistributedError",
            "NonFiniteError",
            "PlanError",
            "ScalerStateError",
            "StateFileError",
        ),
        "memfit.errors",
    ),
    **dict.fromkeys(("LossScaler", "apply_precision", "remove_precision"), "memfit.precision"),
    "find_units": "memfit.checkpoint",
    **dict.fromkeys(("format_bytes", "parse_bytes"), "memfit.units"),
    "MemoryReport": "memfit.memory",
    "run_advice": "memfit.tuning",
}


def __getattr__(name: str) -> Any:
    # A public name: imported from its module and kept, so the next use is a plain lookup.
    source = _SOURCES.get(name)
    if source is not None:
        value = getattr(importlib.import_module(source), name)
        globals()[name] = value
        return value
    # A demoted name: not kept, so that every use warns.
    if name in _MOVED:
        deprecations.warn_renamed(f"memfit.{name}", f"{_MOVED[name]}.{name}")
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name == "CheckpointError":  # saved training state is a "state file" now
        deprecations.warn_renamed("memfit.CheckpointError", "memfit.errors.StateFileError")
        return importlib.import_module("memfit.errors").StateFileError
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
    """The memfit module, whose ``estimate`` and ``capacity`` stay the functions.

    Importing a module binds it on its package; the old paths ``memfit.estimate`` and
    ``memfit.capacity`` (modules renamed, :mod:`memfit.deprecations`) name functions here.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ != f"{__name__}.{name}":
            return  # an old module path served by the deprecation finder: not an attribute
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
deprecations.install()
