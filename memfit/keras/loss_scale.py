"""Loss scaling for Keras: :func:`wrap_optimizer` and the scale read for monitoring.

For ``fp16-mixed`` the optimizer is wrapped in Keras's ``LossScaleOptimizer`` with memfit's
scaler settings where Keras can express them. Keras's dynamic scale skips (does not apply)
a step whose gradients hold inf or NaN and halves the scale; after ``growth_interval``
finite steps in a row it doubles it. Its factors are fixed at 2 and 1/2, it has no
hysteresis and no bounds, so other settings are refused. ``model.fit`` scales the loss
itself when the optimizer is a ``LossScaleOptimizer``; a custom loop calls
``optimizer.scale_loss(loss)`` and applies the scaled gradients with
``optimizer.apply(grads, variables)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.errors import ConfigError
from memfit.keras.backend import keras
from memfit.keras.policy import keras_policy

__all__ = ["KERAS_CAN", "ScalerState", "scaler_state", "wrap_optimizer"]

#: What Keras's LossScaleOptimizer can do, said in the errors.
KERAS_CAN = (
    "Keras's LossScaleOptimizer can set init_scale (any positive number) and "
    "growth_interval (an int >= 1); its growth_factor is 2.0 and its backoff_factor 0.5, "
    "with hysteresis=1 and no min_scale or max_scale (pass None for them)"
)


def wrap_optimizer(
    optimizer: keras.optimizers.Optimizer,
    mode: str,
    init_scale: float = 8192.0,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    hysteresis: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> keras.optimizers.Optimizer:
    """``optimizer`` wrapped for precision ``mode``: a ``LossScaleOptimizer`` starting at
    ``init_scale`` and growing after ``growth_interval`` finite steps for ``fp16-mixed``;
    ``optimizer`` itself for ``fp32`` and ``bf16-mixed`` (no scaling needed).

    The settings are memfit's :class:`~memfit.precision.LossScaler`'s; those Keras cannot express
    (another growth or backoff factor, hysteresis above 1, a min or max scale) raise a
    ConfigError that lists what it can.

    Example::

        optimizer = wrap_optimizer(keras.optimizers.Adam(1e-3), "fp16-mixed")
        optimizer.initial_scale   # 8192.0
    """
    policy = keras_policy(mode)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"wrap_optimizer needs a Keras optimizer (keras.optimizers.Adam(...), ...), got "
            f"{type(optimizer).__name__}"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError(
            "this optimizer is a LossScaleOptimizer already; pass the optimizer it wraps "
            "(optimizer.inner_optimizer)"
        )
    refused = []
    if growth_factor != 2.0:
        refused.append(f"growth_factor={growth_factor!r}")
    if backoff_factor != 0.5:
        refused.append(f"backoff_factor={backoff_factor!r}")
    if hysteresis != 1:
        refused.append(f"hysteresis={hysteresis!r}")
    if min_scale is not None:
        refused.append(f"min_scale={min_scale!r}")
    if max_scale is not None:
        refused.append(f"max_scale={max_scale!r}")
    if refused:
        raise ConfigError(f"cannot scale with {', '.join(refused)}: {KERAS_CAN}")
    bad_scale = isinstance(init_scale, bool) or not isinstance(init_scale, (int, float))
    if bad_scale or not (math.isfinite(init_scale) and init_scale > 0):
        raise ConfigError(f"init_scale must be a positive finite number, got {init_scale!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise ConfigError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    if growth_interval < 1:
        raise ConfigError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    if policy != "mixed_float16":
        return optimizer
    return keras.optimizers.LossScaleOptimizer(
        optimizer, initial_scale=float(init_scale), dynamic_growth_steps=int(growth_interval)
    )


@dataclass(frozen=True)
class ScalerState:
    """The loss scale and the step counters of an optimizer, read from its variables."""

    scale: float | None
    """The current loss scale, or None when the optimizer does not scale."""
    iterations: int
    """Optimizer steps applied (Keras counts only applied steps)."""
    growth_tracker: int
    """Finite steps since the scale last changed (None-scaling: 0)."""


def scaler_state(optimizer: keras.optimizers.Optimizer) -> ScalerState:
    """Read the scale and counters of ``optimizer`` (one device read each).

    Skipped steps are not counted by Keras: a step is skipped when the optimizer's
    ``iterations`` did not move, which :class:`memfit.keras.MonitorCallback` counts.

    Example::

        scaler_state(optimizer).scale   # 8192.0 before the first step
    """
    iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return ScalerState(None, iterations, 0)
    if not optimizer.built:
        return ScalerState(float(optimizer.initial_scale), iterations, 0)
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    tracker = int(keras.ops.convert_to_numpy(optimizer.step_counter))
    return ScalerState(scale, iterations, tracker)


def optimizer_scales(optimizer: Any) -> bool:
    """Whether ``optimizer`` scales the loss (a ``LossScaleOptimizer``)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
