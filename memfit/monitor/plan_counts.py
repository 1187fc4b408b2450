"""What a checkpoint plan recomputes, counted over its units (:func:`plan_unit_counts`):
the one count the run advice and the tuner's advice both give.

Example::

    plan_unit_counts(plan.decisions, plan.segments).recomputed   # units rebuilt in backward
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["UnitCounts", "plan_unit_counts", "recomputed_units"]


@dataclass(frozen=True)
class UnitCounts:
    """What a plan recomputes, counted over its units: the innermost units it decided on
    (the model itself and the containers of other units left out, so a 4-block GPT has 4),
    each recomputed whole (``"recompute"``, or inside a recomputed ancestor or a segment)
    or selectively (``"selective"``: the matmul outputs kept, the cheap ops between them
    rebuilt, which a matmul FLOP count does not see).

    Example::

        plan_unit_counts({"": "keep", "blocks.0": "recompute", "blocks.1": "selective"}, {})
        # UnitCounts(units=2, whole=1, selective=1)
    """

    units: int
    whole: int
    selective: int

    @property
    def recomputed(self) -> int:
        """Units recomputed, whole or selectively."""
        return self.whole + self.selective


def plan_unit_counts(decisions: Mapping[str, str], segments: Any = None) -> UnitCounts:
    """:class:`UnitCounts` of a plan's ``decisions`` and ``segments`` (a ``sqrt`` plan
    keeps every unit's decision and recomputes through segments of them): the one count
    the run advice and the tuner's advice both give."""
    names = [str(n) for n in decisions]
    leaves = [n for n in names if n and not any(o.startswith(n + ".") for o in names)]
    leaves = leaves or names
    whole_prefixes = [n for n in names if decisions[n] == "recompute"]
    if isinstance(segments, Mapping):
        for parent, spans in segments.items():
            for span in spans or ():
                start, end = span
                for i in range(int(start), int(end) + 1):
                    whole_prefixes.append(f"{parent}.{i}" if parent else str(i))

    def inside(leaf: str, prefixes: list[str]) -> bool:
        return any(p == "" or leaf == p or leaf.startswith(p + ".") for p in prefixes)

    whole = sum(1 for leaf in leaves if inside(leaf, whole_prefixes))
    selective_prefixes = [n for n in names if decisions[n] == "selective"]
    selective = sum(
        1
        for leaf in leaves
        if not inside(leaf, whole_prefixes) and inside(leaf, selective_prefixes)
    )
    return UnitCounts(len(leaves), whole, selective)


def recomputed_units(decisions: Mapping[str, str], segments: Any) -> int:
    """Units a plan recomputes, whole or selectively (:func:`plan_unit_counts`)."""
    return plan_unit_counts(decisions, segments).recomputed
