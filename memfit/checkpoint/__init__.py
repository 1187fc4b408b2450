"""Activation checkpointing: find units, profile them, plan under a budget, apply in place."""

from memfit.checkpoint.api import plan, plan_step
from memfit.checkpoint.apply import apply_plan, is_applied, planned, remove_plan
from memfit.checkpoint.costs import UnitCost
from memfit.checkpoint.plan import Plan
from memfit.checkpoint.profile import Profile, profile
from memfit.checkpoint.solvers import FrontierPoint, Solution, solve
from memfit.checkpoint.tree import UnitTree, find_units, structure_fingerprint

__all__ = [
    "FrontierPoint",
    "Plan",
    "Profile",
    "Solution",
    "UnitCost",
    "UnitTree",
    "apply_plan",
    "find_units",
    "is_applied",
    "plan",
    "plan_step",
    "planned",
    "profile",
    "remove_plan",
    "solve",
    "structure_fingerprint",
]
