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

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode

# torch.utils.flop_counter is imported on first use, not with this module: it imports
# triton where triton is installed (torch's CUDA builds bring it), and triton's LLVM and
# TensorFlow's cannot both load in one process ("LLVM ERROR: inconsistency in registered
# CommandLine options", the process aborted). memfit.keras plans through the solvers of
# this package, which must not bring it into a TensorFlow user's process.

__all__ = [
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOP_RATE",
    "flop_counter",
    "flop_formulas",
    "flop_registry_all",
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
    from torch.utils.flop_counter import sdpa_flop_count

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
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


@functools.cache
def flop_formulas() -> dict[Any, Callable[..., int]]:
    """:data:`FLOP_FORMULAS`: the FLOP formulas (shape functions, as
    ``FlopCounterMode(custom_mapping=...)`` takes them) for ops torch's counter misses: CPU
    fused attention. Used by :func:`profile`.

    >>> isinstance(flop_formulas(), dict)
    True
    """
    from torch.utils.flop_counter import flop_registry

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


@functools.cache
def flop_registry_all() -> dict[Any, Callable[..., int]]:
    """:data:`FLOP_REGISTRY`: every op's FLOP formula as the profiler applies it
    (``formula(*args, **kwargs, out_val=out)``): torch's registry and :func:`flop_formulas`.

    >>> torch.ops.aten.mm in flop_registry_all()
    True
    """
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    return {**flop_registry, **{k: shape_wrapper(v) for k, v in flop_formulas().items()}}


def __getattr__(name: str) -> Any:
    # FLOP_FORMULAS and FLOP_REGISTRY, the module's constants, made on first use.
    if name == "FLOP_FORMULAS":
        return flop_formulas()
    if name == "FLOP_REGISTRY":
        return flop_registry_all()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flop_counter(display: bool = False) -> FlopCounterMode:
    """A ``FlopCounterMode`` that counts FLOPs as :func:`profile` does.

    Example::

        with flop_counter() as fc:
            loss_fn(model(x)).backward()
        fc.get_total_flops()
    """
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=display, custom_mapping=flop_formulas())
