"""The memory behind a tensor, as every part of the profiler keys and sizes it, and the
tensors an op touches."""

from __future__ import annotations

from typing import Any

import torch

from memfit.nested import tensors

__all__ = ["SCALARS", "dense", "op_tensors", "storage_of"]


def storage_of(t: torch.Tensor) -> tuple[Any, int, Any]:
    """(key, bytes, keep-alive reference) of the memory behind ``t``."""
    try:
        st = t.untyped_storage()
        return st._cdata, int(st.nbytes()), st
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        # Tensors without a plain storage (sparse, some subclasses): count the tensor itself,
        # a sparse one by what it stores (its indices and values), not its dense shape.
        if t.layout == torch.sparse_coo:
            parts = (t._indices(), t._values())
            return ("tensor", id(t)), sum(p.numel() * p.element_size() for p in parts), t
        return ("tensor", id(t)), t.numel() * t.element_size(), t


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory each once, in any order of its
    dimensions (a contiguous tensor, or one transposed): what an in-place add needs."""
    expected = 1
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


#: Argument types that hold no tensor (an op's scalars, dtypes, devices, shapes).
SCALARS = frozenset({type(None), bool, int, float, torch.dtype, torch.device, torch.Size})


def op_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """``tensors((args, kwargs))``, walking an op's flat arguments without the general
    walk (this runs for every op of a step)."""
    found: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif type(a) not in SCALARS:
            found.extend(tensors(a))
    if kwargs:
        found.extend(tensors(kwargs))
    return found
