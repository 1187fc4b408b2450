"""A profile drawn on the line through two others, so that a batch search needs few fake
steps.

Most of a training step's tensors have the batch along one dimension, and its constants
(weights, gradients, optimizer state, a causal mask) have none, so most byte and FLOP
counts of a profile are ``a + b * batch``. Not all: a peak is the largest of several such
lines, and a reduction's workspace may not grow at all. A profile drawn on the line through
two profiled batches is therefore a guess, good for finding where a search should look;
the caller checks what it finds with real (fake-tensor) steps.

Example::

    guess = affine_profile(profiled(2), profiled(4), 30, 2, 4)  # no fake step at batch 30
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["NotAffine", "affine_profile"]

T = TypeVar("T")


class NotAffine(ValueError):
    """Two profiles differ in a way no line through them can describe (a unit more, a
    reason changed)."""


def affine_profile(low: T, high: T, batch: int, low_batch: int, high_batch: int) -> T:
    """The profile at ``batch`` on the line through ``low`` (profiled at ``low_batch``) and
    ``high`` (at ``high_batch``): every number moved along its line, everything else as in
    ``low`` (and equal in ``high``).

    Raises:
        NotAffine: the two differ in something that is not a number.

    Example::

        affine_profile(profiled(2), profiled(4), 30, 2, 4).root.input_bytes
    """
    if high_batch == low_batch:
        raise ValueError("two different batch sizes are needed to draw a line")
    return _along(low, high, (batch - low_batch) / (high_batch - low_batch))


def _along(a: Any, b: Any, t: float) -> Any:
    if isinstance(a, bool) or a is None:
        if a != b:
            raise NotAffine(f"{a!r} != {b!r}")
        return a
    if isinstance(a, int | float) and isinstance(b, int | float):
        value = max(0.0, a + t * (b - a))  # counts and times are never negative
        return round(value) if isinstance(a, int) and isinstance(b, int) else float(value)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            raise NotAffine(f"{type(a).__name__} != {type(b).__name__}")
        changes = {
            f.name: _along(getattr(a, f.name), getattr(b, f.name), t)
            for f in dataclasses.fields(a)
            if f.init
        }
        return dataclasses.replace(a, **changes)
    if isinstance(a, list | tuple):
        if type(a) is not type(b) or len(a) != len(b):
            raise NotAffine("sequences of different lengths")
        values = [_along(x, y, t) for x, y in zip(a, b)]
        return type(a)(*values) if hasattr(a, "_fields") else type(a)(values)  # NamedTuple
    if isinstance(a, dict) and isinstance(b, dict):  # numbers by name (a parameter's)
        if a.keys() != b.keys():
            raise NotAffine("mappings with different keys")
        return type(a)({k: _along(a[k], b[k], t) for k in a})
    if a is b or a == b:
        return a
    raise NotAffine(f"{type(a).__name__} values differ")
