"""FLOP counting and the nominal device speed for time estimates on fake tensors.

FLOPs are ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention), plus
:data:`FLOP_FORMULAS` for CPU attention kernels torch does not count; elementwise ops count
0 FLOPs, as in ``FlopCounterMode``. :func:`flop_counter` counts the same way as
:func:`memfit.checkpoint.profiler.profile`.

Example::

    with flop_counter() as fc:
        loss_fn(model(x)).backward()
    fc.get_total_flops()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOP_RATE",
    "FLOP_FORMULAS",
    "FLOP_REGISTRY",
    "flop_counter",
]

#: Nominal FLOP rate (FLOP/s) for time estimates on fake tensors: a modern accelerator's
#: sustained dense 16-bit matmul rate. Pass your device's to :func:`profile`.
DEFAULT_FLOP_RATE = 100e12
#: Nominal memory bandwidth (bytes/s) for time estimates on fake tensors.
DEFAULT_BANDWIDTH = 2e12


def _sdpa_cpu_flops(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flops(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    formulas: dict[Any, Callable[..., int]] = {}
    for name, fn in (
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flops),
    ):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if packet not in flop_registry:
            formulas[packet] = fn
    return formulas


#: FLOP formulas (shape functions, as ``FlopCounterMode(custom_mapping=...)`` takes them)
#: for ops torch's counter misses: CPU fused attention. Used by :func:`profile`.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = _extra_formulas()

#: Every op's FLOP formula as the profiler applies it (``formula(*args, **kwargs,
#: out_val=out)``): torch's registry and :data:`FLOP_FORMULAS`.
FLOP_REGISTRY: dict[Any, Callable[..., int]] = {
    **flop_registry,
    **{k: shape_wrapper(v) for k, v in FLOP_FORMULAS.items()},
}


def flop_counter(display: bool = False) -> FlopCounterMode:
    """A ``FlopCounterMode`` that counts FLOPs as :func:`profile` does.

    Example::

        with flop_counter() as fc:
            loss_fn(model(x)).backward()
        fc.get_total_flops()
    """
    return FlopCounterMode(display=display, custom_mapping=FLOP_FORMULAS)
