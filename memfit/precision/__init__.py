"""Mixed precision: policies, loss scaling, fp32 master weights."""

from memfit.precision.apply import apply_precision, precision_applied, remove_precision
from memfit.precision.master import MasterWeights
from memfit.precision.policy import ALIASES, MODES, PrecisionPolicy, resolve_mode
from memfit.precision.scaler import LossScaler, ScalerStats

__all__ = [
    "ALIASES",
    "MODES",
    "LossScaler",
    "MasterWeights",
    "PrecisionPolicy",
    "ScalerStats",
    "apply_precision",
    "precision_applied",
    "remove_precision",
    "resolve_mode",
]
