"""The memory behind a tensor, as every part of the profiler keys and sizes it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["storage_of"]


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
