"""Whether a chain's children run one after another, each on the last one's output only:
what running the chain in segments (one checkpoint over several children) needs.

A *chain* is a unit whose children the profiler may group into segments (an
``nn.Sequential``, a ``ModuleList`` the forward loops over). Segments are sound only if
each child takes the previous child's output alone, in order, and nothing but the next
child uses an output (a parent collecting every hidden state breaks it): one segment
yields one output. :class:`ChainWatch` follows the profiled step's calls and ops and
records, per chain, a :class:`ChainState`.

Example::

    watch = ChainWatch(tree)
    watch.enter("blocks.0", (x,), {}); watch.exit("blocks.0", y)
    watch.chains["blocks"].ok
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.checkpoint.profiler.storage import storage_of
from memfit.checkpoint.tree import UnitTree

__all__ = ["ChainState", "ChainWatch"]


@dataclass
class ChainState:
    """What one chain's calls showed."""

    n: int  # its children
    expected: int = 0  # the child that should run next
    passes: int = 0  # complete passes over every child
    ok: bool = True  # every call so far in order, on the previous output alone
    last_out: torch.Tensor | None = None  # the last child's output, until the next one's


class ChainWatch:
    """The chains of ``tree``, followed through one profiled step."""

    def __init__(self, tree: UnitTree) -> None:
        self.parent_of: dict[str, tuple[str, int]] = {}
        self.chains: dict[str, ChainState] = {}
        self.children: dict[str, list[str]] = {}
        for unit in tree:
            if unit.is_chain:
                self.chains[unit.name] = ChainState(len(unit.children))
                self.children[unit.name] = [c.name for c in unit.children]
                for k, child in enumerate(unit.children):
                    self.parent_of[child.name] = (unit.name, k)
        # A chain child's output (but the last's), by storage: segments are sound only if
        # nothing but the next child uses it (not a parent collecting hidden states).
        self.outputs: dict[Any, tuple[str, int]] = {}

    def enter(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Unit ``name`` is called with ``args`` and ``kwargs``."""
        where = self.parent_of.get(name)
        if where is None:
            return
        state = self.chains[where[0]]
        k = where[1]
        single = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(single, torch.Tensor) or k != state.expected:
            state.ok = False
        elif k > 0 and single is not state.last_out:
            state.ok = False

    def exit(self, name: str, output: Any) -> None:
        """Unit ``name`` returned ``output``."""
        where = self.parent_of.get(name)
        if where is None:
            return
        state = self.chains[where[0]]
        k = where[1]
        if not isinstance(output, torch.Tensor):
            state.ok = False
        state.last_out = output if isinstance(output, torch.Tensor) else None
        if isinstance(output, torch.Tensor) and k < state.n - 1:
            key, _, ref = storage_of(output)
            self.outputs[key] = (where[0], k)
            # A key is a storage's address: once the storage is freed, another tensor may
            # get it, and would pass for this output used out of turn (which made whether a
            # chain runs in segments vary from run to run). The entry dies with the storage.
            try:
                weakref.finalize(ref, self.outputs.pop, key, None)
            except TypeError:
                pass  # a tensor without a plain storage: keyed by the tensor's own id
        state.expected = (k + 1) % state.n
        if k == state.n - 1:
            state.passes += 1

    def check_use(
        self, items: list[torch.Tensor], running: Sequence[str], inside: str | None = None
    ) -> None:
        """A chain child's output used anywhere but inside the next child (an op of the
        parent's, or a unit's output holding ``items``; ``running``: the units whose
        forward is running): the chain cannot run in segments, which yield one output per
        segment."""
        if not self.outputs:
            return
        for t in items:
            where = self.outputs.get(storage_of(t)[0])
            if where is None:
                continue
            chain, k = where
            allowed = self.children[chain][k + 1]
            if inside == allowed or allowed in running:
                continue
            if inside == self.children[chain][k]:
                continue  # the child returning its own output
            self.chains[chain].ok = False

    def held(self) -> list[torch.Tensor]:
        """The outputs this watch itself holds (each chain's last)."""
        return [s.last_out for s in self.chains.values() if s.last_out is not None]
