"""What a forward keeps alive that autograd does not save: memory no plan frees.

A unit's forward may hold tensors outside autograd's saved tensors: a custom
``autograd.Function`` that keeps its input as ``ctx.x`` instead of calling
``save_for_backward``, a model that appends each block's hidden activation to a Python
list, a module caching its last output. The saved-tensor hooks the profiler counts with
never see them, and a checkpoint cannot drop them (its forward runs the same code, which
keeps them all the same), so a prediction that leaves them out is low by their size under
every plan, and recomputing such a unit saves less than its saved bytes suggest.

:class:`RetainedTracker` follows, without holding them, the storages each unit's own
forward ops make; what is still alive once the forward and the loss are done, and is
neither saved for backward, nor the model's output or loss, nor a parameter, buffer or
input, is held by something else: :meth:`RetainedTracker.held` gives its bytes by the unit
that made it.

Example::

    tracker = RetainedTracker(resident_keys)
    tracker.made("blocks.0", [out])       # in forward, for each op's outputs
    tracker.held(exclude=saved_keys)      # {"blocks.0": 65536} after the loss
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable
from typing import Any

import torch

__all__ = ["RetainedTracker"]


class RetainedTracker:
    """The storages units' forward ops made, by key, while they live (weakly held)."""

    def __init__(self, resident: Collection[Any]) -> None:
        self.resident = resident
        self.alive: dict[Any, tuple[str, int]] = {}

    def made(self, unit: str, outs: Iterable[torch.Tensor], storage_of: Any) -> None:
        """Follow the storages of ``outs``, made by an op of ``unit``'s own forward, until
        they are freed. ``storage_of(t)`` gives (key, bytes, a reference to the storage)."""
        for t in outs:
            key, nbytes, ref = storage_of(t)
            if key in self.alive or key in self.resident:
                continue  # an in-place op's output, or a view of a tensor already followed
            try:
                weakref.finalize(ref, self.alive.pop, key, None)
            except TypeError:
                continue  # no storage object to follow (sparse, some subclasses)
            self.alive[key] = (unit, nbytes)

    def held(self, exclude: Collection[Any]) -> dict[str, int]:
        """Bytes still alive, by the unit that made them, less the storages in
        ``exclude`` (those saved for backward, the output, the loss)."""
        by_unit: dict[str, int] = {}
        for key, (unit, nbytes) in list(self.alive.items()):
            if key not in exclude:
                by_unit[unit] = by_unit.get(unit, 0) + nbytes
        return by_unit
