"""Activation checkpointing: find units, profile them, plan under a budget, apply in place.

``plan(model, batch, loss_fn, budget=...)`` (``memfit.plan``) makes a :class:`Plan`;
``make_plan`` the same with the stages' results (:class:`PlanResult`). ``plan_step`` is the
old name of ``plan`` for a ``loss_fn(model, batch)``, kept for one release.
"""

from memfit.checkpoint.api import make_plan, plan
from memfit.checkpoint.api import plan_step as plan_step  # deprecated: memfit.plan
from memfit.checkpoint.apply import apply_plan, is_applied, planned, remove_plan, suspended
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.planner import PlanResult
from memfit.checkpoint.profiler import Profile, profile
from memfit.checkpoint.solvers import FrontierPoint, Solution, solve
from memfit.checkpoint.tree import UnitTree, find_units, structure_fingerprint

__all__ = [
    "FrontierPoint",
    "Plan",
    "PlanResult",
    "Profile",
    "Solution",
    "UnitCost",
    "UnitTree",
    "apply_plan",
    "find_units",
    "is_applied",
    "make_plan",
    "plan",
    "planned",
    "profile",
    "remove_plan",
    "solve",
    "structure_fingerprint",
    "suspended",
]
