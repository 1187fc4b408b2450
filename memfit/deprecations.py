"""Old names that keep working for one release, each with a :class:`DeprecationWarning`.

Modules that moved are served under their old path by an import finder that hands back
the new module (one object under two names, so ``isinstance`` and pickles keep working);
renamed functions, classes and arguments go through :func:`warn_renamed`.

Example::

    from memfit.engine.planning import plan_stage   # warns: moved to memfit.engine.plan_stage
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: The release in which the old names stop working.
REMOVED_IN = "0.3"

#: Old module path -> where it lives now.
MOVED_MODULES: dict[str, str] = {
    "memfit.estimate": "memfit.estimator",
    "memfit.capacity": "memfit.capacity_view",
    "memfit.scaling": "memfit.interpolate",
    "memfit.engine.planning": "memfit.engine.plan_stage",
    "memfit.engine.parallel": "memfit.engine.data_parallel",
    "memfit.keras.planning": "memfit.keras.remat",
    "memfit.keras.scaling": "memfit.keras.loss_scale",
    "memfit.precision.timing": "memfit.precision.mode_timing",
    "memfit.tuning.advice": "memfit.tuning.hints",
    "memfit.distributed.checkpoint": "memfit.distributed.state_files",
    "memfit.cli.train": "memfit.cli.train_command",
    "memfit.cli.plan": "memfit.cli.plan_command",
    "memfit.cli.estimate": "memfit.cli.estimate_command",
    "memfit.cli.tune": "memfit.cli.tune_command",
    "memfit.cli.report": "memfit.cli.report_command",
    "memfit.checkpoint.solvers.evaluate": "memfit.checkpoint.solvers.plan_cost",
}


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now ``new`` and goes away in :data:`REMOVED_IN`.

    Example::

        warn_renamed("memfit.CheckpointError", "memfit.errors.StateFileError")
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in memfit {REMOVED_IN}; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class _Alias(importlib.abc.Loader):
    """Loads an old module path as the module that replaced it."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module ran under its new name; running it again would make a second copy.
        # The import system stamped the old name's spec on it: give it back its own.
        module.__spec__ = self.own_spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        # Warn at the import statement, not in the import machinery's frames.
        warnings.warn(
            f"module {fullname} is deprecated and will be removed in memfit {REMOVED_IN}; "
            f"import {new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Serve the moved modules under their old paths (idempotent; ``import memfit`` runs it)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
