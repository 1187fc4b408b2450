"""What a forward keeps alive that autograd does not save: memory no plan frees.

A unit's forward may hold tensors outside autograd's saved tensors: a custom
``autograd.Function`` that keeps its input as ``ctx.x`` instead of calling
``save_for_backward``, a model that appends each block's hidden activation to a Python
list, a module caching its last output. The saved-tensor hooks the profiler counts with
never see the first kind, and a checkpoint cannot drop either (its forward runs the same
code, which keeps them all the same), so a prediction that leaves them out is low by their
size under every plan, and recomputing such a unit saves less than its saved bytes suggest.

:class:`RetainedTracker` follows, without holding them, the storages each unit's own
forward ops make, and the tensors autograd saves. Once the forward and the loss are done:

* a storage still alive that is neither saved for backward, nor the model's output or
  loss, nor a parameter, buffer or input, is held by something else (:meth:`held`);
* a saved tensor that a Python container besides autograd holds (a list, an attribute)
  stays after a recompute of its unit (:meth:`saved_and_held`).

Example::

    tracker = RetainedTracker(resident_keys)
    tracker.made("blocks.0", [out])        # in forward, for each op's outputs
    tracker.held(exclude=saved_keys)       # {"blocks.0": 65536} after the loss
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memfit.checkpoint.profiler.storage import storage_of

__all__ = ["RetainedTracker"]


#: Storages smaller than this are not counted as retained: a kernel may keep a scalar
#: for its later calls (the first step of a GPT keeps 4 bytes a block, the next ones
#: none), which would make two plans of one model differ, and no activation is so small.
SMALLEST = 4096


@dataclass
class _Packed:
    """A tensor autograd saved in a unit's forward, weakly held, and how often."""

    ref: weakref.ref[torch.Tensor]
    packs: int
    key: Any
    nbytes: int


class RetainedTracker:
    """The storages units' forward ops made, by key, while they live (weakly held), and
    the tensors autograd saved."""

    def __init__(self, resident: Collection[Any]) -> None:
        self.resident = resident
        self.alive: dict[Any, tuple[str, int]] = {}
        self.packed: dict[int, _Packed] = {}
        # The bytes of the followed storages alive now: the forward's level, whose highest
        # point in each unit is its forward moment (``Stats.forward_peak_bytes``).
        self.live_bytes = 0

    def saved(self, t: torch.Tensor, key: Any, nbytes: int) -> None:
        """Autograd packed ``t`` (of storage ``key``, ``nbytes``) in a unit's forward."""
        entry = self.packed.get(id(t))
        if entry is not None and entry.ref() is t:
            entry.packs += 1
            return
        try:
            self.packed[id(t)] = _Packed(weakref.ref(t), 1, key, nbytes)
        except TypeError:
            pass  # a tensor that takes no weak reference: not followed

    def saved_and_held(self, exclude: Collection[Any]) -> set[Any]:
        """The storages of saved tensors that a Python container besides autograd holds
        (a list, a tuple, a dict, a module's attributes), less those in ``exclude`` (the
        output, the loss). A view kept in
        the saved tensor's place is not seen (it refers to the storage, not the tensor):
        the verified plan's measurement catches it.

        A tensor with more references than autograd's packs is a candidate; references
        from objects the cycle collector does not see (the autograd engine's own) do not
        count, so a candidate is held only where a container that the collector lists
        as referring to it holds it."""
        found: list[torch.Tensor] = []
        by_id: dict[int, Any] = {}
        for entry in self.packed.values():
            t = entry.ref()
            if t is None or entry.key in exclude:
                continue
            # getrefcount counts its argument and the local ``t``; autograd holds one per pack.
            if sys.getrefcount(t) - 2 - entry.packs > 0:
                found.append(t)
                by_id[id(t)] = entry.key
            del t
        if not found:
            return set()
        candidates = tuple(found)  # passed as is: the call's own argument tuple
        del found
        skip = {id(candidates), id(self.packed)}
        held: set[Any] = set()
        # One walk of the collector's objects for all candidates together.
        for holder in gc.get_referrers(*candidates):
            if id(holder) in skip or not isinstance(holder, (list, tuple, dict, set)):
                continue
            values = holder.values() if isinstance(holder, dict) else holder
            held.update(by_id[id(v)] for v in values if id(v) in by_id)
        del candidates
        return held

    def made(self, unit: str, outs: Iterable[torch.Tensor]) -> None:
        """Follow the storages of ``outs``, made by an op of ``unit``'s own forward, until
        they are freed."""
        for t in outs:
            key, nbytes, ref = storage_of(t)
            if key in self.alive or key in self.resident:
                continue  # an in-place op's output, or a view of a tensor already followed
            try:
                weakref.finalize(ref, self._freed, key)
            except TypeError:
                continue  # no storage object to follow (sparse, some subclasses)
            self.alive[key] = (unit, nbytes)
            self.live_bytes += nbytes

    def _freed(self, key: Any) -> None:
        entry = self.alive.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def unsaved(self, ids: Mapping[Any, int], saved: Collection[Any]) -> dict[int, int]:
        """Of the storages ``ids`` names (units' inputs, by storage key), those alive now
        that a forward op made and nothing in ``saved`` is: bytes by id. A forward moment
        measured now counts them, and a plan that keeps one as a checkpoint's input counts
        it there too (:attr:`~memfit.checkpoint.costs.UnitCost.forward_unsaved_inputs`)."""
        alive = self.alive
        return {i: alive[key][1] for key, i in ids.items() if key in alive and key not in saved}

    def held(self, exclude: Collection[Any]) -> dict[str, int]:
        """Bytes still alive, by the unit that made them, less the storages in
        ``exclude`` (those saved for backward, the output, the loss) and those under
        :data:`SMALLEST` bytes."""
        by_unit: dict[str, int] = {}
        for key, (unit, nbytes) in list(self.alive.items()):
            if key not in exclude and nbytes >= SMALLEST:
                by_unit[unit] = by_unit.get(unit, 0) + nbytes
        return by_unit
