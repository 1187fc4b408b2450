"""Checkpoint solvers: from a tree of unit costs to recompute decisions and a predicted peak.

Pure Python on plain cost tables (:class:`~memfit.checkpoint.costs.UnitCost`), with no
framework import, so the same planner can drive any recompute primitive.

Strategies (``docs/planner.md`` states them in full):

``"none"``        keep every activation.
``"full"``        recompute every *block* (see below) on its own.
``"uniform:k"``   segments of ``k`` consecutive blocks in chains memfit iterates
                  (``sequential`` units); blocks one by one elsewhere. ``"uniform"`` picks
                  ``k`` per chain from its length.
``"sqrt"``        about ``sqrt(n)`` memory-balanced segments per chain of ``n`` blocks
                  (Chen et al. 2016).
``"optimal"``     the cheapest plan under the budget: a dynamic programme that walks the
                  tree in forward order carrying the Pareto frontier of (bytes kept so far,
                  recompute time), exact under the cost model.

*Blocks*: a *chain* is a unit with two or more children. Walking down from the root,
the blocks are the outermost recomputable units whose parent is a chain. A single-child
unit is looked through, and so are ``sequential`` containers with two or more children
(the container only iterates; its children are the blocks) and units that cannot be
recomputed (their recomputable descendants are looked for instead).

With a budget, ``"uniform"`` and ``"sqrt"`` checkpoint only as many blocks as they need
(in forward order, so the earliest blocks first); ``"full"`` and ``"none"`` only check
that their plan fits. Every strategy returns the no-checkpoint plan when the budget is at
or above its peak.

The modules:

``api``         :func:`solve`, the entry point.
``nodes``       the cost tree flattened for the solvers (``FlatUnit``), and its chains.
``plan_cost``   a plan's cost under the model (:func:`plan_cost`, :class:`Evaluation`).
``fixed``       strategy names (:func:`parse_strategy`) and the fixed strategies.
``optimal``     the optimal strategy: ``search`` (the walks), ``blocks`` (block by block),
                ``limits`` (their work limits).
``frontier``    :class:`FrontierPoint` and the search's own points.
``solution``    :class:`Solution`.
``messages``    the notes and budget errors' texts.
"""

from collections.abc import Callable
from typing import Any

from memfit.checkpoint.costs import Decision
from memfit.checkpoint.solvers.api import solve
from memfit.checkpoint.solvers.fixed import STRATEGIES, parse_strategy
from memfit.checkpoint.solvers.frontier import FrontierPoint
from memfit.checkpoint.solvers.plan_cost import Evaluation, plan_cost
from memfit.checkpoint.solvers.solution import Solution
from memfit.deprecations import warn_renamed

__all__ = [
    "STRATEGIES",
    "Decision",
    "Evaluation",
    "FrontierPoint",
    "Solution",
    "parse_strategy",
    "plan_cost",
    "solve",
]


def __getattr__(name: str) -> Callable[..., Any]:
    # ``memfit.evaluate`` is the Engine's evaluation; a plan's cost is ``plan_cost``.
    if name == "evaluate":
        warn_renamed("memfit.checkpoint.solvers.evaluate", "memfit.checkpoint.solvers.plan_cost")
        return plan_cost
    raise AttributeError(f"module 'memfit.checkpoint.solvers' has no attribute {name!r}")
