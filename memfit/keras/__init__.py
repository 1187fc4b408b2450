"""memfit for Keras 3 models: precision policies, loss scaling, checkpoint planning, monitoring.

The same precision names, the same solver and :class:`memfit.Plan`, and the same metrics
and sinks as memfit's PyTorch path, on Keras's own primitives (dtype policies,
``LossScaleOptimizer``, ``keras.remat``). Needs the extra ``pip install 'memfit[keras]'``.

Nothing here imports TensorFlow or Keras until a name is used: ``import memfit`` and
``memfit.keras`` stay free of them. Importing ``memfit.keras`` sets
``TF_CPU_ALLOCATOR_USE_BFC=true`` (unless set) while TensorFlow has not started, even when
it is imported already, so that TensorFlow's CPU allocator counts every tensor the plans
and the callback measure (:mod:`memfit.keras.memory`). Example::

    import memfit

    with memfit.keras.precision("bf16-mixed"):
        model = build()  # normalization and the last layer stay float32
    optimizer = memfit.keras.wrap_optimizer(keras.optimizers.Adam(1e-3), "bf16-mixed")
    plan = memfit.keras.plan(model, x, y, "sparse_categorical_crossentropy", budget="64MiB")
    model = memfit.keras.apply_plan(model, plan)
    model.compile(optimizer, "sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[memfit.keras.MonitorCallback("runs/keras")])

See ``docs/keras.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from memfit.keras import memory as _memory

# TensorFlow reads the variable when it starts (its first tensor), not when it is imported:
# set here, at the first moment memfit.keras runs, so the usual order (tensorflow, keras,
# then memfit.keras, then the model) gets an allocator that counts.
_memory.request_counting_allocator()

# name -> the module that defines it (imported on first use)
_EXPORTS = {
    "KERAS_POLICIES": "memfit.keras.policy",
    "fp32_islands": "memfit.keras.policy",
    "keras_policy": "memfit.keras.policy",
    "precision": "memfit.keras.policy",
    "ScalerState": "memfit.keras.loss_scale",
    "scaler_state": "memfit.keras.loss_scale",
    "wrap_optimizer": "memfit.keras.loss_scale",
    "KerasProfile": "memfit.keras.profiling",
    "profile": "memfit.keras.profiling",
    "measure_step": "memfit.keras.profiling",
    "StepMeasurement": "memfit.keras.profiling",
    "plan": "memfit.keras.remat",
    "apply_plan": "memfit.keras.remat",
    "RematSegment": "memfit.keras.remat",
    "MonitorCallback": "memfit.keras.callback",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit.keras' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
