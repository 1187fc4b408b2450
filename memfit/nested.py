"""Nested structures of tensors: the one place memfit walks them and calls a model with them.

Batches, model inputs, model outputs and op arguments come as a tensor or as nested tuples,
lists, dicts, named tuples and dataclasses of tensors (Hugging Face's ``ModelOutput`` is an
ordered dict and a dataclass at once). ``torch.utils._pytree`` flattens the containers it
knows; containers it does not know (a ``Mapping`` or dataclass subclass nobody registered)
are opened here too, so no tensor is missed.

Example::

    from memfit.nested import tensors, map_tensors, call_model
    out = call_model(model, {"input_ids": ids})      # model(**inputs)
    sizes = [t.shape for t in tensors(out)]
    on_device = to_device(batch, "cuda")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

#: Leaves that hold no tensor (an op's scalar arguments, shapes, dtypes and devices).
_NO_TENSORS = frozenset(
    {type(None), bool, int, float, complex, str, torch.Size, torch.dtype, torch.device}
    | {torch.layout, torch.memory_format}
)


def _children(leaf: Any) -> list[Any] | None:
    """The values inside a container pytree treats as a leaf, or None for a true leaf."""
    if isinstance(leaf, Mapping):
        return list(leaf.values())
    if isinstance(leaf, (list, tuple)):  # a subclass pytree does not know
        return list(leaf)
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return [getattr(leaf, f.name) for f in dataclasses.fields(leaf)]
    return None


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, depth first in container order (duplicates kept).

    Example::

        >>> [t.shape for t in tensors({"a": torch.zeros(2), "b": [torch.zeros(3), 1]})]
        [torch.Size([2]), torch.Size([3])]
    """
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
            continue
        # The profiler asks for every op's arguments: plain containers and scalars are
        # walked here (in pytree's order), without pytree's per-node lookups.
        kind = type(item)
        if kind is tuple or kind is list:
            stack.extend(reversed(item))
            continue
        if kind is dict:
            stack.extend(reversed(item.values()))
            continue
        if kind in _NO_TENSORS:
            continue
        leaves = pytree.tree_leaves(item)
        if len(leaves) == 1 and leaves[0] is item:
            inner = _children(item)
            if inner is not None:
                stack.extend(reversed(inner))
            continue
        stack.extend(reversed(leaves))
    return out


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with each tensor replaced by ``fn(tensor)``; containers rebuilt as they were
    (a ``Mapping`` pytree does not know, such as a ``UserDict``, comes back as a ``dict``;
    a dataclass as a copy with its fields mapped).

    Example::

        >>> map_tensors((torch.ones(1), "x"), lambda t: t * 2)
        (tensor([2.]), 'x')
    """

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, Mapping):
            return {k: map_tensors(v, fn) for k, v in value.items()}
        if isinstance(value, (list, tuple)):  # a subclass pytree does not know
            items = [map_tensors(v, fn) for v in value]
            try:
                return type(value)(items)
            except TypeError:
                return items
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {
                f.name: map_tensors(getattr(value, f.name), fn)
                for f in dataclasses.fields(value)
                if f.init
            }
            return dataclasses.replace(value, **changes)
        return value

    return pytree.tree_map(leaf, obj)


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` (a tensor or a nested structure of them, as :func:`map_tensors` takes it)
    with every tensor moved to ``device``; other values are kept as they are.

    Example::

        batch = to_device({"x": torch.zeros(4, 3), "note": "a"}, torch.device("cuda"))
    """
    return map_tensors(obj, lambda t: t.to(device))


def call_model(model: nn.Module | Callable[..., Any], inputs: Any) -> Any:
    """Call ``model`` the way memfit's ``example_inputs`` are defined: a dict as keyword
    arguments (``model(**inputs)``), a tuple as positional ones (``model(*inputs)``),
    anything else as the one argument (``model(inputs)``).

    Example::

        out = call_model(model, (ids, mask))   # model(ids, mask)
    """
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def first_floating(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``obj`` (the default loss sums it), or None."""
    return next((t for t in tensors(obj) if t.is_floating_point()), None)
