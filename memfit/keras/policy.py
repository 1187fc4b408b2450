"""memfit's precision names as Keras dtype policies, with float32 islands.

=============  ==================  ===============================================
memfit mode    Keras dtype policy  what it means
=============  ==================  ===============================================
``fp32``       ``float32``         float32 weights and compute
``bf16-mixed`` ``mixed_bfloat16``  float32 variables (the masters), bfloat16 compute
``fp16-mixed`` ``mixed_float16``   the same in float16; scale the loss
                                   (:func:`memfit.keras.wrap_optimizer`)
=============  ==================  ===============================================

Keras keeps every variable in float32 under a mixed policy and casts it to the compute
dtype when a layer uses it, so the masters are Keras's own variables; memfit's
``*-master`` modes (16-bit weights) have no Keras policy and are refused.

Under a mixed policy, normalization layers and each model's last layer are kept in float32
(their policy is ``float32``: inputs are cast up, statistics and the output are float32),
as memfit's PyTorch path keeps its fp32 islands and as Keras's mixed precision guide
advises for the output layer.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import ConfigError
from memfit.keras.backend import keras
from memfit.precision.policy import resolve_mode

__all__ = [
    "KERAS_POLICIES",
    "PrecisionScope",
    "fp32_islands",
    "keras_policy",
    "precision",
    "precision_of",
]

#: memfit precision mode -> Keras dtype policy name.
KERAS_POLICIES: dict[str, str] = {
    "fp32": "float32",
    "bf16-mixed": "mixed_bfloat16",
    "fp16-mixed": "mixed_float16",
}

#: Layer types kept in float32 under a mixed policy.
NORMALIZATION_LAYERS: tuple[type, ...] = tuple(
    getattr(keras.layers, name)
    for name in (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "RMSNormalization",
        "UnitNormalization",
        "SpectralNormalization",
    )
    if hasattr(keras.layers, name)
)


def keras_policy(mode: str) -> str:
    """The Keras dtype policy name for memfit's precision ``mode`` (or an alias).

    Example::

        keras_policy("bf16")        # "mixed_bfloat16"
        keras_policy("fp16-mixed")  # "mixed_float16"
    """
    resolved = resolve_mode(mode)
    policy = KERAS_POLICIES.get(resolved)
    if policy is None:
        raise ConfigError(
            f"precision {mode!r} ({resolved}) has no Keras dtype policy: Keras keeps float32 "
            f"variables under its mixed policies, so the masters are its own variables. Use "
            f"one of {', '.join(KERAS_POLICIES)}."
        )
    return policy


def precision_of(layers: Sequence[Any]) -> str:
    """memfit's precision mode that ``layers`` compute in: the mixed mode of the 16-bit
    dtype any of them computes in, else ``fp32``.

    Example::

        precision_of(model.layers)   # "bf16-mixed"
    """
    dtypes = {getattr(layer, "compute_dtype", "float32") for layer in layers}
    for mode in ("fp16-mixed", "bf16-mixed"):
        if keras_policy(mode).removeprefix("mixed_") in dtypes:
            return mode
    return "fp32"


def fp32_islands(model: keras.Model, final: bool = True) -> list[str]:
    """Set the normalization layers of ``model`` (nested ones too) and, with ``final``,
    the layers that make its outputs to the ``float32`` policy; return their names.

    A layer already float32, or a model under float32, is left alone. Applied by
    :func:`precision` to the models built inside it; call it for a model built otherwise.

    Example::

        keras.config.set_dtype_policy("mixed_bfloat16")
        model = build()
        fp32_islands(model)   # ["layer_normalization", "logits"]
    """
    changed: list[str] = []

    def keep(layer: keras.layers.Layer) -> None:
        if layer.dtype_policy.compute_dtype != "float32" and not isinstance(
            layer, keras.layers.InputLayer
        ):
            layer.dtype_policy = "float32"
            changed.append(layer.name)

    for layer in _all_layers(model):
        if isinstance(layer, NORMALIZATION_LAYERS):
            keep(layer)
    if final:
        for layer in _output_layers(model):
            keep(layer)
    return changed


def _all_layers(layer: keras.layers.Layer) -> Iterator[keras.layers.Layer]:
    yield from layer._flatten_layers(include_self=False, recursive=True)


def _output_layers(model: keras.Model) -> list[keras.layers.Layer]:
    outputs = getattr(model, "outputs", None)
    if outputs:  # Functional, and Sequential once built
        layers = [t._keras_history.operation for t in keras.tree.flatten(outputs)]
        return [layer for layer in layers if isinstance(layer, keras.layers.Layer)]
    layers = [layer for layer in getattr(model, "layers", []) if layer is not model]
    return layers[-1:]


@dataclass
class PrecisionScope:
    """What :func:`precision` set: the mode, the Keras policy, and the models built inside
    with the layers it kept in float32 (filled in when the ``with`` block ends)."""

    mode: str
    """memfit's precision mode (resolved)."""
    policy: str
    """The Keras dtype policy set inside the block."""
    islands: dict[str, list[str]] = field(default_factory=dict)
    """Model name -> the layers kept in float32."""


@contextlib.contextmanager
def precision(mode: str, final_fp32: bool = True) -> Iterator[PrecisionScope]:
    """Build Keras models under memfit's precision ``mode``: the global dtype policy is set
    for the block and put back after it, and every model built inside gets its float32
    islands (:func:`fp32_islands`; ``final_fp32=False`` leaves the last layer in the
    compute dtype).

    Layers capture the policy when they are made, so build the model inside the block.
    Models are noticed as they are made (``keras.Model.__init__`` is wrapped for the block,
    and restored after it): build them in this thread.

    Example::

        with memfit.keras.precision("bf16-mixed") as scope:
            model = build()
        model.layers[1].compute_dtype   # "bfloat16"
        scope.islands                    # {"functional": ["layer_normalization", "dense_2"]}
    """
    policy = keras_policy(mode)
    scope = PrecisionScope(resolve_mode(mode), policy)
    previous = keras.config.dtype_policy()
    made: weakref.WeakSet = weakref.WeakSet()
    original_init = keras.Model.__init__

    def noting_init(self: keras.Model, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)
        made.add(self)

    keras.config.set_dtype_policy(policy)
    keras.Model.__init__ = noting_init  # type: ignore[method-assign]
    try:
        yield scope
    finally:
        keras.Model.__init__ = original_init  # type: ignore[method-assign]
        keras.config.set_dtype_policy(previous)
    if policy != "float32":
        # A model inside another one is a layer of it: islands are set from the outermost.
        inner = {id(sub) for m in made for sub in _all_layers(m) if isinstance(sub, keras.Model)}
        for model in sorted((m for m in made if id(m) not in inner), key=lambda m: m.name):
            scope.islands[model.name] = fp32_islands(model, final=final_fp32)
